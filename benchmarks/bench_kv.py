"""KV cache memory before and after paging, and how many sequences run at once in the same memory.

Before paging the engine reserved `max_model_len` tokens of keys and values per sequence slot, so
`S` slots cost `S * max_model_len` tokens whatever the requests. With paging a sequence holds
ceil(tokens / kv_block_size) blocks. This script runs the bench_engine workload (prompts of 8-96
words, 16-64 output tokens, adapters Zipf over 64) on the demo `base` model with a KV cache of the
size that held `--slots` sequences before (`num_kv_blocks = slots * max_model_len / block_size`)
and `max_num_seqs` large, and records at every step the sequences running and the blocks they
hold: KV bytes per sequence (mean and largest, at their largest) and the most sequences that ran
at once, against `--slots` before.

Run: python benchmarks/bench_kv.py [--requests 128] [--slots 4] [--out docs/bench_kv.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
from bench_engine import workload
from common import emit, machine

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import SamplingParams, build_engine

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=4, help="sequences the same memory held before paging")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--zoo", type=Path, default=Path(".demo/base"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    zoo = build_demo_zoo(args.zoo, num_adapters=64, size="base", seed=0)
    jobs = workload(args.requests, 64, seed=0)
    max_len = 2048
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_loras=32,
                          max_lora_rank=32, max_model_len=max_len, max_num_seqs=args.requests,
                          max_num_batched_tokens=4096, kv_block_size=args.block_size,
                          num_kv_blocks=args.slots * max_len // args.block_size)  # fmt: skip
    block_bytes = engine.kv.nbytes // engine.kv.num_blocks
    token_bytes = block_bytes // args.block_size
    for aid in sorted({a for _, a, _ in jobs}):
        engine.load_adapter(aid)
    for i, (prompt, aid, m) in enumerate(jobs):
        params = SamplingParams(max_new_tokens=m, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, aid, params)
    blocks = engine.scheduler.kv_blocks
    peak_running, held_max = 0, {}
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        peak_running = max(peak_running, len(running))
        for seq in running:
            held = len(blocks.table(seq.kv_slot))
            held_max[seq.request_id] = max(held_max.get(seq.request_id, 0), held)
    per_seq = [n * block_bytes for n in held_max.values()]
    before = max_len * token_bytes
    stats, dims = engine.stats(), engine.model.dims
    mean, largest = sum(per_seq) / len(per_seq) / MIB, max(per_seq) / MIB
    lines = [
        f"- date: {datetime.date.today()}; machine: {machine()}, torch "
        f"{torch.__version__}; 1-minute load average {os.getloadavg()[0]:.1f} (shared machine; only counts "
        "are reported here, no timings)",
        f"- model: demo base ({dims.num_layers} layers, {dims.num_kv_heads} KV heads x {dims.head_dim}, "
        f"{engine.dtype}): {token_bytes / 1024:.0f} KiB of keys and values per token; max_model_len "
        f"{max_len}, kv_block_size {args.block_size}",
        f"- workload: {len(jobs)} requests (bench_engine's), KV cache {engine.kv.nbytes / MIB:.0f} MiB = "
        f"{args.slots} x max_model_len (num_kv_blocks {engine.kv.num_blocks})",
        f"- command: `python benchmarks/bench_kv.py {' '.join(sys.argv[1:])}`",
        "",
        "| | before paging | paged |",
        "|---|---:|---:|",
        f"| KV memory per sequence, mean | {before / MIB:.1f} MiB | {mean:.2f} MiB |",
        f"| KV memory per sequence, largest | {before / MIB:.1f} MiB | {largest:.2f} MiB |",
        f"| sequences running at once in {engine.kv.nbytes / MIB:.0f} MiB | {args.slots} | {peak_running} |",
        "",
        f"- preemptions (a running sequence short of a block, recomputed): {stats.num_preemptions}; "
        f"free blocks at the end: {blocks.num_free_blocks} of {blocks.num_blocks} (no leak)",
    ]
    text = "\n".join(lines)
    emit(text, args.out, title="Paged KV cache: memory per sequence", doc=__doc__)


if __name__ == "__main__":
    main()

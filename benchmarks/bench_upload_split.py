"""Benchmark of an adapter's copy from host memory into a device slot against its fetch and a prefill
step, on the CPU engine: would layer-by-layer upload help a first request?

    .venv/bin/python benchmarks/bench_upload_split.py [--out docs/bench_upload_split.md] [--reps 5]

Builds the demo zoo (`size="base"`: a ~88M-parameter, 12-layer Llama; 15 adapters, ranks 8-32 over
five target sets) plus one crafted rank-64 adapter on all seven projections, served from a local
folder (the tiered store, as shipped). Per adapter, the fastest of `--reps` runs (the machine is
shared: the fastest is the cost without interference) of:

* source -> host: `store.load` with the host tier emptied (read, sha256, safetensors parse, shape
  validation; the local folder stands in for the source, so no transfer time is in it), and the
  transfer alone at the GPU profile's S3 rate (100 MB/s, `docs/profile_gpu_papers.json`), computed;
* host -> slot: `AdapterPool.allocate` of the weights already in host memory (on this CPU-only
  machine the slot is host memory too);
and the prefill of a 128- and a 512-token prompt on the base model (a 1-token request; the fastest of
`--reps`).

Layer-by-layer upload overlaps the copy of layer i+1 with the compute of layer i: at best it hides
(L-1)/L of the host -> slot copy (L layers), never any of the fetch, which must end before the copy
starts. The last columns give that best case against the time to a first token of a cold request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_store import craft_big_adapter, mb, ms, timed
from common import emit, header

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import SamplingParams, build_engine

S3_BYTES_PER_S = 100e6  # the GPU profile's source bandwidth (docs/profile_gpu_papers.json)
BIG_RANK = 64
WORDS = ("the", "river", "carried", "lanterns", "past", "the", "mill", "while", "the", "farmer", "counted",
         "sheep")


def prefill_seconds(engine: object, tokens: int, reps: int) -> tuple[float, int]:
    """The fastest 1-token base-model request whose prompt has about `tokens` tokens, and their count.
    Each run's prompt starts with another word, so that none is served from the prefix cache."""
    encode = engine.tokenizer.encode  # type: ignore[attr-defined]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    runs, count = [], 0
    for rep in range(reps + 1):  # the first run warms up
        words = [WORDS[(rep + i) % len(WORDS)] + str(rep) * (i == 0) for i in range(tokens)]
        while len(encode(" ".join(words), add_special_tokens=True)) > tokens:
            words = words[:-8]
        prompt = " ".join(words)
        count = len(encode(prompt, add_special_tokens=True))
        seconds = timed(lambda p=prompt: engine.generate([p], sampling=params))  # type: ignore[attr-defined]
        if rep:
            runs.append(seconds)
    return min(runs), count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-upload-"))
    zoo = build_demo_zoo(work / "zoo", num_adapters=15, size="base", seed=0)
    craft_big_adapter(zoo.model_dir, zoo.adapters_dir / "r64", rank=BIG_RANK)
    layers = json.loads((zoo.model_dir / "config.json").read_text())["num_hidden_layers"]
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_loras=4,
                          max_lora_rank=BIG_RANK, max_num_seqs=4, host_cache_bytes="2GiB")
    store, pool = engine.loader, engine.pool
    rows = []
    for aid in [*zoo.adapter_ids, "r64"]:
        fetch, copy = [], []
        for _ in range(args.reps):
            store.host.remove(aid)
            start = time.perf_counter()
            weights = store.load(aid)
            fetch.append(time.perf_counter() - start)
            copy.append(timed(lambda w=weights: pool.allocate(w)))
            pool.evict(aid)
        nbytes = store.host.nbytes(aid) or 0
        rows.append((aid, weights.rank, nbytes, min(fetch), min(copy)))
    prefills = {n: prefill_seconds(engine, n, args.reps) for n in (128, 512)}
    engine.close()
    lines = header("Host -> slot copy against fetch and prefill (CPU engine)",
                   "python benchmarks/bench_upload_split.py " + " ".join(argv or sys.argv[1:]),
                   level=2, changed={},
                   machine_note=f" (1-minute load average {load_before:.2f} at the start, "
                   f"{os.getloadavg()[0]:.2f} at the end)")
    lines += ["", f"Model: demo zoo `base`, {layers} layers. Prefill (1-token request, base model): "
              + ", ".join(f"{tok} tokens {ms(s)}" for s, tok in prefills.values())
              + " (each prompt missing the prefix cache).", "",
              "| adapter | rank | bytes | source -> host, local | at 100 MB/s (computed) | host -> slot "
              "| best saving of layer-by-layer | share of a cold first token (512-token prompt, S3) |",
              "|" + "---|" * 8]
    p512 = prefills[512][0]
    for aid, rank, nbytes, fetch_s, copy_s in sorted(rows, key=lambda r: (r[1], r[2])):
        s3 = nbytes / S3_BYTES_PER_S
        saving = copy_s * (layers - 1) / layers
        cold = s3 + fetch_s + copy_s + p512
        lines.append(f"| {aid} | {rank} | {mb(nbytes)} | {ms(fetch_s)} | {ms(s3)} | {ms(copy_s)} "
                     f"| {ms(saving)} | {100 * saving / cold:.2f}% |")
    emit("\n".join(lines), args.out, title="bench_upload_split", doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The LoRA layer's paths, one change at a time: SGMV vs gathered BGMV for decode rows, one shrink per
projection vs one fused shrink for q/k/v and gate/up.

Times `LoraLayer.add` for every projection of one decoder layer of the demo `base` model shape
(hidden 768, intermediate 2048, GQA 12/4 heads) over a decode batch: `--batch` tokens whose adapters
follow a mix (every token its own adapter; runs of 2, 4, 8 tokens sharing one; one adapter for
all), all projections targeted at `--rank`. Each variant is timed `--reps` times, alternating the
variants, and keeps its best; a time is the smallest CPU time of this thread (`time.thread_time`,
one torch thread) over `--iters` calls: on a machine shared with other jobs, wall time mostly
measures waiting for a core, CPU time measures the work. The table gives microseconds per layer and
the speed-up over the plain path (SGMV, no fusion). The run also shows where BGMV stops paying
off as runs of one adapter get longer (the engine's `BGMV_MAX_MEAN_RUN`).

Run: python benchmarks/bench_lora_layer.py [--batch 32] [--rank 8] [--out docs/bench_lora_layer.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
from common import emit, machine
from lora_kernels import get_lora_ops

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.model.lora_layer import LoraLayer, StepLoraPlan
from lora_cluster.engine.model.step_buffers import StepBuffers

HIDDEN, INTER, Q, KV = 768, 2048, 768, 256
VARIANTS = {  # name -> (decode kernel, fused shrink)
    "sgmv, per projection (before)": ("sgmv", False),
    "bgmv, per projection": ("bgmv", False),
    "sgmv, fused shrink": ("sgmv", True),
    "bgmv, fused shrink": ("bgmv", True),
}
SPLITS = {
    "q_proj": ("qkv", 0, Q), "k_proj": ("qkv", Q, Q + KV), "v_proj": ("qkv", Q + KV, Q + 2 * KV),
    "gate_proj": ("gate_up", 0, INTER), "up_proj": ("gate_up", INTER, 2 * INTER),
}  # fmt: skip


def make_pool(num_slots: int, rank: int) -> AdapterPool:
    shapes = ModelShapes(num_layers=1, modules={
        "q_proj": (HIDDEN, Q), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (Q, HIDDEN),
        "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN),
    })  # fmt: skip
    cpu = torch.device("cpu")
    pool = AdapterPool(shapes, num_slots=num_slots, max_rank=rank, dtype=torch.float32, device=cpu)
    gen = torch.Generator().manual_seed(0)
    for m, (i, o) in shapes.modules.items():
        pool.a[m].copy_(torch.randn(1, num_slots, rank, i, generator=gen) / i**0.5)
        pool.b[m].copy_(torch.randn(1, num_slots, o, rank, generator=gen) * 0.01)
        pool.module_ranks[m] = [rank] * num_slots
    return pool


def time_variant(pool: AdapterPool, slots: list[int], decode_kernel: str, fused: bool, iters: int) -> float:
    """Least CPU seconds of one layer's LoRA (all projections) over the batch."""
    layer = LoraLayer(pool, get_lora_ops("cpu"), SPLITS, fused)
    rows = {k: list(range(pool.num_slots)) for k in pool.rows}  # make_pool fills every slot's own row
    step = StepLoraPlan(slots, len(slots), pool.module_ranks, rows, layer.groups, decode_kernel)
    lora = step.build(StepBuffers(torch.device("cpu")).pack(step.lists()))
    t = len(slots)
    x = torch.randn(t, HIDDEN)
    act = torch.randn(t, INTER)
    qkv, gu = torch.zeros(t, Q + 2 * KV), torch.zeros(t, 2 * INTER)
    o, down = torch.zeros(t, HIDDEN), torch.zeros(t, HIDDEN)
    times = []
    for _ in range(iters):
        start = time.thread_time()
        layer.add(lora, 0, "qkv", qkv, x)
        layer.add(lora, 0, "o_proj", o, x)
        layer.add(lora, 0, "gate_up", gu, x)
        layer.add(lora, 0, "down_proj", down, act)
        times.append(time.thread_time() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = args.batch
    pool = make_pool(b, args.rank)
    mixes = {f"runs of {n}": [i // n for i in range(b)] for n in (1, 2, 4, 8)}
    mixes["one adapter"] = [0] * b
    best = {(mix, v): float("inf") for mix in mixes for v in VARIANTS}
    for _ in range(args.reps):  # alternate the variants, keep each one's best
        for mix, slots in mixes.items():
            for v, (kernel, fused) in VARIANTS.items():
                best[mix, v] = min(best[mix, v], time_variant(pool, slots, kernel, fused, args.iters))
    load = os.getloadavg()[0]
    lines = [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {machine()}, "
        f"torch {torch.__version__}, 1 thread; 1-minute load average at the end "
        f"{load:.1f} (the machine is shared with other jobs)",
        f"- batch {b} decode tokens, rank {args.rank}, all 7 projections, base-model shapes, float32, "
        "cpu ops",
        f"- command: `python benchmarks/bench_lora_layer.py {' '.join(sys.argv[1:])}`",
        "",
        "| adapters in the batch | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
    ]
    for mix in mixes:
        plain = best[mix, next(iter(VARIANTS))]
        cells = [f"{best[mix, v] * 1e6:.0f} us ({plain / best[mix, v]:.2f}x)" for v in VARIANTS]
        lines.append(f"| {mix} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    emit(text, args.out, title="LoRA layer paths", doc=__doc__)


if __name__ == "__main__":
    main()

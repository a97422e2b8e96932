"""The native CPU LoRA kernel alone (`lora_kernels.native`) over one decode step's weights.

One step of the demo `base` model's shapes (12 layers x q, k, v, o, gate, up, down: 84 projections),
32 tokens of 32 distinct adapters in a pool of 33 slots, every projection targeted at `--rank`: each
call reads its tokens' rank rows from memory (the step's weights, 166.7 MB at rank 8, do not fit in
cache, so each step reads them again). Reports the median and best time of a step's calls and the
weight bytes read per second. With `--baseline FILE.cpp` (another version of `cpu_native.cpp`, e.g.
`git show REV:kernels/lora_kernels/cpu_native.cpp > /tmp/old.cpp`) that version is built too, under
another name, and the two alternate step by step in one process, so that both see the same machine.

Run: python benchmarks/bench_native_kernel.py [--baseline /tmp/old.cpp] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from lora_kernels import build_lora_meta, native

LAYER = [(768, 768), (768, 256), (768, 256), (768, 768), (768, 2048), (768, 2048), (2048, 768)]  # (K, N)


def _build_baseline(source: str) -> Callable[..., None]:
    from torch.utils import cpp_extension

    folder = tempfile.mkdtemp(prefix="lora-native-baseline-")
    module = cpp_extension.load(name="lora_native_baseline", sources=[source],
                                extra_cflags=["-O3", "-fopenmp-simd"], build_directory=folder, verbose=False)
    return module.add_lora


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another cpu_native.cpp to build and alternate with")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.load():
        raise SystemExit(f"the native kernel does not build here: {native.load_error()}")
    tokens, slots, max_rank = 32, 33, 32
    gen = torch.Generator().manual_seed(0)
    projections = [  # out, x, lora_a [L, R, K], lora_b [L, N, R] (as the pool exposes them)
        (torch.zeros(tokens, n), torch.randn(tokens, k, generator=gen),
         torch.randn(slots, max_rank, k, generator=gen), torch.randn(slots, max_rank, n, generator=gen).mT)
        for k, n in LAYER * 12
    ]
    meta = build_lora_meta(torch.randperm(slots, generator=gen)[:tokens], [args.rank] * slots)
    kernels: dict[str, Callable[..., None]] = {
        "current": lambda out, x, a, b: native.add_lora(out, x, a, b, meta)}
    if args.baseline:
        raw = _build_baseline(args.baseline)
        kernels["baseline"] = lambda out, x, a, b: raw(out, x, a, b.mT, meta.seg_indptr, meta.seg_slot,
                                                       meta.seg_rank)
    nbytes = sum(tokens * args.rank * (k + n) * 4 for k, n in LAYER * 12)
    for name, fn in kernels.items():  # equal results first
        out0 = [out.clone() for out, *_ in projections[:7]]
        for o, (_, x, a, b) in zip(out0, projections[:7], strict=True):
            fn(o, x, a, b)
        if name == "current":
            want = out0
        else:
            for o, w in zip(out0, want, strict=True):
                torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-3)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.steps):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            for out, x, a, b in projections:
                fn(out, x, a, b)
            times[name].append(time.perf_counter() - t0)
    print(f"{len(projections)} projections, {tokens} tokens of distinct adapters, rank {args.rank}, "
          f"{nbytes / 1e6:.1f} MB of weights per step, {args.threads} thread(s), {args.steps} steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = nbytes / med / 1e9
        print(f"{name}: median {med * 1e3:.2f} ms, best {min(ts) * 1e3:.2f} ms, {gbs:.1f} GB/s")
    if args.baseline:
        ratio = statistics.median(times["baseline"]) / statistics.median(times["current"])
        print(f"baseline / current (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Where the engine's time goes on the benchmark workload: a torch.profiler table by operator.

Runs the bench_engine workload (first N requests, adapters as drawn) once under torch.profiler and
prints the operators that take the most self CPU time, plus the share of the LoRA kernels' own
Python (the per-segment loop) measured with cProfile.

Run: python benchmarks/profile_engine.py [--requests 64]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import run_engine, workload

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import SamplingParams, build_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--zoo", type=Path, default=Path(".demo/base"))
    args = ap.parse_args()
    zoo = build_demo_zoo(args.zoo, num_adapters=64, size="base", seed=0)
    jobs = workload(args.requests, 64, seed=0)
    used = sorted({a for _, a, _ in jobs})
    engine = build_engine(
        model=str(zoo.model_dir),
        adapter_source=str(zoo.adapters_dir),
        max_loras=32,
        max_lora_rank=32,
        max_num_seqs=64,
    )
    engine.generate(
        ["warm"] * len(used), adapter_ids=used, sampling=SamplingParams(max_new_tokens=2, temperature=0)
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total = run_engine(engine, jobs, use_adapters=True)
    print(f"engine, {len(jobs)} requests with adapters: {total:.1f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    stats_file = "/tmp/lora-cluster-profile.out"
    cProfile.runctx("run_engine(engine, jobs, True)", globals(), {"engine": engine, "jobs": jobs}, stats_file)
    pstats.Stats(stats_file).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()

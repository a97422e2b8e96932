"""Engine bookkeeping with thousands of known adapters: does a step cost O(active) or O(known)?

One engine (tiny demo model, `max_loras` 32, the tiered store over a local folder), first taught
`--known` adapters: each one is loaded through the store once and requested once (so the host tier,
the lifecycle, the access history and the version table all hold thousands of ids). Then the same
workload runs for `--known` = 5,000 and for `--known` = 64 engines: `--requests` greedy requests
over `--active` adapters drawn from the known ones (more active adapters than slots, so adapters
are placed and evicted during the run). Reported per engine step: the bookkeeping time on the step
thread (`Scheduler.schedule`, with the adapter gate it calls, and `AdapterResidency.end_step`, with
rotation and prefetch), the whole step, and the host tier's admission time on the loader threads
(`TierIndex.plan`); then the bookkeeping functions that take the most time under cProfile in the
5,000-adapter run. Runs alternate (`--rounds`), best kept. The forward pass is not bookkeeping and
is noisy on a shared machine: compare the bookkeeping columns.

The 5,000 adapters are symlinks to the 16 adapters of a tiny demo zoo (ids differ, weights repeat),
which is all a store's bookkeeping sees.

Run: python benchmarks/profile_scale.py [--known 5000] [--active 96] [--requests 192] [--rounds 2]
     [--out docs/bench_scale.md]  (markdown lines to append to a report)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import symlink_farm

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine

BOOKKEEPING = ("lora_cluster/store/", "adapters/residency", "adapters/rotation", "adapters/pool", "scheduler",
               "adapters/copier", "usage", "lifecycle")


def adapter_farm(root: Path, zoo_adapters: Path, n: int) -> Path:
    """`root/x0..x{n-1}`, each a symlink to one of the zoo's adapters (created once)."""
    return symlink_farm(root, sorted(p for p in zoo_adapters.iterdir() if p.is_dir()), n)


def scale_engine(model: Path, farm: Path, known: int, cache_dir: Path) -> Engine:
    engine = build_engine(model=str(model), adapter_source=str(farm), max_loras=32, max_lora_rank=32,
                          max_num_seqs=32, disk_cache_dir=str(cache_dir))
    for i in range(known):  # every known adapter loaded once through the store and requested once
        aid = f"x{i}"
        engine.loader.request_started(aid)
        engine.loader.load(aid)
        engine.loader.load_abandoned(aid)
        engine.loader.request_finished(aid)
    return engine


class Timer:
    """Wraps a callable and sums the wall time spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def instrument(engine: Engine) -> dict[str, Timer]:
    timers = {"schedule": Timer(engine.scheduler.schedule), "end_step": Timer(engine.adapters.end_step),
              "host plan": Timer(engine.loader.host.index.plan)}
    engine.scheduler.schedule = timers["schedule"]
    engine.adapters.end_step = timers["end_step"]
    engine.loader.host.index.plan = timers["host plan"]
    return timers


def run(engine: Engine, active: list[str], requests: int, seed: int) -> dict[str, float]:
    """Run the workload; returns ms per step of the whole step and of each instrumented part."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    timers = instrument(engine)
    for i in range(requests):
        engine.add_request(f"r{seed}-{i}", "the river runs past the town", rng.choice(active), params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    for name, timer in timers.items():  # unwrap
        if name == "schedule":
            engine.scheduler.schedule = timer.fn
        elif name == "end_step":
            engine.adapters.end_step = timer.fn
        else:
            engine.loader.host.index.plan = timer.fn
    return {"step": total / steps * 1e3, **{n: t.seconds / steps * 1e3 for n, t in timers.items()},
            "steps": steps}


def host_admission_us(known: int) -> float:
    """Mean microseconds of one host-tier admission (with room) once `known` adapters are held and
    tracked: the loader thread's cost per load, under the GIL the step thread also needs."""
    from lora_cluster.replica_policy.eviction import AccessTracker
    from lora_cluster.store.tier import TierIndex

    tracker = AccessTracker(60.0, 4)
    index = TierIndex(1 << 40, priority=tracker.priority)
    for i in range(known):
        tracker.record(f"x{i}")
        index.admit(f"x{i}", f"x{i}", 1000, 0.1)
    start = time.perf_counter()
    for i in range(100):
        index.admit(f"new{i}", f"new{i}", 1000, 0.1)
    return (time.perf_counter() - start) / 100 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--known", type=int, default=5000)
    ap.add_argument("--small", type=int, default=64, help="known adapters of the comparison engine")
    ap.add_argument("--active", type=int, default=96)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--admission-only", action="store_true", help="only the host-tier admission cost")
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-scale-zoo")
    args = ap.parse_args()
    for n in (args.small, args.known):
        print(f"host-tier admission with {n} adapters held: {host_admission_us(n):.1f} us", flush=True)
    if args.admission_only:
        return
    zoo = build_demo_zoo(args.zoo, num_adapters=16, size="tiny", seed=0)
    farm = adapter_farm(args.zoo / "farm", zoo.adapters_dir, max(args.known, args.small))
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        engines = {n: scale_engine(zoo.model_dir, farm, n, Path(cache) / str(n))
                   for n in (args.known, args.small)}
        print(f"taught {args.known} + {args.small} adapters in {time.perf_counter() - t0:.1f} s")
        print("settings: EngineConfig defaults except max_loras=32, max_lora_rank=32 and a disk cache folder "
              "(the scenario's slots, adapters and a private cache)")
        active = {n: [f"x{i}" for i in random.Random(1).sample(range(n), min(args.active, n))]
                  for n in engines}
        best: dict[int, dict[str, float]] = {}
        for r in range(args.rounds):
            for n, engine in engines.items():
                result = run(engine, active[n], args.requests, seed=r)
                print(f"round {r}: known={n}: {result}")
                best[n] = {k: min(v, best.get(n, {}).get(k, float("inf"))) for k, v in result.items()}
        profiler = cProfile.Profile()
        profiler.enable()
        run(engines[args.known], active[args.known], args.requests, seed=99)
        profiler.disable()
        snapshot = engines[args.known].loader.snapshot().get("tracked", {})
        for engine in engines.values():
            engine.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    total = sum(t for (_, _, t, _, _) in stats.stats.values())
    rows = sorted(((tt, f"{Path(f).name}:{ln} {fn}") for (f, ln, fn), (_, _, tt, _, _) in stats.stats.items()
                   if any(k in f for k in BOOKKEEPING)), reverse=True)[:8]
    print("\n| known adapters | schedule ms/step | end_step ms/step | bookkeeping ms/step | whole step ms "
          "| host admission (loader threads) ms/step |\n|---:|---:|---:|---:|---:|---:|")
    for n in sorted(best):
        b = best[n]
        print(f"| {n} | {b['schedule']:.3f} | {b['end_step']:.3f} | {b['schedule'] + b['end_step']:.3f} "
              f"| {b['step']:.1f} | {b['host plan']:.3f} |")
    book = {n: best[n]["schedule"] + best[n]["end_step"] for n in best}
    ratio = book[args.known] / book[args.small]
    print(f"\nbookkeeping ratio known={args.known} / known={args.small}: {ratio:.2f}")
    print(f"store structures after the run (known={args.known}): {snapshot}")
    print(f"\nbookkeeping functions by own time (cProfile, known={args.known}; "
          f"all functions: {total:.2f} s):")
    for tt, name in rows:
        print(f"  {tt * 1e3:8.1f} ms  {name}")


if __name__ == "__main__":
    main()

"""Where the controller's CPU goes, per input kind, in one simulator run (cProfile, Python level).

Runs `python -m lora_cluster.sim` in process with the options given (default: the issue 45 cell,
256 x 10,000 at 2x, 20 s measured after the default 30 s of warm-up; the shipped defaults
otherwise, the controller actor's loop modelled), recording every controller call with its answer
(`LoraClusterPolicy.trace`). The recorded calls after the warm-up are then replayed through fresh
`Controller`s (one per shard) on the recorded clock, each answer checked against the recorded one (so
the figures are the cost of the same decisions), twice: once timed on the thread's CPU clock (per
kind: calls, CPU s per simulated second, µs per call, and for parks µs per parked ticket; per shard its
CPU s per simulated second), once under one `cProfile.Profile` per call kind (`report`, `park_many`,
`dispatch`, `tick`, `take_grants`, `edge_state`, `placement`, `cancel`), printing each kind's `--top`
functions by own time. cProfile slows Python code 1.5-3x and weighs function calls more than loops:
its shares point at the costs, the timed replay gives them. Compiled modules (mypyc) are opaque to
cProfile: profile under `LORA_CLUSTER_PURE_PYTHON=1`.

`--trace FILE` keeps the recorded calls there (pickled) and replays that file instead of running the
simulator when it exists: the code before and after a change then replays the same calls, and must
answer as recorded (a change that alters a decision stops the replay).

Run: python benchmarks/profile_controller_calls.py [--top 15] [--trace FILE] [--no-profile]
         [-- sim options...]
     e.g. python benchmarks/profile_controller_calls.py -- --nodes 256 --adapters 10000 --load 2
          --duration 20 --controller-shards 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pickle
import pstats
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import freeze_recording, load_avg

from lora_cluster import compiled
from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.process_gc import set_young_threshold
from lora_cluster.config import ControllerConfig
from lora_cluster.errors import ClusterOverloadedError
from lora_cluster.sim.__main__ import parse
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.simulation import Simulation

DEFAULT_SIM = ["--nodes", "256", "--adapters", "10000", "--load", "2", "--duration", "20"]
Call = tuple[float, int, str, str, tuple[Any, ...], Any]  # when, shard, kind, method, args, answer


def _plain(answer: Any) -> Any:
    """An answer as compared: refusals as their kind and text."""
    if isinstance(answer, ClusterOverloadedError):
        return (type(answer), str(answer))
    if isinstance(answer, list):
        return [_plain(a) for a in answer]
    return answer


Recorded = tuple[list[Call], list[tuple[Any, Any]], float, float, int]


def record(sim_args: list[str], kept: Path | None = None) -> Recorded:
    """The run's controller calls (shard, kind, method name, arguments, plain answer), each
    controller's classes and settings, the start of the measured span, its length (simulated s) and
    the tickets parked; read from (or kept in) `kept` when given."""
    if kept is not None and kept.exists():
        with kept.open("rb") as f:
            recorded: Recorded = pickle.load(f)
        return recorded
    config, _ = parse(sim_args)
    sim = Simulation(config)
    policy = sim.policy
    if not isinstance(policy, LoraClusterPolicy):
        raise SystemExit("the lora-cluster policy only")
    policy.trace = []
    sim.finish()
    sharded = len(policy.shards) > 1
    calls: list[Call] = []
    for when, kind, args, answer in policy.trace:
        if sharded:  # `_call_on`: (shard, bound method, *arguments)
            k, fn, rest = args[0], args[1], args[2:]
            calls.append((when, k, kind, fn.__name__, rest, _plain(answer)))
        else:
            calls.append((when, 0, kind, kind, args, _plain(answer)))
    span = config.duration  # arrivals end there: the span of `control_plane`
    out = (calls, [(c.classes, c.settings) for c in policy.shards], sim.metrics.measure_from, span,
           policy.parked)
    if kept is not None:
        with kept.open("wb") as f:
            pickle.dump(out, f, protocol=5)
    return out


def replay(calls: list[Call], shards: list[tuple[Any, Any]], measure_from: float,
           profilers: dict[str, cProfile.Profile] | None = None
           ) -> tuple[Counter[str], Counter[str], list[float]]:
    """Replay `calls` through fresh controllers; CPU seconds and calls per kind after `measure_from`,
    and CPU seconds per shard. Raises if an answer differs from the recorded one."""
    now = [0.0]
    fresh = [Controller(classes, settings, clock=lambda: now[0]) for classes, settings in shards]
    cpu: Counter[str] = Counter()
    count: Counter[str] = Counter()
    per_shard = [0.0] * len(shards)
    for when, k, kind, method, args, answer in calls:
        now[0] = when
        fn = getattr(fresh[k], method)
        measured = when >= measure_from
        profiler = None
        if measured and profilers is not None:
            profiler = profilers.setdefault(kind, cProfile.Profile())
        if profiler is not None:
            profiler.enable()
        t0 = time.thread_time()
        try:
            got = fn(*args)
        except ClusterOverloadedError as error:
            got = error
        spent = time.thread_time() - t0
        if profiler is not None:
            profiler.disable()
        if _plain(got) != answer:
            raise AssertionError(f"{kind} at {when:.3f} on shard {k}: the replay decided otherwise")
        if measured:
            cpu[kind] += spent
            count[kind] += 1
            per_shard[k] += spent
    return cpu, count, per_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", help="keep (and reuse) the recorded calls in this file")
    ap.add_argument("--no-profile", action="store_true", help="the timed replay only")
    ap.add_argument("sim", nargs=argparse.REMAINDER, help="-- then the simulator's options")
    args = ap.parse_args()
    set_young_threshold(ControllerConfig().controller_gc_threshold)  # as the controller actor's process
    sim_args = [a for a in args.sim if a != "--"] or DEFAULT_SIM
    build = "Python sources" if compiled.pure_python_requested() else "compiled where a current build is"
    print(f"# controller calls: python -m lora_cluster.sim {' '.join(sim_args)}\n"
          f"({build}; load average {load_avg()})")
    calls, shards, measure_from, span, parked = record(sim_args, Path(args.trace) if args.trace else None)
    freeze_recording()
    cpu, count, per_shard = replay(calls, shards, measure_from)
    total = sum(cpu.values())
    print(f"replayed {len(calls)} calls; after the warm-up {total / span:.4f} CPU s per simulated s, "
          f"busiest shard {max(per_shard) / span:.4f} (shards: "
          + ", ".join(f"{s / span:.4f}" for s in per_shard) + ")")
    parks = sum(len(c[4][0]) for c in calls if c[2] == "park_many" and c[0] >= measure_from)
    for kind, spent in cpu.most_common():
        item = ""
        if kind == "park_many" and parks:
            item = f", {spent / parks * 1e6:.1f} µs per parked ticket ({parks})"
        print(f"  {kind}: {spent / span:.4f} CPU s per simulated s, {count[kind]} calls, "
              f"{spent / count[kind] * 1e6:.1f} µs per call{item}")
    if args.no_profile:
        return
    profilers: dict[str, cProfile.Profile] = {}
    replay(calls, shards, measure_from, profilers)
    for kind, _ in cpu.most_common():
        out = io.StringIO()
        stats = pstats.Stats(profilers[kind], stream=out)
        print(f"\n## {kind}: {stats.total_tt:.2f} s under the profiler")
        stats.sort_stats("tottime").print_stats(args.top)
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        print("\n".join(line for line in lines[start:] if line.strip()))
    print(f"(parked in the whole run: {parked})")


if __name__ == "__main__":
    main()

"""CPU per controller input at 32, 256 and 1,024 replicas, 10,000 adapters, at steady state.

The inputs are the simulator's own: one run of `python -m lora_cluster.sim` per size (the shipped
defaults: `ServeSections()`, the `gpu` profile, one controller) records every call it makes of the
pure `cluster.controller.Controller` (`LoraClusterPolicy.trace`: reports, mostly deltas; parks in
batches; grants taken; cancels of timed-out tickets; ticks every 50 ms; the placement fetch), with
its simulated time and its answer. The benchmark then replays that call sequence through a fresh
`Controller` on the recorded clock, `--rounds` times, timing each call on the thread's CPU clock
(`time.thread_time`: other processes of this shared machine do not inflate it), and checks that each
answer equals the recorded one (grants, replies, refusals by kind and text), so the figure is the
cost of the same decisions. Only the calls after the warm-up are timed (the controller's state
then holds a full queue, placement and demand); per size, input kind and figure, the best round
is kept.

CPU per input is the CPU of every timed call (outputs included: `take_grants`, `placement`) over
the controller's inputs: reports, parked tickets (a `park_many` of k tickets is k inputs), cancels,
ticks and dispatches. The CPU per call of each kind is given beside.
The last line is the acceptance ratio: CPU per input at 1,024 replicas over that at 32 (issue 45:
<= 1.5).

`--traces DIR` keeps each size's recorded calls there (pickled, refusals as their kind and text) and
replays a file found there instead of running the simulator again: the code before and after a
change then replays the same inputs (and must answer as recorded).

`--profile N` also prints the 25 costliest functions (cProfile, cumulative) of one replay at N
replicas: where the per-input cost goes.

Run: python benchmarks/bench_controller_input.py [--load 2] [--warmup 10] [--duration 5]
     [--rounds 2] [--sizes 32,256,1024] [--adapters 10000] [--traces DIR] [--profile 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pickle
import pstats
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import emit, freeze_recording, header, load_avg

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.controller_settings import ControllerSettings
from lora_cluster.cluster.process_gc import set_young_threshold
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import ControllerConfig
from lora_cluster.errors import ClusterOverloadedError
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.simulation import SimConfig, Simulation

Trace = list[tuple[float, str, tuple[Any, ...], Any]]


def _plain(name: str, answer: Any) -> Any:
    """An answer as compared (and pickled): a park's refusals as their kind and text."""
    if name != "park_many":
        return answer
    return [(type(o), str(o)) if isinstance(o, ClusterOverloadedError) else o for o in answer]


def record(nodes: int, adapters: int, load: float, warmup: float, duration: float,
           traces: Path | None = None) -> tuple[Trace, SlaClasses, ControllerSettings]:
    """Every controller call of one simulator run (shipped defaults), its answer made plain, and the
    controller's classes and settings; read from (or kept in) `traces` when given."""
    path = None if traces is None else traces / f"trace-{nodes}-{adapters}-{load}-{warmup}-{duration}.pkl"
    if path is not None and path.exists():
        with path.open("rb") as f:
            kept: tuple[Trace, SlaClasses, ControllerSettings] = pickle.load(f)
        return kept
    # free calls (`control_cost="none"`): with the controller actor's loop modelled, one controller at 256
    # replicas and more cannot keep up (docs/scale.md, "The controller actor's loop"), and the inputs
    # of a run that times out nearly every request are not a serving mix; this measures the policy's work
    sim = Simulation(SimConfig(nodes=nodes, adapters=adapters, load=load, warmup=warmup, duration=duration,
                               control_cost="none"))
    policy = sim.policy
    assert isinstance(policy, LoraClusterPolicy), "the lora-cluster policy, one controller"
    policy.trace = []
    sim.finish()
    trace = [(when, name, args, _plain(name, answer)) for when, name, args, answer in policy.trace]
    controller = policy.controller
    assert isinstance(controller, Controller), "one controller"
    out = (trace, controller.classes, controller.settings)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            pickle.dump(out, f, protocol=5)
    return out


def replay(trace: Trace, classes: SlaClasses, settings: ControllerSettings, measure_from: float,
           profiler: cProfile.Profile | None = None) -> tuple[Counter[str], Counter[str], int]:
    """Replay `trace` through a fresh Controller; returns CPU seconds and calls per kind after
    `measure_from`, and the tickets parked then. Raises if any answer differs from the recorded one."""
    now = [0.0]
    live = Controller(classes, settings, clock=lambda: now[0])
    cpu: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    parked = 0
    clock: Callable[[], float] = time.thread_time
    for when, name, args, answer in trace:
        now[0] = when
        fn = getattr(live, name)
        measured = when >= measure_from
        if measured and profiler is not None:
            profiler.enable()
        t0 = clock()
        try:
            got = fn(*args)
        except ClusterOverloadedError as error:
            got = error
        spent = clock() - t0
        if measured and profiler is not None:
            profiler.disable()
        if _plain(name, got) != answer:
            raise AssertionError(f"{name} at {when:.3f}: the replay decided otherwise than the run")
        if measured:
            cpu[name] += spent
            calls[name] += 1
            parked += len(args[0]) if name == "park_many" else 0
    return cpu, calls, parked


def inputs(calls: Counter[str], parked: int) -> int:
    """The controller's inputs among `calls`: reports, parked tickets, cancels, ticks, dispatches."""
    return parked + sum(calls[k] for k in ("report", "cancel", "tick", "dispatch"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,256,1024")
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--traces", help="keep (and reuse) each size's recorded calls in this folder")
    ap.add_argument("--profile", type=int, default=0, help="cProfile one replay at this many replicas")
    ap.add_argument("--code", help="the code measured, for the report (default: this checkout's commit; "
                    "give it when PYTHONPATH points at another copy of lora_cluster)")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_young_threshold(ControllerConfig().controller_gc_threshold)  # as the controller actor's process
    sizes = [int(s) for s in args.sizes.split(",")]
    command = (f"python benchmarks/bench_controller_input.py --sizes {args.sizes} --adapters {args.adapters} "
               f"--load {args.load} --warmup {args.warmup} --duration {args.duration} --rounds {args.rounds}")
    rows: dict[int, tuple[dict[str, float], Counter[str], int]] = {}
    profile_text = ""
    for n in sizes:
        t0 = time.perf_counter()
        trace, classes, settings = record(n, args.adapters, args.load, args.warmup, args.duration,
                                          Path(args.traces) if args.traces else None)
        sim_s = time.perf_counter() - t0
        freeze_recording()
        best: dict[str, float] = {}
        calls: Counter[str] = Counter()
        parked = 0
        for _ in range(args.rounds):
            cpu, calls, parked = replay(trace, classes, settings, args.warmup)
            total = sum(cpu.values())
            for name, spent in [*cpu.items(), ("all", total)]:
                best[name] = min(best.get(name, math.inf), spent)
        rows[n] = (best, calls, parked)
        print(f"{n} replicas: {len(trace)} calls (recorded or read in {sim_s:.0f} s); per input "
              f"{best['all'] / inputs(calls, parked) * 1e6:.1f} us", flush=True)
        if args.profile == n:
            profiler = cProfile.Profile()
            replay(trace, classes, settings, args.warmup, profiler)
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
            profile_text = out.getvalue()
        del trace
        gc.unfreeze()
    kinds = sorted({k for _, calls, _ in rows.values() for k in calls})
    lines = [*header("Controller cost per input", command, level=3, changed={}, code=args.code), "",
             f"Load average {load_avg()}. The simulator's defaults but "
             f"`--load {args.load}` (the issue's operating point: every arrival parks), "
             f"`--adapters {args.adapters}`, `--warmup {args.warmup}` and `--duration {args.duration}` "
             "and `--control-cost none` (the controller's own work is timed, on a serving mix of inputs: "
             "with its actor's loop modelled one controller cannot keep up at 256 replicas and more) "
             "(a short run: the inputs of its measured seconds are what is timed). Best of "
             f"{args.rounds} replays, CPU µs per call.", "",
             "| replicas | inputs timed | µs per input | "
             + " | ".join(f"{k}: µs per call (calls)" for k in kinds) + " | µs per parked ticket |",
             "|---:|---:|---:|" + "---:|" * len(kinds) + "---:|"]
    for n, (best, calls, parked) in rows.items():
        count = inputs(calls, parked)
        cells = [f"{best.get(k, 0.0) / calls[k] * 1e6:.1f} ({calls[k]})" if calls[k] else "-" for k in kinds]
        per_ticket = best.get("park_many", 0.0) / parked * 1e6 if parked else 0.0
        lines.append(f"| {n} | {count} | {best['all'] / count * 1e6:.1f} | " + " | ".join(cells)
                     + f" | {per_ticket:.1f} |")
    if len(rows) > 1:
        (lo, (b0, c0, p0)), (hi, (b1, c1, p1)) = min(rows.items()), max(rows.items())
        ratio = (b1["all"] / inputs(c1, p1)) / (b0["all"] / inputs(c0, p0))
        lines += ["", f"CPU per input at {hi} replicas over that at {lo}: **{ratio:.2f}x** (target <= 1.5x)."]
    text = "\n".join(lines)
    emit(text, Path(args.out) if args.out else None)
    if profile_text:
        print(profile_text)


if __name__ == "__main__":
    main()

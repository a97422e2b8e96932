"""Measure the cost model of the controller actor's loop that the simulator runs (`sim.control_loop`).

Two parts, each on this machine:

1. `call_s`, a Serve call's own overhead in the controller's replica: the real `ClusterController`
   deployment (shipped defaults) on a local Ray, called `--calls` times through a deployment handle
   with `placement()` (its work is a lookup of an empty table), in `--concurrency` concurrent calls;
   the replica process's CPU time (user + system, read from the operating system) over the calls,
   less what it spends idle in as long (its background work, measured for 3 s before), divided by
   their number. Its own `placement()` work, timed in-process, is taken off.
   1b. Beside it, `actor_call_s` (recorded, not used by the model): the same calls to a plain Ray
   async actor that holds a `Controller` (`PlainController`), through an actor handle, measured the
   same way in the actor's process: what the receiving side pays without Serve's request path.
2. `work_s` per input kind and `dispatch_s`: the simulator at `--nodes` x `--adapters`, `--load`,
   with the loop costing only `call_s` (so that its turns batch as the live loop's do), the
   controller's methods timed on the thread's CPU clock after the warm-up: a report taken without its
   dispatch, a tick (its dispatch included), a cancel, a placement fetch each their mean; a dispatch
   (a window of reports alone) and the taking of its grants give `dispatch_s`; a window's parks cost
   their `park_many` less one dispatch, per park.

The result goes to `docs/profile_controller.json` (the simulator's default cost model) and a
markdown report beside it. The machine is shared and noisy: `--rounds` runs of part 1 alternate
with part 2, and the lowest of each figure is kept.

With `--calls-only`, parts 1 and 1b alone, `--rounds` times each, alternating: the model is left
as it is, and the comparison replaces this report's section `CALLS_SECTION` (its own header).

Run: RAY_AUTH_MODE=disabled python benchmarks/profile_controller.py [--calls 3000] [--concurrency 32]
     [--nodes 64 --adapters 3000 --load 1 --duration 20] [--rounds 2] [--calls-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

from lora_cluster.sim.control_loop import DEFAULT_PATH, KINDS, ControlCost
from lora_cluster.sim.simulation import SimConfig, Simulation

IDLE_S = 3.0
REPORT = Path(__file__).resolve().parent.parent / "docs" / "profile_controller.md"
CALLS_SECTION = "## A Serve handle call against a plain Ray actor call"


def serve_call_s(calls: int, concurrency: int) -> float:
    """Part 1: a Serve call's own CPU in the controller's replica, seconds per call."""
    import psutil
    import ray
    from ray import serve

    from lora_cluster.config.serve import load_config
    from lora_cluster.serve.controller_actor import ClusterController

    common.start_serve(num_cpus=2)
    try:
        fields = load_config(None).model_dump(exclude_unset=False)
        handle = serve.run(ClusterController.options(name="ProfiledController").bind(fields, 0, 1),
                           name="profile-controller", route_prefix=None)
        handle.placement.remote().result()
        replica = next(p for p in psutil.process_iter(["cmdline"])
                       if "ProfiledController" in " ".join(p.info["cmdline"] or ()))

        spent = _process_cpu_s(replica, lambda: asyncio.run(_burst(handle.placement, calls, concurrency)))
    finally:
        serve.shutdown()
        ray.shutdown()
    return max(0.0, spent / calls - _placement_work_s())


class PlainController:
    """The controller behind a plain Ray actor (an async actor: one event loop, as the Serve replica),
    for part 1b: what a call costs the receiving process without Serve's request path."""

    def __init__(self) -> None:
        from lora_cluster.cluster.controller import Controller
        from lora_cluster.cluster.sla import SlaClasses

        self.core = Controller(SlaClasses())

    def pid(self) -> int:
        return os.getpid()

    async def placement(self) -> dict[str, list[str]]:
        return {a: list(r) for a, r in self.core.placement().items()}


def actor_call_s(calls: int, concurrency: int) -> float:
    """Part 1b: a plain Ray actor method call's own CPU in the actor's process, seconds per call,
    measured as part 1 (`placement()`, `concurrency` at a time, idle CPU and own work taken off)."""
    import psutil
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actor = ray.remote(num_cpus=0)(PlainController).remote()
        process = psutil.Process(ray.get(actor.pid.remote()))
        ray.get(actor.placement.remote())

        spent = _process_cpu_s(process, lambda: asyncio.run(_burst(actor.placement, calls, concurrency)))
    finally:
        ray.shutdown()
    return max(0.0, spent / calls - _placement_work_s())


async def _burst(method: Any, calls: int, concurrency: int) -> None:
    """`calls` calls of `method` (a handle's or an actor's), `concurrency` at a time."""
    for start in range(0, calls, concurrency):
        n = min(concurrency, calls - start)
        await asyncio.gather(*(method.remote() for _ in range(n)))


def _process_cpu_s(process: Any, run: Callable[[], None]) -> float:
    """CPU seconds `process` spends while `run()` runs, less its idle rate (measured for IDLE_S first)."""
    def cpu() -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    idle_from, t0 = cpu(), time.perf_counter()
    time.sleep(IDLE_S)  # the process's own background work (metrics, health checks), per second
    idle_rate = (cpu() - idle_from) / (time.perf_counter() - t0)
    before, t0 = cpu(), time.perf_counter()
    run()
    return cpu() - before - idle_rate * (time.perf_counter() - t0)


def _placement_work_s() -> float:
    from lora_cluster.cluster.controller import Controller
    from lora_cluster.cluster.sla import SlaClasses

    controller = Controller(SlaClasses())
    t0 = time.thread_time()
    for _ in range(10_000):
        {a: list(r) for a, r in controller.placement().items()}
    return (time.thread_time() - t0) / 10_000


class Timed:
    """The controller with its inputs timed on the thread's CPU clock once `measuring()` (a compiled
    `Controller`'s methods cannot be wrapped in place)."""

    CALLS = ("report", "park_many", "dispatch", "tick", "cancel", "placement", "take_grants")

    def __init__(self, controller: Any, spent: dict[str, list[float]], parks: list[int],
                 measuring: Callable[[], bool]):
        self.controller, self.spent, self.parks, self.measuring = controller, spent, parks, measuring

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.controller, name)
        if name not in self.CALLS:
            return fn

        def timed(*args: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                if self.measuring():
                    self.spent[name].append(time.thread_time() - t0)
                    if name == "park_many":
                        self.parks[0] += len(args[0])
        return timed

    def queue_depth(self) -> int:
        return len(self.controller.queue)


def controller_work(config: SimConfig, call_s: float) -> dict[str, Any]:
    """Part 2: the controller's own work per input kind and per dispatch, from the simulator."""
    loop_cost = ControlCost(call_s, dict.fromkeys(KINDS, 0.0), 0.0)
    sim = Simulation(config, control_cost=loop_cost)
    spent: dict[str, list[float]] = defaultdict(list)
    parks = [0]
    timed = Timed(sim.policy.controller, spent, parks, lambda: sim.loop.now >= config.warmup)
    sim.policy.controller = sim.policy.shards[0] = timed  # the one controller, as each caller reaches it
    sim.finish()

    def mean(name: str) -> float:
        return statistics.fmean(spent[name]) if spent[name] else 0.0

    dispatch = mean("dispatch") + mean("take_grants")
    park = max(0.0, (sum(spent["park_many"]) - len(spent["park_many"]) * mean("dispatch")) / max(1, parks[0]))
    work = {"park": park, "report": mean("report"), "tick": mean("tick"), "cancel": mean("cancel"),
            "placement": mean("placement"), "poll": 0.0}  # a grants poll: the call alone
    counts = {name: len(v) for name, v in spent.items()}
    return {"work_s": work, "dispatch_s": dispatch, "calls": counts, "parks": parks[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=3_000)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--calls-only", action="store_true",
                    help="measure the two calls' overheads only (parts 1 and 1b); the model is kept")
    args = ap.parse_args()
    if args.calls_only:
        compare_calls(args)
        return
    config = SimConfig(nodes=args.nodes, adapters=args.adapters, load=args.load, duration=args.duration,
                       warmup=args.warmup)
    calls, actor_calls, works = [], [], []
    for _ in range(args.rounds):
        calls.append(serve_call_s(args.calls, args.concurrency))
        actor_calls.append(actor_call_s(args.calls, args.concurrency))
        works.append(controller_work(config, calls[-1]))
    call_s, actor_s = min(calls), min(actor_calls)
    best = {k: min(w["work_s"][k] for w in works) for k in KINDS}
    dispatch_s = min(w["dispatch_s"] for w in works)
    cost = {"call_s": call_s, "work_s": best, "dispatch_s": dispatch_s, "actor_call_s": actor_s,
            "measured": {"date": common.now(), "machine": common.machine(), "code": common.code_version(),
                         "cell": f"{args.nodes} x {args.adapters}, load {args.load}, {args.duration} s",
                         "calls": works[0]["calls"], "parks": works[0]["parks"]}}
    ControlCost.load_dict(cost)  # refuses a model the simulator could not run
    args.out.write_text(json.dumps(cost, indent=2) + "\n")
    command = ("RAY_AUTH_MODE=disabled python benchmarks/profile_controller.py "
               f"--calls {args.calls} --concurrency {args.concurrency} --nodes {args.nodes} "
               f"--adapters {args.adapters} --load {args.load} --duration {args.duration} "
               f"--rounds {args.rounds}")
    lines = common.header("The controller actor's cost model (sim.control_loop)", command, level=2,
                          changed={})
    lines += ["", "| figure | us | each round |", "|---|---|---|",
              f"| Serve call overhead (`call_s`) | {call_s * 1e6:.0f} | "
              f"{', '.join(f'{c * 1e6:.0f}' for c in calls)} |",
              f"| plain Ray actor call overhead (`actor_call_s`, not in the model) | {actor_s * 1e6:.0f} | "
              f"{', '.join(f'{c * 1e6:.0f}' for c in actor_calls)} |"]
    def each(values: list[float]) -> str:
        return ", ".join(f"{v * 1e6:.1f}" for v in values)

    for k in KINDS:
        lines.append(f"| {k} work | {best[k] * 1e6:.1f} | {each([w['work_s'][k] for w in works])} |")
    lines.append(f"| dispatch (per turn, its grants taken) | {dispatch_s * 1e6:.1f} | "
                 f"{each([w['dispatch_s'] for w in works])} |")
    common.emit("\n".join(lines), REPORT, title="Controller cost model", doc=__doc__)


def compare_calls(args: argparse.Namespace) -> None:
    """Parts 1 and 1b alone, alternating; their section of the report replaced (see the docstring)."""
    serve_calls, actor_calls = [], []
    for _ in range(args.rounds):
        serve_calls.append(serve_call_s(args.calls, args.concurrency))
        actor_calls.append(actor_call_s(args.calls, args.concurrency))
    command = ("RAY_AUTH_MODE=disabled python benchmarks/profile_controller.py --calls-only "
               f"--calls {args.calls} --concurrency {args.concurrency} --rounds {args.rounds}")
    lines = common.header(CALLS_SECTION.removeprefix("## "), command, level=2, changed={})
    lines += ["", "| a call's own CPU in the receiving process | us (lowest) | each round |", "|---|---|---|"]
    for name, values in (("Serve deployment handle -> `ClusterController` replica", serve_calls),
                         ("plain Ray actor handle -> async actor holding a `Controller`", actor_calls)):
        lines.append(f"| {name} | {min(values) * 1e6:.0f} | {', '.join(f'{v * 1e6:.0f}' for v in values)} |")
    lines.append(f"\nThe plain actor call costs {min(actor_calls) / min(serve_calls):.2f} of the Serve call.")
    section = "\n".join(lines)
    print(section)
    old = REPORT.read_text() if REPORT.exists() else ""
    kept = old.split(CALLS_SECTION)[0].rstrip("\n")
    REPORT.write_text(f"{kept}\n\n{section}\n")


if __name__ == "__main__":
    main()

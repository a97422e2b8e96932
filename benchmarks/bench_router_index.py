"""Routing decision cost of the live router at 32, 256 and 1,024 replicas, 10,000 adapters resident.

Times `LoraAffinityRouter.choose_replicas` itself (the real router, Serve's real queue-length cache,
no Ray started): one call per request, its coroutine run to completion without an event loop, timed
on the thread's CPU clock (`time.thread_time`), so the figure is the router's own CPU time on one
core, not the time other processes of this shared machine took from it. Between two decisions, as
under load, Serve sends the request to the chosen replica (`on_send_request`) and a request
finishes on a random replica (`decrement_queue_len_cache`); both reach the index through the
router's queue-length hooks, and the decision that follows rebuilds what they changed (counted in
its time).

The cluster: every replica reports `max(16, ceil(10,000 / replicas))` resident adapters so that all
10,000 are resident somewhere (each adapter on one to two replicas), 64 batch slots, queue lengths
0-40 in Serve's cache; the controller's placement table names 50 hot adapters on 2-4 replicas
each; requests pick adapters by Zipf 1.0 over the 10,000. The router records its own choices
(placements counted for `router_placement_ttl_s`, as served).

`full rank` is the router's work before the index, on the same states: a `ReplicaView` of every
replica (`PlacementTracker.view`) and `rank_replicas` over all of them. `replica-list update` is
what a routing-stats broadcast costs the index (`RoutingIndex.replace` + `settle`: every view
rebuilt), once per `routing_stats_period_s`, not per request.

Rounds alternate the sizes; per size, method and figure the best round is kept.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_router_index.py [--decisions 3000] [--full 150]
     [--rounds 2] [--out docs/bench_router_index.md]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lora_cluster.cluster.routing_index import RoutingIndex
from lora_cluster.cluster.routing_score import PlacementTracker, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import serve_defaults
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.ray_internals import cached_queue_len, offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.replica_tables import publish_placement
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

ADAPTERS = 10_000
SIZES = (32, 256, 1024)


def run_sync(coro: Any) -> Any:
    """Run a coroutine that never awaits to its end (choose_replicas does not suspend)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("choose_replicas suspended")


def cluster(n: int, rng: random.Random) -> tuple[LoraAffinityRouter, list[SimpleNamespace]]:
    app = f"bench-{n}"
    per = max(16, math.ceil(ADAPTERS / n))
    replicas = []
    for i in range(n):
        resident = [f"a{(i * per + j) % ADAPTERS}" for j in range(per)]
        replicas.append(SimpleNamespace(
            replica_id=offline_replica_id(f"r{i:04d}", app), max_ongoing_requests=96,
            routing_stats={"resident": resident, "max_loras": per, "empty_adapter_slots": 0,
                           "free_adapter_slots": 4, "max_num_seqs": 64, "num_running": 32, "num_waiting": 0}))
    router = offline_router(LoraAffinityRouter, app)
    defaults = serve_defaults()
    router.initialize_state(router=defaults.router.model_dump())
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, rng.randrange(41))
    hot = {f"a{k}": [f"r{rng.randrange(n):04d}" for _ in range(rng.randint(2, 4))] for k in range(50)}
    publish_placement(app, "LoraReplica", hot)
    return router, replicas


def requests(count: int, rng: random.Random) -> list[SimpleNamespace]:
    weights = [1.0 / (k + 1) for k in range(ADAPTERS)]
    out = []
    for adapter in rng.choices(range(ADAPTERS), weights=weights, k=count):
        job = GenerateJob(request_id="b", prompt=[1], adapter_id=f"a{adapter}", sampling=SamplingParams())
        out.append(SimpleNamespace(args=(job,), routing_context=SimpleNamespace(should_backoff=False)))
    return out


def time_index(n: int, decisions: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    router, replicas = cluster(n, rng)
    reqs = requests(decisions + 200, rng)
    out = []
    for k, pending in enumerate(reqs):
        t0 = time.thread_time()
        ranks = run_sync(router.choose_replicas(replicas, pending))
        dt = time.thread_time() - t0
        if k >= 200:  # the first calls build the index (once per replica list)
            out.append(dt)
        chosen = ranks[0][0].replica_id
        router.on_send_request(chosen)
        router.decrement_queue_len_cache(replicas[rng.randrange(n)].replica_id)
    return out


def time_full(n: int, decisions: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    router, replicas = cluster(n, rng)
    tracker = PlacementTracker(ttl_s=serve_defaults().router.router_placement_ttl_s)
    stats = {r.replica_id.unique_id: RoutingStats.from_dict(r.routing_stats) for r in replicas}
    miss_cost = serve_defaults().router.router_miss_cost
    out = []
    for pending in requests(decisions, rng):
        aid = pending.args[0].adapter_id
        t0 = time.thread_time()
        now = time.monotonic()
        views = []
        for r in replicas:
            rid = r.replica_id.unique_id
            cached = cached_queue_len(router, r.replica_id)  # else the report, as the router reads it
            views.append(tracker.view(rid, stats[rid], stats[rid].ongoing if cached is None else cached, now))
        ranked = rank_replicas(aid, views, miss_cost)
        tracker.record(ranked[0], aid, now)
        out.append(time.thread_time() - t0)
        chosen = next(r for r in replicas if r.replica_id.unique_id == ranked[0])
        router.on_send_request(chosen.replica_id)
        router.decrement_queue_len_cache(replicas[rng.randrange(n)].replica_id)
    return out


def time_update(n: int, seed: int) -> float:
    rng = random.Random(seed)
    _, replicas = cluster(n, rng)
    index = RoutingIndex(miss_cost=4.0, placement_ttl_s=5.0, clock=time.monotonic, ongoing=lambda rid: 20)
    best = math.inf
    for _ in range(3):
        stats = {r.replica_id.unique_id: RoutingStats.from_dict(r.routing_stats) for r in replicas}
        t0 = time.thread_time()
        index.replace(stats)
        index.settle()
        best = min(best, time.thread_time() - t0)
    return best


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--full", type=int, default=150, help="decisions timed for the full rank")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    best: dict[tuple[str, int], tuple[float, float, float]] = {}
    for rnd in range(args.rounds):
        for n in SIZES:
            for method in ("index", "full rank"):
                xs = time_index(n, args.decisions, rnd) if method == "index" else time_full(n, args.full, rnd)
                row = (pct(xs, 0.5), pct(xs, 0.99), statistics.fmean(xs) * 1e6)
                old = best.get((method, n), row)
                best[(method, n)] = (min(old[0], row[0]), min(old[1], row[1]), min(old[2], row[2]))
    lines = [f"Command: `RAY_AUTH_MODE=disabled python benchmarks/bench_router_index.py "
             f"--decisions {args.decisions} --full {args.full} --rounds {args.rounds}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared, load average "
             f"{os.getloadavg()[0]:.1f}; one process, one thread.", "",
             "| replicas | router | decisions | p50 µs | p99 µs | mean µs | decisions/s (one core, mean) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for n in SIZES:
        for method, count in (("index", args.decisions), ("full rank", args.full)):
            p50, p99, mean = best[(method, n)]
            lines.append(f"| {n} | {method} | {count} | {p50:.0f} | {p99:.0f} | {mean:.0f} "
                         f"| {1e6 / mean:.0f} |")
    lines += ["", "| replicas | replica-list update (index rebuilt), ms |", "|---:|---:|"]
    lines += [f"| {n} | {time_update(n, 0) * 1e3:.1f} |" for n in SIZES]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

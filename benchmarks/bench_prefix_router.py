"""What prefix-aware routing adds to the live router's decision, at 32, 256 and 1,024 replicas.

The cluster is bench_router_index.py's (10,000 adapters resident, 64 batch slots, queue lengths
0-40, a placement table of 50 hot adapters), with every replica reporting `prefixes` as
`record_routing_stats` does: a `PrefixSummary` of 40 prompts it ran, each a 1,000-token system prompt
(one of 8) and a 50-900-token chat of one of its adapters. Requests: half continue one of those
chats (its prompt + 100 new tokens: a chat's next turn), half start a new chat of a Zipf-drawn
adapter on one of the system prompts; 1,150-2,100-token prompts. The same requests are timed
with their prompt tokens (the keys computed on the job's first read, counted in the time) and
with a one-token prompt (no key: adapter-only routing's work). `LoraAffinityRouter.choose_replicas`
is timed on the thread's CPU clock, as in bench_router_index.py; best round per figure.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_prefix_router.py [--decisions 2000] [--rounds 2]
     [--out docs/bench_prefix_router.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from bench_router_index import SIZES, cluster, pct, run_sync

from lora_cluster.cluster.prefix_keys import PrefixSummary, routing_keys
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.protocol import GenerateJob

SYSTEMS, CHATS_PER_REPLICA = 8, 40


def workload(n: int, decisions: int, seed: int):
    """The router, its replicas (reporting prefixes) and the requests' (adapter, prompt, home replica)."""
    rng = random.Random(seed)
    router, replicas = cluster(n, rng)
    systems = [[rng.randrange(30_000) for _ in range(1000)] for _ in range(SYSTEMS)]
    chats = []  # (adapter, prompt, replica that ran it)
    for r in replicas:
        summary = PrefixSummary()
        for _ in range(CHATS_PER_REPLICA):
            adapter = rng.choice(r.routing_stats["resident"])
            prompt = rng.choice(systems) + [rng.randrange(30_000) for _ in range(rng.randint(50, 900))]
            summary.record(routing_keys(adapter, prompt))
            chats.append((adapter, prompt, r.replica_id.unique_id))
        r.routing_stats["prefixes"] = list(summary.keys())
    weights = [1.0 / (k + 1) for k in range(10_000)]
    requests = []
    for _ in range(decisions + 200):
        if rng.random() < 0.5:
            adapter, prompt, home = rng.choice(chats)
            requests.append((adapter, prompt + [rng.randrange(30_000) for _ in range(100)], home))
        else:
            adapter = f"a{rng.choices(range(10_000), weights=weights)[0]}"
            prompt = rng.choice(systems) + [rng.randrange(30_000) for _ in range(rng.randint(150, 400))]
            requests.append((adapter, prompt, None))
    return router, replicas, requests


def time_decisions(n: int, decisions: int, seed: int, with_prefix: bool) -> tuple[list[float], float]:
    """CPU seconds per decision, and the share of chat turns sent to the replica of their chat."""
    router, replicas, requests = workload(n, decisions, seed)
    rng = random.Random(seed + 1)
    out, home_turns, at_home = [], 0, 0
    for k, (adapter, prompt, home) in enumerate(requests):
        job = GenerateJob(request_id="b", prompt=prompt if with_prefix else [1], adapter_id=adapter,
                          sampling=SamplingParams())
        pending = SimpleNamespace(args=(job,), routing_context=SimpleNamespace(should_backoff=False))
        t0 = time.thread_time()
        ranks = run_sync(router.choose_replicas(replicas, pending))
        dt = time.thread_time() - t0
        chosen = ranks[0][0].replica_id
        if k >= 200:
            out.append(dt)
            if home is not None:
                home_turns += 1
                at_home += chosen.unique_id == home
        router.on_send_request(chosen)
        router.decrement_queue_len_cache(replicas[rng.randrange(n)].replica_id)
    return out, at_home / max(1, home_turns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    best: dict[tuple[bool, int], tuple[float, float, float, float]] = {}
    for rnd in range(args.rounds):
        for n in SIZES:
            for with_prefix in (False, True):
                xs, home = time_decisions(n, args.decisions, rnd, with_prefix)
                row = (pct(xs, 0.5), pct(xs, 0.99), statistics.fmean(xs) * 1e6, home)
                old = best.get((with_prefix, n), row)
                best[(with_prefix, n)] = (min(old[0], row[0]), min(old[1], row[1]), min(old[2], row[2]), home)
    lines = [f"Command: `RAY_AUTH_MODE=disabled python benchmarks/bench_prefix_router.py "
             f"--decisions {args.decisions} --rounds {args.rounds}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared, load average "
             f"{os.getloadavg()[0]:.1f}; one process, one thread; shipped router defaults.", "",
             "| replicas | requests carry | p50 µs | p99 µs | mean µs "
             "| chat turns sent to their chat's replica |",
             "|---:|---|---:|---:|---:|---:|"]
    for n in SIZES:
        for with_prefix, label in ((False, "no prompt keys (adapter-only)"), (True, "their prompt's keys")):
            p50, p99, mean, home = best[(with_prefix, n)]
            lines.append(f"| {n} | {label} | {p50:.0f} | {p99:.0f} | {mean:.0f} | {100 * home:.0f}% |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

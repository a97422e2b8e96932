"""Scrape size of `GET /metrics`, in series, for many adapters: what `metrics_max_adapter_labels` bounds.

Drives the public metric functions of `lora_cluster.serve.ops` exactly as the ingress does for each
generation (`generation_metrics.GenerationMetrics`: admitted, started, tokens, finished;
`routing_decision`; one scrape: `metrics_exposition.render`), with
`--requests` generations over `--adapters` adapters drawn Zipf-like (s=1.1), spread over the three
default SLA classes and `--tenants` tenants (adapter k belongs to tenant k mod tenants; 0: requests
without a tenant), plus `--replicas`
replica reports as the replicas send them (4 tiers, engine counters, memory, classes). Then it
counts the sample lines of one scrape (a series each), in total and for the request metrics
labelled by adapter. Without a bound (`--max-adapter-labels` >= adapters) the figure is what naive
per-adapter labelling costs. One window: no re-ranking happens during the run.

Run: python benchmarks/metrics_series.py [--adapters 1000] [--max-adapter-labels 50] [--tenants 0]
"""

from __future__ import annotations

import argparse
import random

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.replica_policy.tier_stats import LOAD_BUCKETS_S, TIERS
from lora_cluster.serve.ops import generation_metrics, metrics_exposition
from lora_cluster.sim.popularity import ZipfSampler

CLASSES = ("interactive", "standard", "batch")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replica_report(i: int) -> dict:
    tier = {"hits": 10, "misses": 2, "coalesced": 0, "loads": 2, "load_seconds_total": 0.1,
            "load_buckets": [1] * (len(LOAD_BUCKETS_S) + 1), "evictions": 1, "failures": 0, "retries": 0,
            "bytes": 1 << 20, "entries": 4, "budget_bytes": 1 << 30}
    engine = {"steps": 100, "batched_seqs": 400, "sampled_tokens": 400, "placements": 8, "switches": 4,
              "placement_failures": 0, "placement_buckets": [1] * (len(LOAD_BUCKETS_S) + 1),
              "placement_seconds_total": 0.02, "preemptions": 0, "failed_steps": 0,
              "adapter_pool_fragmentation": 0.1}
    return {"num_running": 4, "num_waiting": 1, "max_loras": 8, "empty_adapter_slots": 2,
            "store": {t: dict(tier) for t in TIERS}, "engine": engine, "node_id": f"node{i % 2}",
            "memory": {"base_weights": 1, "kv_cache": 1, "adapter_pool": 1, "free": 1},
            "classes": {c: {"running": 1, "waiting": 0, "slo_attainment": 1.0} for c in CLASSES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--max-adapter-labels", type=int,
                        default=ServeConfig().metrics.metrics_max_adapter_labels)
    parser.add_argument("--tenants", type=int, default=0)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    clock = Clock()
    generation_metrics.configure(ServeConfig(metrics_max_adapter_labels=args.max_adapter_labels), clock)
    metrics_exposition.set_replica_stats_source(lambda: {f"r{i}": RoutingStats.from_dict(replica_report(i))
                                              for i in range(args.replicas)})
    rng = random.Random(0)
    drawn = ZipfSampler(args.adapters, 1.1).draws(rng, args.requests)
    seen = set()
    for n, k in enumerate(drawn):
        adapter = f"adapter-{k}"
        seen.add(adapter)
        tenant = f"tenant-{k % args.tenants}" if args.tenants else None  # each adapter has one owner
        m = generation_metrics.GenerationMetrics(adapter, tenant, CLASSES[n % 3], clock=clock)
        m.admitted()
        clock.now += 0.001
        m.started()
        m.tokens(16)
        m.finished(32, 16)
        generation_metrics.routing_decision(adapter, "r0", n % 4 != 0, None)
    lines = [line for line in metrics_exposition.render().decode().splitlines()
             if line and not line.startswith("#")]
    labelled = [line for line in lines if 'adapter="' in line]
    print(f"| adapters | used | max_adapter_labels | tenants | replicas | series in the scrape | "
          f"of them labelled by adapter |\n|---|---|---|---|---|---|---|\n"
          f"| {args.adapters} | {len(seen)} | {args.max_adapter_labels} | {args.tenants} | {args.replicas} | "
          f"{len(lines)} | {len(labelled)} |")


if __name__ == "__main__":
    main()

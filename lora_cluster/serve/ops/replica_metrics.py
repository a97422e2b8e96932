"""The replica metrics of a scrape, computed from the replicas' routing-stats reports.

The LoRA replicas live in other processes; the ingress's request router already receives each one's
report (at most `routing_stats_period_s` old), and `ReplicaStatsCollector` turns the latest reports
into the families declared in `serve.ops.metrics`: engine gauges and counters, adapter store tiers,
adapter loads and their latency, device memory by use, adapter pool fragmentation, requests and SLO
attainment by class, and the cold-start counters (demand prefetch, cluster tier). One sample per
replica (and tier, use, class, ...), replicas in id order; a field a replica does not report is no
sample (never a 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.replica_policy.tier_stats import LOAD_BUCKETS_S
from lora_cluster.serve.ops import metrics


class ReplicaStatsCollector(Collector):
    """Replica metrics, one sample per replica (and tier, class, ...), from `source()` -> {replica id:
    routing stats}: engine gauges and counters, adapter store tiers, loads, memory."""

    def __init__(self, source: Callable[[], Mapping[str, RoutingStats] | None]):
        self._source = source

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [metrics.REPLICAS.family()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self._source() or {}
        replicas = metrics.REPLICAS.family()
        replicas.add_metric([], len(stats))
        yield replicas
        for name, (help_text, value) in metrics.ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["replica"])
            for replica_id, s in sorted(stats.items()):
                v = value(s)
                if v is not None:
                    family.add_metric([replica_id], float(v))
            yield family
        yield from _store_families(stats)
        yield from _replica_families(stats)


def _store_families(stats: Mapping[str, RoutingStats]) -> Iterable[GaugeMetricFamily]:
    """Per-tier adapter store families from {replica id: report}; replicas without a store are skipped."""
    specs = [(CounterMetricFamily, *c) for c in metrics.STORE_COUNTERS] + [
        (GaugeMetricFamily, *g) for g in metrics.STORE_GAUGES
    ]
    for family_type, name, help_text, field in specs:
        family = family_type(name, help_text, labels=["replica", "tier"])
        for replica_id, report in sorted(stats.items()):
            for tier, counters in sorted(report.store.items()):
                if field in counters:
                    family.add_metric([replica_id, tier], float(counters[field]))
        yield family


def _tier_loads(report: RoutingStats) -> dict[str, tuple[float, float, Any, float]]:
    """tier -> (loads, failed loads, latency buckets, seconds) of one replica: device = placements
    into a slot (the engine's counters), host/disk/source = fills of the store's tiers."""
    out = {tier: (c.get("loads", 0), c.get("failures", 0), c.get("load_buckets"),
                  c.get("load_seconds_total", 0.0))
           for tier, c in report.store.items() if tier != "device"}
    engine = report.engine
    if "placements" in engine:
        out["device"] = (engine["placements"], engine.get("placement_failures", 0),
                         engine.get("placement_buckets"), engine.get("placement_seconds_total", 0.0))
    return out


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (le, cumulative count) of per-bucket counts over LOAD_BUCKETS_S and +Inf."""
    total, buckets = 0, []
    for bound, n in zip((*LOAD_BUCKETS_S, float("inf")), counts, strict=True):
        total += n
        buckets.append((floatToGoString(bound), float(total)))
    return buckets


def _replica_families(stats: Mapping[str, RoutingStats]) -> Iterable[Any]:
    """Adapter loads, memory, fragmentation, engine counters and class gauges from {replica: report}."""
    loads, latency = metrics.ADAPTER_LOADS.family(), metrics.ADAPTER_LOAD_DURATION.family()
    hit_ratio, memory = metrics.ADAPTER_CACHE_HIT_RATIO.family(), metrics.DEVICE_MEMORY.family()
    fragmentation = metrics.ADAPTER_POOL_FRAGMENTATION.family()
    classes, attainment = metrics.REPLICA_REQUESTS.family(), metrics.REPLICA_SLO_ATTAINMENT.family()
    engine_families = [(CounterMetricFamily(n, h, labels=["replica"]), f)
                       for n, h, f in (*metrics.ENGINE_COUNTERS, *metrics.COLD_START_COUNTERS)]
    for rid, report in sorted(stats.items()):
        for tier, (ok, failed, buckets, seconds) in sorted(_tier_loads(report).items()):
            loads.add_metric([rid, tier, "ok"], float(ok))
            loads.add_metric([rid, tier, "failed"], float(failed))
            if buckets and len(buckets) == len(LOAD_BUCKETS_S) + 1:
                latency.add_metric([rid, tier], _cumulative(buckets), float(seconds))
        for tier, c in sorted(report.store.items()):
            seen = c.get("hits", 0) + c.get("misses", 0)
            if seen:
                hit_ratio.add_metric([rid, tier], c.get("hits", 0) / seen)
        mem, node = report.memory, report.node_id or ""
        for use in metrics.MEMORY_USES:
            if mem.get(use) is not None:
                memory.add_metric([node, rid, use], float(mem[use]))
        engine = report.engine
        if engine.get("adapter_pool_fragmentation") is not None:
            fragmentation.add_metric([rid], float(engine["adapter_pool_fragmentation"]))
        for family, field in engine_families:
            if field in engine:
                family.add_metric([rid], float(engine[field]))
        for name, c in sorted(report.classes.items()):
            for state in ("running", "waiting"):
                if state in c:
                    classes.add_metric([rid, name, state], float(c[state]))
            if c.get("slo_attainment") is not None:
                attainment.add_metric([rid, name], float(c["slo_attainment"]))
    yield from (loads, latency, hit_ratio, memory, fragmentation, classes, attainment)
    yield from (family for family, _ in engine_families)

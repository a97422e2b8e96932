"""Every Prometheus metric of lora-cluster, declared here and nowhere else.

Choice: `prometheus_client`, in the ingress process, exported at the ingress's `GET /metrics`.
The ingress sees every request's outcome, including what the replica reports in its stream (which
replica, adapter hit or miss, token counts), so request-level metrics are complete there. Engine
gauges (running/waiting requests, adapter slots) describe the LoRA replicas, which live in other
processes: they are computed at scrape time from the replicas' routing-stats reports that the
ingress's request router already receives (at most `routing_stats_period_s` old), so no second
transport is needed. (`ray.util.metrics` would export through Ray's per-node metrics agent on
another port, with its own delay; prometheus_client's multiprocess mode needs a shared folder and
one host.) With several ingress replicas each exports its own counters: scrape them all (or keep one).

The adapter store's per-tier counters travel the same way (the `store` part of each report).

Labels are bounded: `route` is a route template, `status` an HTTP status code, `replica` a replica
id (bounded by the replica count), `tier` one of device/host/disk/source. Never the adapter id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # no `_created` series next to every counter
REGISTRY = CollectorRegistry(auto_describe=True)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

REQUESTS = Counter(
    "lora_cluster_requests_total",
    "HTTP requests by route template and status code.",
    ["route", "status"],
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "lora_cluster_request_duration_seconds",
    "Time from request arrival to the last byte of the response.",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "lora_cluster_time_to_first_token_seconds",
    "Streaming requests: time from dispatch to the first token at the ingress.",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "lora_cluster_prompt_tokens_total", "Prompt tokens of finished generations.", registry=REGISTRY
)
GENERATED_TOKENS = Counter(
    "lora_cluster_generated_tokens_total", "Tokens generated (finished or not).", registry=REGISTRY
)
ADAPTER_HITS = Counter(
    "lora_cluster_adapter_hits_total",
    "Generations whose adapter was already on the replica's device.",
    registry=REGISTRY,
)
ADAPTER_MISSES = Counter(
    "lora_cluster_adapter_misses_total",
    "Generations whose replica had to load the adapter first.",
    registry=REGISTRY,
)
CANCELLED = Counter(
    "lora_cluster_cancelled_generations_total",
    "Generations cancelled before they finished (client gone, or another choice failed).",
    registry=REGISTRY,
)

_ENGINE_GAUGES = {
    # name: (help, function of one replica's routing stats)
    "lora_cluster_engine_running_requests": (
        "Sequences in the replica's running batch.",
        lambda s: s.get("num_running"),
    ),
    "lora_cluster_engine_waiting_requests": (
        "Requests waiting in the replica's engine queue.",
        lambda s: s.get("num_waiting"),
    ),
    "lora_cluster_adapter_slots_in_use": (
        "Device adapter slots holding (or loading) an adapter.",
        lambda s: None if "max_loras" not in s else s["max_loras"] - s.get("empty_adapter_slots", 0),
    ),
    "lora_cluster_adapter_slots": ("Device adapter slots (max_loras).", lambda s: s.get("max_loras")),
}


# Adapter store tiers (device, host, disk, source), from the `store` part of a replica's report:
# counters (name suffix, help, TierStats field) and gauges (name, help, field); labels replica, tier.
_STORE_COUNTERS = (
    ("lora_cluster_adapter_cache_hits", "Adapter requests served from the tier.", "hits"),
    ("lora_cluster_adapter_cache_misses", "Adapter requests that had to go to a slower tier.", "misses"),
    ("lora_cluster_adapter_cache_coalesced", "Requests that joined a load already in flight.", "coalesced"),
    ("lora_cluster_adapter_cache_loads", "Fills of the tier from the next one.", "loads"),
    ("lora_cluster_adapter_cache_load_seconds", "Time spent filling the tier.", "load_seconds_total"),
    ("lora_cluster_adapter_cache_evictions", "Adapters dropped from the tier for room.", "evictions"),
    ("lora_cluster_adapter_cache_failures", "Loads into the tier that failed.", "failures"),
    ("lora_cluster_adapter_cache_retries", "Transient source errors retried.", "retries"),
)
_STORE_GAUGES = (
    ("lora_cluster_adapter_cache_bytes", "Bytes of adapters held by the tier.", "bytes"),
    ("lora_cluster_adapter_cache_entries", "Adapters held by the tier.", "entries"),
    ("lora_cluster_adapter_cache_budget_bytes", "Byte budget of the tier.", "budget_bytes"),
)


def _store_families(stats: Mapping[str, Mapping[str, Any]]) -> Iterable[GaugeMetricFamily]:
    """Per-tier adapter store families from {replica id: report}; replicas without a store are skipped."""
    specs = [(CounterMetricFamily, *c) for c in _STORE_COUNTERS] + [
        (GaugeMetricFamily, *g) for g in _STORE_GAUGES
    ]
    for family_type, name, help_text, field in specs:
        family = family_type(name, help_text, labels=["replica", "tier"])
        for replica_id, report in sorted(stats.items()):
            for tier, counters in sorted((report.get("store") or {}).items()):
                if field in counters:
                    family.add_metric([replica_id, tier], float(counters[field]))
        yield family


class ReplicaStatsCollector(Collector):
    """Engine gauges, one sample per replica, from `source()` -> {replica id: routing stats}."""

    def __init__(self, source: Callable[[], Mapping[str, Mapping[str, Any]] | None]):
        self._source = source

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily("lora_cluster_replicas", "LoRA replicas the router sees.")]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self._source() or {}
        replicas = GaugeMetricFamily("lora_cluster_replicas", "LoRA replicas the router sees.")
        replicas.add_metric([], len(stats))
        yield replicas
        for name, (help_text, value) in _ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["replica"])
            for replica_id, s in sorted(stats.items()):
                v = value(s)
                if v is not None:
                    family.add_metric([replica_id], float(v))
            yield family
        yield from _store_families(stats)


_replica_collector: ReplicaStatsCollector | None = None


def set_replica_stats_source(source: Callable[[], Mapping[str, Mapping[str, Any]] | None]) -> None:
    """Export engine gauges from `source` (the ingress calls this once)."""
    global _replica_collector
    if _replica_collector is not None:
        REGISTRY.unregister(_replica_collector)
    _replica_collector = ReplicaStatsCollector(source)
    REGISTRY.register(_replica_collector)


def render() -> bytes:
    """The exposition text of every metric."""
    return generate_latest(REGISTRY)

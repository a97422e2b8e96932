"""What a scrape of the ingress's `GET /metrics` answers: the exposition text of every metric.

One ingress replica: this process's `REGISTRY` (its request metrics and, once the ingress named the
source of the replicas' reports, the replica metrics: `set_replica_stats_source`). Several ingress
replicas (`serve.ops.metrics_hub`): each sends `request_snapshot()` to the hub, and a scrape is
`render(merged, ingresses)`: the hub's sum of the request metrics, this process's replica metrics
once, and whether the sum was had (`lora_cluster_metrics_hub_up`; 0: this ingress's own figures).
Every metric and family is declared in `serve.ops.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.serve.ops.metrics import METRICS_HUB_INGRESSES, METRICS_HUB_UP, REGISTRY, REQUEST_METRICS
from lora_cluster.serve.ops.metrics_merge import Snapshot
from lora_cluster.serve.ops.replica_metrics import ReplicaStatsCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_replica_collector: ReplicaStatsCollector | None = None
_extra_collectors: dict[str, Collector] = {}  # other families computed at each scrape, by name


def set_scrape_collector(name: str, collector: Collector) -> None:
    """Export families computed at each scrape from this ingress's own state (not summed over the
    ingresses: each holds the same, e.g. the tenants' budget use), in place of an earlier collector
    under the same `name`."""
    earlier = _extra_collectors.pop(name, None)
    if earlier is not None:
        REGISTRY.unregister(earlier)
    _extra_collectors[name] = collector
    REGISTRY.register(collector)


def set_replica_stats_source(source: Callable[[], Mapping[str, RoutingStats] | None]) -> None:
    """Export engine gauges from `source` (the ingress calls this once)."""
    global _replica_collector
    if _replica_collector is not None:
        REGISTRY.unregister(_replica_collector)
    _replica_collector = ReplicaStatsCollector(source)
    REGISTRY.register(_replica_collector)


def request_snapshot() -> Snapshot:
    """This process's request metrics (REQUEST_METRICS) as plain data: every family's samples."""
    return [(family.name, family.type, family.documentation,
             [(s.name, tuple(s.labels.items()), s.value) for s in family.samples])
            for metric in REQUEST_METRICS for family in metric.collect()]


class _Merged(Collector):
    """The request metrics of every ingress (`merged`), this process's replica metrics, and whether
    the sum was had."""

    def __init__(self, merged: Snapshot | None, ingresses: int):
        self._merged, self._ingresses = merged, ingresses

    def collect(self) -> Iterable[Metric]:
        if self._merged is None:
            yield from (family for metric in REQUEST_METRICS for family in metric.collect())
        else:
            for name, kind, help_text, samples in self._merged:
                family = Metric(name, help_text, kind)
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, dict(labels), value)
                yield family
        if _replica_collector is not None:
            yield from _replica_collector.collect()
        for collector in _extra_collectors.values():
            yield from collector.collect()
        up = METRICS_HUB_UP.family()
        up.add_metric([], 1.0 if self._merged is not None else 0.0)
        yield up
        summed = METRICS_HUB_INGRESSES.family()
        summed.add_metric([], float(self._ingresses))
        yield summed


def render(merged: Snapshot | None = None, ingresses: int | None = None) -> bytes:
    """The exposition text of every metric. `ingresses` None (one ingress replica): this process's
    metrics. Several ingress replicas: `merged` is their request metrics' sum over `ingresses`
    ingresses (serve.ops.metrics_hub), None when it could not be had (then this process's own)."""
    if ingresses is None:
        return generate_latest(REGISTRY)
    return generate_latest(_Merged(merged, ingresses))

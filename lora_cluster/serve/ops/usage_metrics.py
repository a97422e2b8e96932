"""The ingress's Prometheus usage counters per tenant and SLA class (`lora_cluster_usage_*`).

Every generation that ends at this ingress (`generation_metrics.GenerationMetrics`) and every request
it refuses (`usage_refusals`) is counted here: requests by outcome, prompt, cached and output tokens,
and the device-seconds its replica charged it (`RequestOutput.device_s`, on the final item). These
are live rates for dashboards and alerts; the usage store is the exact, durable record (a generation
cancelled before its final item is counted with the tokens received and no device-seconds).

Labels are bounded by configuration, never by what a client sends: `tenant` is a tenant of the
tenants file in force (`tenants`, at most its `MAX_TENANTS`), "other" for a name that is not (a
tenant removed since), `NO_TENANT` without one; `priority_class` a configured SLA class, else
"other"; `outcome` one of `OUTCOMES`. The ingress calls `configure` once.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from lora_cluster.serve.ops.metrics import (
    NO_TENANT,
    USAGE_CACHED_TOKENS,
    USAGE_DEVICE_SECONDS,
    USAGE_OUTPUT_TOKENS,
    USAGE_PROMPT_TOKENS,
    USAGE_REQUESTS,
)
from lora_cluster.tenancy.tenants import Directory

OTHER = "other"
OUTCOMES = ("completed", "cancelled", "failed", "refused")


class TenantsInForce(Protocol):
    """The tenants file in force (`tenancy.watch.TenantsWatcher`)."""

    def current(self) -> Directory: ...


class UsageLabels:
    """The bounded label values of a tenant and a class (see the module docstring)."""

    def __init__(self, tenants: TenantsInForce | None = None, classes: Collection[str] = ()):
        self._tenants, self._classes = tenants, frozenset(classes)

    def tenant(self, name: str | None) -> str:
        if name is None:
            return NO_TENANT
        known = self._tenants is not None and name in self._tenants.current().tenants
        return name if known else OTHER

    def sla_class(self, name: str) -> str:
        return name if name in self._classes else OTHER


_labels = UsageLabels()


def configure(tenants: TenantsInForce | None, classes: Collection[str]) -> None:
    """Bound the labels: `tenants` is the tenants file in force (None: no tenants file), `classes` the
    configured SLA classes."""
    global _labels
    _labels = UsageLabels(tenants, classes)


def count(*, tenant: str | None, sla_class: str, outcome: str, prompt_tokens: int = 0,
          cached_tokens: int = 0, output_tokens: int = 0, device_s: float = 0.0) -> None:
    """Count one generation (or refused request) that ended with `outcome`."""
    if outcome not in OUTCOMES:
        raise ValueError(f"usage outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    labels = (_labels.tenant(tenant), _labels.sla_class(sla_class))
    USAGE_REQUESTS.labels(*labels, outcome).inc()
    for metric, value in ((USAGE_PROMPT_TOKENS, prompt_tokens), (USAGE_CACHED_TOKENS, cached_tokens),
                          (USAGE_OUTPUT_TOKENS, output_tokens), (USAGE_DEVICE_SECONDS, device_s)):
        metric.labels(*labels).inc(value)  # 0 too: the series exists from the tenant's first request


__all__ = ["OTHER", "OUTCOMES", "TenantsInForce", "UsageLabels", "configure", "count"]

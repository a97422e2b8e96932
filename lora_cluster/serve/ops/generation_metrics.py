"""A generation's request metrics under bounded labels: what the dispatcher records of each choice.

`GenerationMetrics` follows one generation from its dispatch to its end (queue wait, time to first
token, time per output token, end-to-end latency, tokens, outcome, SLO met or missed) and
`routing_decision` counts where it ran; the metrics are declared in `serve.ops.metrics`.

Labels are bounded (`serve.ops.top_labels`): the busiest adapters and tenants over
`metrics_label_window_s` keep their own label, every other one is "other", and the series of a
demoted adapter or tenant are dropped (this process's index of series holds only live ones).
Base-model requests are adapter="_base", requests without a tenant tenant="_none". `configure` sets
the bounds and the SLA classes once, in the ingress; until then ServeConfig's defaults hold.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import SlaClasses, build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.serve.ops import usage_metrics
from lora_cluster.serve.ops.metrics import (
    BASE_ADAPTER,
    E2E_LATENCY,
    GENERATED_TOKENS,
    GENERATIONS,
    NO_TENANT,
    PROMPT_CACHED_TOKENS,
    PROMPT_TOKENS,
    QUEUE_DEPTH,
    QUEUE_WAIT,
    ROUTING_DECISIONS,
    SLO_REQUESTS,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
)
from lora_cluster.serve.ops.top_labels import OTHER, TopLabels


class _Labels:
    """This process's bounded adapter and tenant labels, and the series created under each one (so
    that a demoted adapter's or tenant's series can be dropped). The index holds only live series."""

    def __init__(self, max_adapters: int, max_tenants: int, window_s: float, sla: SlaClasses,
                 clock: Callable[[], float] = time.monotonic):
        self.adapters = TopLabels(max_adapters, window_s, clock=clock)
        self.tenants = TopLabels(max_tenants, window_s, clock=clock)
        self.sla = sla
        # (kind, label) -> {(metric, label values, adapter label or None, tenant label)}
        self._series: dict[tuple[str, str], set[tuple[Any, tuple[str, ...], str | None, str]]] = {}

    def resolve(self, adapter_id: str | None, tenant: str | None) -> tuple[str, str]:
        """(adapter label, tenant label) of one generation; counts a use of each."""
        adapter = BASE_ADAPTER if adapter_id is None else self.adapters.label(adapter_id)
        who = NO_TENANT if tenant is None else self.tenants.label(tenant)
        for value in self.adapters.take_demoted():
            self._drop("adapter", value)
        for value in self.tenants.take_demoted():
            self._drop("tenant", value)
        return adapter, who

    def current(self, adapter: str, tenant: str) -> tuple[str, str]:
        """Labels chosen earlier, as they are now: a generation that started before its adapter (or
        tenant) was demoted ends under "other", so no series of a demoted value comes back."""
        if adapter != BASE_ADAPTER and not self.adapters.is_label(adapter):
            adapter = OTHER
        if tenant != NO_TENANT and not self.tenants.is_label(tenant):
            tenant = OTHER
        return adapter, tenant

    def child(self, metric: Any, values: tuple[str, ...], adapter: str | None, tenant: str) -> Any:
        entry = (metric, values, adapter, tenant)
        if adapter is not None:
            self._series.setdefault(("adapter", adapter), set()).add(entry)
        self._series.setdefault(("tenant", tenant), set()).add(entry)
        return metric.labels(*values)

    def _drop(self, kind: str, value: str) -> None:
        for entry in self._series.pop((kind, value), ()):
            metric, values, adapter, tenant = entry
            with contextlib.suppress(KeyError):
                metric.remove(*values)
            other = ("tenant", tenant) if kind == "adapter" else ("adapter", adapter)
            if other[1] is not None:
                self._series.get(other, set()).discard(entry)

    def series(self) -> int:
        """Label combinations in use (for tests and the cardinality measurement)."""
        return len({(id(m), v) for entries in self._series.values() for m, v, _, _ in entries})


_labels = _Labels(50, 50, 300.0, SlaClasses())  # ServeConfig's defaults until `configure`


def configure(config: ServeConfig, clock: Callable[[], float] = time.monotonic) -> None:
    """Bound the adapter and tenant labels as `config` says and learn its SLA classes (the ingress
    calls this once); every class gets its queue-depth series at 0."""
    global _labels
    section = config.metrics
    _labels = _Labels(section.metrics_max_adapter_labels, section.metrics_max_tenant_labels,
                      section.metrics_label_window_s, build_sla_classes(config), clock)
    for metric in (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, GENERATIONS, PROMPT_TOKENS,
                   PROMPT_CACHED_TOKENS, GENERATED_TOKENS, SLO_REQUESTS):
        metric.clear()  # series of an earlier configuration are not in the new index
    for name in _labels.sla.names:
        QUEUE_DEPTH.labels(name).set(0)


def label_series() -> int:
    """Label combinations in use (for tests and the cardinality measurement)."""
    return _labels.series()


class GenerationMetrics:
    """The metrics of one generation (one choice of a request), from its dispatch to its end.

    `tenant` is the request's tenant name (None: no tenant). The adapter and tenant labels are chosen
    once, when the generation reaches a replica (`started`), so an unknown adapter never takes a
    label; a generation that never starts is counted only by the HTTP and routing counters. Call
    `started`, `tokens` as they arrive, then exactly one of `finished`, `failed`, `cancelled` (later
    calls are ignored)."""

    def __init__(self, adapter_id: str | None, tenant: str | None, priority_class: str,
                 arrived_at: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.adapter_id, self.tenant, self.priority_class = adapter_id, tenant, priority_class
        self._clock = clock
        self.arrived_at = clock() if arrived_at is None else arrived_at
        self._first_at: float | None = None
        self._labels: tuple[str, str] | None = None
        self._ended = False
        self._output = 0  # tokens received so far (the usage counters' count of a cancelled one)

    def admitted(self) -> None:
        """Admission answered (at once, or after a wait in the cluster queue)."""
        QUEUE_WAIT.labels(self.priority_class).observe(self._clock() - self.arrived_at)

    def started(self, ttft_s: float | None = None) -> None:
        """The first item came: `ttft_s` from dispatch (None: now, the first token arrived)."""
        if self._labels is not None:
            return
        self._labels = _labels.resolve(self.adapter_id, self.tenant)
        ttft = self._clock() - self.arrived_at if ttft_s is None else ttft_s
        self._first_at = self.arrived_at + ttft
        self._child(TIME_TO_FIRST_TOKEN).observe(ttft)

    def tokens(self, n: int) -> None:
        if n and self._labels is not None:
            self._output += n
            self._child(GENERATED_TOKENS).inc(n)

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                 device_s: float = 0.0) -> None:
        """The generation ended well; `cached_tokens` of its prompt tokens came from the prefix cache,
        `device_s` is the engine time its replica charged it (the usage counters: `usage_metrics`)."""
        if not self._end("ok"):
            return
        usage_metrics.count(tenant=self.tenant, sla_class=self.priority_class, outcome="completed",
                            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                            output_tokens=completion_tokens, device_s=device_s)
        now = self._clock()
        self._child(E2E_LATENCY).observe(now - self.arrived_at)
        self._child(PROMPT_TOKENS).inc(prompt_tokens)
        self._child(PROMPT_CACHED_TOKENS).inc(cached_tokens)
        first = self._first_at if self._first_at is not None else now
        tpot = (now - first) / (completion_tokens - 1) if completion_tokens > 1 else None
        if tpot is not None:
            self._child(TIME_PER_OUTPUT_TOKEN).observe(tpot)
        sla = _labels.sla.by_name.get(self.priority_class)
        met = sla is None or sla.met(first - self.arrived_at, tpot)
        self._slo("met" if met else "missed")

    def failed(self) -> None:
        if self._end("error"):
            self._slo("missed")
            usage_metrics.count(tenant=self.tenant, sla_class=self.priority_class, outcome="failed",
                                output_tokens=self._output)

    def cancelled(self) -> None:
        if self._end("cancelled"):
            usage_metrics.count(tenant=self.tenant, sla_class=self.priority_class, outcome="cancelled",
                                output_tokens=self._output)

    def _end(self, outcome: str) -> bool:
        if self._ended or self._labels is None:
            return False
        self._ended = True
        adapter, tenant = _labels.current(*self._labels)
        _labels.child(GENERATIONS, (adapter, tenant, self.priority_class, outcome), adapter, tenant).inc()
        return True

    def _child(self, metric: Any) -> Any:
        assert self._labels is not None
        adapter, tenant = _labels.current(*self._labels)
        return _labels.child(metric, (adapter, tenant, self.priority_class), adapter, tenant)

    def _slo(self, outcome: str) -> None:
        assert self._labels is not None
        tenant = _labels.current(*self._labels)[1]
        _labels.child(SLO_REQUESTS, (tenant, self.priority_class, outcome), None, tenant).inc()


def routing_decision(adapter_id: str | None, replica: str, hit: bool,
                     stats: Mapping[str, RoutingStats] | None) -> str:
    """Count where a generation ran (see ROUTING_DECISIONS) and return the decision; `stats`: the
    replicas' last routing reports."""
    held_elsewhere = adapter_id is not None and any(
        report.holds(adapter_id) for rid, report in (stats or {}).items() if rid != replica)
    decision = "hit" if hit else "spill" if held_elsewhere else "miss"
    ROUTING_DECISIONS.labels(decision).inc()
    return decision

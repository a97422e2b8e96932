"""Every Prometheus metric of lora-cluster, declared here and nowhere else.

Choice: `prometheus_client`, in the ingress process, exported at the ingress's `GET /metrics`.
The ingress sees every request's outcome, including what the replica reports in its stream (which
replica, adapter hit or miss, token counts), so request-level metrics are complete there. Engine
gauges (running/waiting requests, adapter slots) describe the LoRA replicas, which live in other
processes: they are computed at scrape time from the replicas' routing-stats reports that the
ingress's request router already receives (at most `routing_stats_period_s` old), so no second
transport is needed. (`ray.util.metrics` would export through Ray's per-node metrics agent on
another port, with its own delay; prometheus_client's multiprocess mode needs a shared folder and
one host.) With several ingress replicas each measures its own requests and sends them to the
`MetricsHub` (`serve.ops.metrics_hub`): every ingress's /metrics shows the request metrics of all of
them (`render(merged, ...)`), with the replica metrics once.

The adapter store's per-tier counters travel the same way (the `store` part of each report), and so
do each replica's engine counters (steps, batch sizes, tokens, preemptions, prefix cache hits,
adapter placements and switches), its device memory by use and the node it runs on: one scrape of the
ingress shows the whole cluster. Names are prefixed `lora_cluster_` and end in their unit
(`_seconds`, `_bytes`, `_ratio`, `_total` for counters).

Labels are bounded: `route` is a route template, `status` an HTTP status code, `replica` a replica
id and `node` a Ray node id (bounded by the cluster), `tier` one of device/host/disk/source,
`priority_class` a configured SLA class (at most 16), `outcome`, `decision` and `use` fixed sets.
`adapter` and `tenant` are bounded by `metrics_max_adapter_labels` / `metrics_max_tenant_labels`:
the busiest ones over `metrics_label_window_s` keep their own label, every other one is "other"
(`serve.ops.top_labels`; a demoted adapter's series are dropped). Base-model requests are
adapter="_base" and requests without a tenant tenant="_none" (an adapter id or tenant name cannot
start with "_", so these never collide with one).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import SlaClasses, build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.replica_policy.tier_stats import LOAD_BUCKETS_S
from lora_cluster.serve.ops.metrics_merge import Snapshot
from lora_cluster.serve.ops.top_labels import OTHER, TopLabels

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
TRUNCATED_PROMPTS = Counter(
    "lora_cluster_truncated_prompts_total",
    "Text prompts and conversations fitted to the prompt limit (prompt_truncation: auto).",
    registry=REGISTRY,
)
TRUNCATED_PROMPT_TOKENS = Counter(
    "lora_cluster_truncated_prompt_tokens_total",
    "Tokens cut from prompts to fit the prompt limit (prompt_truncation: auto; per request, the "
    "x-lora-truncated-tokens header).",
    registry=REGISTRY,
)
RETRIES = Counter(  # overload protection
    "lora_cluster_generation_retries_total",
    "Generations sent again to another replica because theirs died or was unreachable before the "
    "first item.",
    registry=REGISTRY,
)

# ----- generations by adapter, tenant and SLA class (bounded labels: serve.ops.top_labels) -----
BASE_ADAPTER = "_base"  # adapter label of base-model requests
NO_TENANT = "_none"  # tenant label of requests without a tenant
ROUTING_DECISION_VALUES = ("hit", "miss", "spill")
_GEN = ["adapter", "tenant", "priority_class"]
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

TIME_TO_FIRST_TOKEN = Histogram(
    "lora_cluster_time_to_first_token_seconds",
    "Time from dispatch (before the cluster queue) to the first token: at the ingress for streams, "
    "queue wait + the engine's TTFT otherwise.", _GEN, buckets=_TTFT_BUCKETS, registry=REGISTRY)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "lora_cluster_time_per_output_token_seconds",
    "(end - first token) / (completion tokens - 1) of finished generations with two tokens or more.",
    _GEN, buckets=_TPOT_BUCKETS, registry=REGISTRY)
E2E_LATENCY = Histogram(
    "lora_cluster_e2e_request_latency_seconds",
    "Time from dispatch (before the cluster queue) to the last token of finished generations.",
    _GEN, buckets=_E2E_BUCKETS, registry=REGISTRY)
GENERATIONS = Counter(
    "lora_cluster_generations_total",
    "Generations (one per choice) that reached a replica, by how they ended: ok, error, cancelled.",
    [*_GEN, "outcome"], registry=REGISTRY)
PROMPT_TOKENS = Counter("lora_cluster_prompt_tokens_total", "Prompt tokens of finished generations.",
                        _GEN, registry=REGISTRY)
GENERATED_TOKENS = Counter("lora_cluster_generated_tokens_total", "Tokens generated (finished or not).",
                           _GEN, registry=REGISTRY)
PROMPT_CACHED_TOKENS = Counter(
    "lora_cluster_prompt_cached_tokens_total",
    "Prompt tokens of finished generations whose KV came from the replica's prefix cache (the hit rate: "
    "its rate over lora_cluster_prompt_tokens_total's).", _GEN, registry=REGISTRY)
SLO_REQUESTS = Counter(
    "lora_cluster_slo_requests_total",
    "Finished or failed generations by whether they met their SLA class's TTFT and TPOT targets "
    "(met, missed; an error is missed; a class without targets is always met).",
    ["tenant", "priority_class", "outcome"], registry=REGISTRY)
QUEUE_WAIT = Histogram(
    "lora_cluster_queue_wait_seconds",
    "Time a generation waited for admission (the cluster queue; about 0 on the fast path).",
    ["priority_class"], buckets=_LATENCY_BUCKETS, registry=REGISTRY)
QUEUE_DEPTH = Gauge("lora_cluster_queue_depth",
                    "Generations waiting in the cluster queue now (several ingress replicas: all of theirs).",
                    ["priority_class"], registry=REGISTRY)
ROUTING_DECISIONS = Counter(
    "lora_cluster_routing_decisions_total",
    "Generations by where they ran: hit (adapter resident there), spill (resident on another "
    "replica only), miss (resident nowhere).", ["decision"], registry=REGISTRY)
ROUTING_ERRORS = Counter(
    "lora_cluster_routing_errors_total",
    "Sends that failed for the routing's sake: no replica, a replica that died, was unreachable or "
    "ended a stream without output (before or after the first item).", registry=REGISTRY)
for _decision in ROUTING_DECISION_VALUES:
    ROUTING_DECISIONS.labels(_decision)

# every metric measured by this ingress: what several ingress replicas sum (serve.ops.metrics_hub)
REQUEST_METRICS = (REQUESTS, REQUEST_LATENCY, ADAPTER_HITS, ADAPTER_MISSES, CANCELLED, RETRIES,
                   TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, GENERATIONS, PROMPT_TOKENS,
                   GENERATED_TOKENS, PROMPT_CACHED_TOKENS, SLO_REQUESTS, QUEUE_WAIT, QUEUE_DEPTH,
                   ROUTING_DECISIONS, ROUTING_ERRORS)


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
    _labels = _Labels(config.metrics.metrics_max_adapter_labels, config.metrics.metrics_max_tenant_labels,
                      config.metrics.metrics_label_window_s, build_sla_classes(config), clock)
    for metric in (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, GENERATIONS, PROMPT_TOKENS,
                   PROMPT_CACHED_TOKENS, GENERATED_TOKENS, SLO_REQUESTS):
        metric.clear()  # series of an earlier configuration are not in the new index
    for name in _labels.sla.names:
        QUEUE_DEPTH.labels(name).set(0)


def label_series() -> int:
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
            self._child(GENERATED_TOKENS).inc(n)

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        """The generation ended well; `cached_tokens` of its prompt tokens came from the prefix cache."""
        if not self._end("ok"):
            return
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

    def cancelled(self) -> None:
        self._end("cancelled")

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


_ENGINE_GAUGES = {
    # name: (help, function of one replica's routing stats)
    "lora_cluster_engine_running_requests": (
        "Sequences in the replica's running batch.",
        lambda s: s.num_running,
    ),
    "lora_cluster_engine_waiting_requests": (
        "Requests waiting in the replica's engine queue.",
        lambda s: s.num_waiting,
    ),
    "lora_cluster_adapter_slots_in_use": (
        "Device adapter slots holding (or loading) an adapter.",
        lambda s: None if s.max_loras is None else s.max_loras - (s.empty_adapter_slots or 0),
    ),
    "lora_cluster_adapter_slots": ("Device adapter slots (max_loras).", lambda s: s.max_loras),
    "lora_cluster_prefix_cache_blocks": (
        "KV blocks of the replica holding cached prefix content (in use or idle, evictable).",
        lambda s: s.engine.get("prefix_cache_blocks"),
    ),
    "lora_cluster_prefix_cache_hit_ratio": (
        "Prefix cache hit tokens / queried tokens of the replica since it started (per adapter and tenant: "
        "lora_cluster_prompt_cached_tokens_total's rate over lora_cluster_prompt_tokens_total's).",
        lambda s: (s.prefix_cache() or {}).get("hit_rate"),
    ),
    "lora_cluster_adapter_miss_penalty_ratio": (
        "Adapter protection's soft routing score for a miss on the replica: 0 (fine) to 1 (in thrash, "
        "misses are better sent elsewhere).",
        lambda s: s.miss_penalty,
    ),
    "lora_cluster_adapter_thrash_copy_ratio": (
        "Share of the replica's step-loop time spent placing adapters into slots (the thrash cost).",
        lambda s: s.adapter_thrash.get("copy_share"),
    ),
    "lora_cluster_adapter_thrash_reload_ratio": (
        "Share of the replica's loader time spent reloading adapters that switches evicted (thrash cost).",
        lambda s: s.adapter_thrash.get("reload_share"),
    ),
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


def _store_families(stats: Mapping[str, RoutingStats]) -> Iterable[GaugeMetricFamily]:
    """Per-tier adapter store families from {replica id: report}; replicas without a store are skipped."""
    specs = [(CounterMetricFamily, *c) for c in _STORE_COUNTERS] + [
        (GaugeMetricFamily, *g) for g in _STORE_GAUGES
    ]
    for family_type, name, help_text, field in specs:
        family = family_type(name, help_text, labels=["replica", "tier"])
        for replica_id, report in sorted(stats.items()):
            for tier, counters in sorted(report.store.items()):
                if field in counters:
                    family.add_metric([replica_id, tier], float(counters[field]))
        yield family


# Each replica's engine counters (the `engine` part of its report): name, help, field; label replica.
_ENGINE_COUNTERS = (
    ("lora_cluster_engine_steps", "Engine steps that ran a batch.", "steps"),
    ("lora_cluster_engine_batched_sequences",
     "Sequences in those steps (mean batch size: its rate over the steps' rate).", "batched_seqs"),
    ("lora_cluster_engine_sampled_tokens", "Tokens sampled (its rate: the replica's tokens/s).",
     "sampled_tokens"),
    ("lora_cluster_engine_preemptions", "Running requests preempted for more urgent ones.", "preemptions"),
    ("lora_cluster_engine_failed_steps", "Engine steps that failed (their requests ended with an error).",
     "failed_steps"),
    ("lora_cluster_adapter_switches",
     "Adapters placed into a device slot that held another adapter (seed 001's adapter switch).", "switches"),
    ("lora_cluster_prefix_cache_queried_tokens",
     "Tokens of requests admitted to the engine (re-admissions after a preemption too) looked up in the "
     "prefix cache.", "prefix_cache_queried_tokens"),
    ("lora_cluster_prefix_cache_hit_tokens",
     "Of those, tokens whose KV blocks were cached (not computed again); the hit rate is its rate over "
     "the queried tokens' rate.", "prefix_cache_hit_tokens"),
    ("lora_cluster_prefix_cache_evictions",
     "Idle cached KV blocks evicted (least recently used) for other content.", "prefix_cache_evictions"),
)
MEMORY_USES = ("base_weights", "kv_cache", "adapter_pool", "free")


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
    loads = CounterMetricFamily(
        "lora_cluster_adapter_loads", "Adapter loads by tier (device: placements into a slot; host, disk: "
        "fills from the next tier; source: fetches) and outcome (ok, failed).",
        labels=["replica", "tier", "outcome"])
    latency = HistogramMetricFamily(
        "lora_cluster_adapter_load_duration_seconds", "Latency of the adapter loads of each tier (device: "
        "the placement into a slot, as the load-latency alert sees it).",
        labels=["replica", "tier"])
    hit_ratio = GaugeMetricFamily("lora_cluster_adapter_cache_hit_ratio",
                                  "hits / (hits + misses) of the tier since the replica started.",
                                  labels=["replica", "tier"])
    memory = GaugeMetricFamily(
        "lora_cluster_device_memory_bytes", "Device memory of each replica by use: base_weights, kv_cache, "
        "adapter_pool as allocated, free as the device reports it (CUDA only; shared by the replicas "
        "of one device).", labels=["node", "replica", "use"])
    fragmentation = GaugeMetricFamily(
        "lora_cluster_adapter_pool_fragmentation_ratio", "Share of the bytes of the adapter slots in use "
        "that holds rank padding (slots are sized for max_lora_rank on every projection).",
        labels=["replica"])
    classes = GaugeMetricFamily("lora_cluster_replica_requests",
                                "Requests on the replica by SLA class and state (running, waiting).",
                                labels=["replica", "priority_class", "state"])
    attainment = GaugeMetricFamily("lora_cluster_replica_slo_attainment_ratio",
                                   "Share of the class's requests that met its targets on the replica over "
                                   "the last minute (engine-measured).", labels=["replica", "priority_class"])
    engine_families = [(CounterMetricFamily(n, h, labels=["replica"]), f) for n, h, f in _ENGINE_COUNTERS]
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
        for use in MEMORY_USES:
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


class ReplicaStatsCollector(Collector):
    """Replica metrics, one sample per replica (and tier, class, ...), from `source()` -> {replica id:
    routing stats}: engine gauges and counters, adapter store tiers, loads, memory."""

    def __init__(self, source: Callable[[], Mapping[str, RoutingStats] | None]):
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
        yield from _replica_families(stats)


_replica_collector: ReplicaStatsCollector | None = None


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
        up = GaugeMetricFamily("lora_cluster_metrics_hub_up",
                               "1: the request metrics of this scrape are the sum over every ingress replica "
                               "(the metrics hub answered); 0: this ingress replica's own only.")
        up.add_metric([], 1.0 if self._merged is not None else 0.0)
        yield up
        summed = GaugeMetricFamily("lora_cluster_metrics_hub_ingresses",
                                   "Ingress replicas whose request metrics this scrape sums.")
        summed.add_metric([], float(self._ingresses))
        yield summed


def render(merged: Snapshot | None = None, ingresses: int | None = None) -> bytes:
    """The exposition text of every metric. `ingresses` None (one ingress replica): this process's
    metrics. Several ingress replicas: `merged` is their request metrics' sum over `ingresses`
    ingresses (serve.ops.metrics_hub), None when it could not be had (then this process's own)."""
    if ingresses is None:
        return generate_latest(REGISTRY)
    return generate_latest(_Merged(merged, ingresses))

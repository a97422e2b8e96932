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
them (`metrics_exposition.render(merged, ...)`), with the replica metrics once.

The adapter store's per-tier counters travel the same way (the `store` part of each report), and so
do each replica's engine counters (steps, batch sizes, tokens, preemptions, prefix cache hits,
adapter placements and switches), its device memory by use and the node it runs on: one scrape of the
ingress shows the whole cluster. Names are prefixed `lora_cluster_` and end in their unit
(`_seconds`, `_bytes`, `_ratio`, `_total` for counters).

Labels are bounded: `route` is a route template, `status` an HTTP status code, `replica` a replica
id and `node` a Ray node id (bounded by the cluster), `tier` one of device/host/disk/cluster/source,
`priority_class` a configured SLA class (at most 16), `outcome`, `decision`, `reason` and `use` fixed sets.
`adapter` and `tenant` are bounded by `metrics_max_adapter_labels` / `metrics_max_tenant_labels`:
the busiest ones over `metrics_label_window_s` keep their own label, every other one is "other"
(`serve.ops.top_labels`; a demoted adapter's series are dropped). Base-model requests are
adapter="_base" and requests without a tenant tenant="_none" (an adapter id or tenant name cannot
start with "_", so these never collide with one).

This module only declares: the metrics measured here (prometheus_client's Counter, Histogram and
Gauge, in `REGISTRY`) and the families computed at each scrape (`ScrapeFamily` and the tables of
report fields), each with its name, help and labels. `generation_metrics` records a generation's
metrics under the bounded labels, `replica_metrics` computes the replica families from the reports,
and `metrics_exposition` answers a scrape (this process's metrics, or the sum over every ingress).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

disable_created_metrics()  # no `_created` series next to every counter
REGISTRY = CollectorRegistry(auto_describe=True)

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
EDGE_REFUSALS = Counter(
    "lora_cluster_edge_refusals_total",
    "Requests the ingress refused before parking them, because the cluster controller's last published "
    "admission state says it would refuse them (cluster.edge; the controller never sees them), by reason "
    "(queue_full, cold_shed, deadline) and SLA class.", ["reason", "priority_class"], registry=REGISTRY)
# adapter versions under release (serve.ops.release_metrics): adapter = a name with a running release
# (at most metrics_max_adapter_labels names), version = its stable or candidate number, role = which
_RELEASE = ["adapter", "version", "role"]
RELEASE_ROLES = ("stable", "candidate")
RELEASE_VERSION_REQUESTS = Counter(
    "lora_cluster_release_version_requests_total",
    "Requests of the bare name or a pinned version answered or failed by the stable or the candidate "
    "version of a running release (a version outside it, or after it ended: no series).",
    _RELEASE, registry=REGISTRY)
RELEASE_VERSION_ERRORS = Counter(
    "lora_cluster_release_version_errors_total",
    "Of those, the requests that failed for a reason the version can cause (what the release's error "
    "gate counts).", _RELEASE, registry=REGISTRY)
RELEASE_VERSION_TTFT = Histogram(
    "lora_cluster_release_version_time_to_first_token_seconds",
    "The engine's time to first token of the answered requests of a version under release.",
    _RELEASE, buckets=_TTFT_BUCKETS, registry=REGISTRY)
for _decision in ROUTING_DECISION_VALUES:
    ROUTING_DECISIONS.labels(_decision)

# ----- usage by tenant and SLA class, for chargeback (serve.ops.usage_metrics; docs/metering.md) -----
# `tenant` is a tenant of the tenants file, "other" (a name no longer in it) or "_none"; `priority_class`
# a configured class or "other"; `outcome` completed, cancelled, failed or refused. The adapter is not
# a label (unbounded): per-adapter usage is the usage store's (GET /v1/usage?group_by=adapter).
_USAGE = ["tenant", "priority_class"]
USAGE_REQUESTS = Counter(
    "lora_cluster_usage_requests_total",
    "Requests (generations) by tenant, SLA class and how they ended, refusals at the ingress included.",
    [*_USAGE, "outcome"], registry=REGISTRY)
USAGE_PROMPT_TOKENS = Counter(
    "lora_cluster_usage_prompt_tokens_total", "Prompt tokens of the generations that ended, by tenant.",
    _USAGE, registry=REGISTRY)
USAGE_CACHED_TOKENS = Counter(
    "lora_cluster_usage_cached_tokens_total",
    "Prompt tokens served from the prefix cache (part of the prompt tokens), by tenant.", _USAGE,
    registry=REGISTRY)
USAGE_OUTPUT_TOKENS = Counter(
    "lora_cluster_usage_output_tokens_total", "Output tokens the clients received, by tenant.", _USAGE,
    registry=REGISTRY)
USAGE_DEVICE_SECONDS = Counter(
    "lora_cluster_usage_device_seconds_total",
    "Engine step time charged to the generations that finished (docs/metering.md), by tenant.", _USAGE,
    registry=REGISTRY)

# every metric measured by this ingress: what several ingress replicas sum (serve.ops.metrics_hub)
REQUEST_METRICS = (REQUESTS, REQUEST_LATENCY, ADAPTER_HITS, ADAPTER_MISSES, CANCELLED, RETRIES,
                   TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, E2E_LATENCY, GENERATIONS, PROMPT_TOKENS,
                   GENERATED_TOKENS, PROMPT_CACHED_TOKENS, SLO_REQUESTS, QUEUE_WAIT, QUEUE_DEPTH,
                   ROUTING_DECISIONS, ROUTING_ERRORS, EDGE_REFUSALS, USAGE_REQUESTS, USAGE_PROMPT_TOKENS,
                   USAGE_CACHED_TOKENS, USAGE_OUTPUT_TOKENS, USAGE_DEVICE_SECONDS,
                   RELEASE_VERSION_REQUESTS, RELEASE_VERSION_ERRORS, RELEASE_VERSION_TTFT)


@dataclass(frozen=True)
class ScrapeFamily:
    """A metric computed at each scrape (from the replicas' reports, or about the hub's sum), not
    measured here: its Prometheus family type, name, help and labels."""

    kind: type[CounterMetricFamily] | type[GaugeMetricFamily] | type[HistogramMetricFamily]
    name: str
    help: str
    labels: tuple[str, ...] = ()

    def family(self) -> Any:
        """An empty family of this metric, for one scrape's samples."""
        return self.kind(self.name, self.help, labels=list(self.labels))


# ----- replica metrics, from each replica's routing-stats report (serve.ops.replica_metrics) -----
REPLICAS = ScrapeFamily(GaugeMetricFamily, "lora_cluster_replicas", "LoRA replicas the router sees.")

ENGINE_GAUGES = {
    # name: (help, function of one replica's routing stats); label replica
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


# Adapter store tiers (device, host, disk, cluster, source), from the `store` part of a replica's report:
# counters (name suffix, help, TierStats field) and gauges (name, help, field); labels replica, tier.
STORE_COUNTERS = (
    ("lora_cluster_adapter_cache_hits", "Adapter requests served from the tier.", "hits"),
    ("lora_cluster_adapter_cache_misses", "Adapter requests that had to go to a slower tier.", "misses"),
    ("lora_cluster_adapter_cache_coalesced", "Requests that joined a load already in flight.", "coalesced"),
    ("lora_cluster_adapter_cache_loads", "Fills of the tier from the next one.", "loads"),
    ("lora_cluster_adapter_cache_load_seconds", "Time spent filling the tier.", "load_seconds_total"),
    ("lora_cluster_adapter_cache_evictions", "Adapters dropped from the tier for room.", "evictions"),
    ("lora_cluster_adapter_cache_failures", "Loads into the tier that failed.", "failures"),
    ("lora_cluster_adapter_cache_retries", "Transient source errors retried.", "retries"),
)
STORE_GAUGES = (
    ("lora_cluster_adapter_cache_bytes", "Bytes of adapters held by the tier.", "bytes"),
    ("lora_cluster_adapter_cache_entries", "Adapters held by the tier.", "entries"),
    ("lora_cluster_adapter_cache_budget_bytes", "Byte budget of the tier.", "budget_bytes"),
)


# Each replica's engine counters (the `engine` part of its report): name, help, field; label replica.
ENGINE_COUNTERS = (
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

# Each replica's cold-start counters, sent in the `engine` part of its report beside the engine's:
# its demand prefetch (`serve.replica.demand_prefetch`) and its node's cluster tier
# (`serve.replica.cluster_tier`); name, help, field; label replica.
COLD_START_COUNTERS = (
    ("lora_cluster_prefetches", "Demand prefetches that put an adapter into the replica's host tier.",
     "prefetches"),
    ("lora_cluster_prefetch_bytes", "Bytes those prefetches put into the host tier.", "prefetch_bytes"),
    ("lora_cluster_prefetch_failures",
     "Demand prefetches that did not land (the load failed, or the host tier refused the copy).",
     "prefetch_failures"),
    ("lora_cluster_prefetch_skipped",
     "Prefetch turns skipped because a live request's adapter load waited or ran.", "prefetch_skipped"),
    ("lora_cluster_cluster_tier_fetches",
     "Adapters copied from another node through the cluster tier, checksums verified.",
     "cluster_tier_fetches"),
    ("lora_cluster_cluster_tier_refused",
     "Copies from the cluster tier refused for a checksum mismatch (the source served).",
     "cluster_tier_refused"),
    ("lora_cluster_cluster_tier_publications",
     "Adapters this replica published to the cluster tier.", "cluster_tier_publications"),
    ("lora_cluster_cluster_tier_publications_skipped",
     "Publications skipped because the replica's publishing queue was full.",
     "cluster_tier_publications_skipped"),
)

ADAPTER_LOADS = ScrapeFamily(
    CounterMetricFamily, "lora_cluster_adapter_loads", "Adapter loads by tier (device: placements into a "
    "slot; host, disk: fills from the next tier; source: fetches) and outcome (ok, failed).",
    ("replica", "tier", "outcome"))
ADAPTER_LOAD_DURATION = ScrapeFamily(
    HistogramMetricFamily, "lora_cluster_adapter_load_duration_seconds", "Latency of the adapter loads of "
    "each tier (device: the placement into a slot, as the load-latency alert sees it).", ("replica", "tier"))
ADAPTER_CACHE_HIT_RATIO = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_adapter_cache_hit_ratio",
    "hits / (hits + misses) of the tier since the replica started.", ("replica", "tier"))
DEVICE_MEMORY = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_device_memory_bytes", "Device memory of each replica by use: "
    "base_weights, kv_cache, adapter_pool as allocated, free as the device reports it (CUDA only; shared "
    "by the replicas of one device).", ("node", "replica", "use"))
ADAPTER_POOL_FRAGMENTATION = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_adapter_pool_fragmentation_ratio", "Share of the bytes of the adapter "
    "slots in use that holds rank padding (slots are sized for max_lora_rank on every projection).",
    ("replica",))
REPLICA_REQUESTS = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_replica_requests",
    "Requests on the replica by SLA class and state (running, waiting).",
    ("replica", "priority_class", "state"))
REPLICA_SLO_ATTAINMENT = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_replica_slo_attainment_ratio", "Share of the class's requests that met "
    "its targets on the replica over the last minute (engine-measured).", ("replica", "priority_class"))

# ----- releases, from the ingress's release book at each scrape (serve.ops.release_metrics) -----
# every ingress follows the same release state, so any one answers for all; `adapter` is a name with a
# running (or rolled-back) release, at most metrics_max_adapter_labels names; `state` and `cause` fixed sets
RELEASE_STEP_SECONDS = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_release_step_seconds", "Seconds the running release of the adapter "
    "name has been in its current step (evaluating: since it was created), by state (evaluating, canary, "
    "paused): the stuck-release alert's input.", ("adapter", "state"))
RELEASE_CANDIDATE_SHARE = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_release_candidate_share_ratio", "Share of the bare name's traffic "
    "the running release's candidate answers now (its canary step; 0 while evaluating).", ("adapter",))
RELEASE_ROLLBACK_TIME = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_release_rollback_timestamp_seconds", "Unix time the adapter name's "
    "latest release was rolled back, for the names whose latest release was, by cause (eval: the eval "
    "gate; gate: a live gate, automatically; manual): the rollback alert's input.", ("adapter", "cause"))
RELEASE_STATES = ("evaluating", "canary", "paused")
ROLLBACK_CAUSES = ("eval", "gate", "manual")

# ----- the sum over several ingress replicas (serve.ops.metrics_exposition) -----
USAGE_BUDGET_USED = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_usage_budget_used_ratio",
    "Used / limit of each monthly budget of each tenant that has one (tenancy.budget), this UTC month, "
    "as last read from the usage store (at most usage_budget_refresh_s old): the 80% alert's input.",
    ("tenant", "budget"))
METRICS_HUB_UP = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_metrics_hub_up", "1: the request metrics of this scrape are the sum "
    "over every ingress replica (the metrics hub answered); 0: this ingress replica's own only.")
METRICS_HUB_INGRESSES = ScrapeFamily(
    GaugeMetricFamily, "lora_cluster_metrics_hub_ingresses",
    "Ingress replicas whose request metrics this scrape sums.")

"""The configuration of the Ray Serve application: every engine field plus replicas, resources,
routing, SLA classes, the cluster controller, replica groups, tenants and input limits."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lora_cluster.config.engine import EngineConfig
from lora_cluster.config.parsing import ByteSize, build_config

MAX_CLASSES = 16
DEFAULT_CLASS = "standard"
MAX_REPLICA_GROUPS = 16
MAX_GROUP_PATTERNS = 256


def _default_demo_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lora-cluster", "demo-zoo")


class SlaClassConfig(BaseModel):
    """One SLA class of `ServeConfig.sla_classes`; `lora_cluster.cluster.sla` holds the policy that
    resolves a request's class from them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="What clients send in `x-lora-priority` and get back in `x-lora-priority-class`: "
        "1-64 letters, digits, `_`, `.` or `-`.",
    )
    priority: int = Field(description="Lower is more urgent (vLLM's convention); the engine orders by it.")
    ttft_s: float | None = Field(None, gt=0, description="Time-to-first-token target (None: no target).")
    tpot_s: float | None = Field(None, gt=0, description="Time-per-output-token target (None: no target).")


DEFAULT_SLA_CLASSES = (
    SlaClassConfig(name="interactive", priority=0, ttft_s=1.0, tpot_s=0.2),
    SlaClassConfig(name="standard", priority=1, ttft_s=5.0, tpot_s=0.5),
    SlaClassConfig(name="batch", priority=2),
)


class ReplicaGroupConfig(BaseModel):
    """One named group of LoRA replicas (`ServeConfig.replica_groups`): its own Ray Serve deployment
    with its own replica count and resources, serving the adapters and tenants it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$",
        description="Group name (1-32 lowercase letters, digits or `-`): the deployment is "
        "`LoraReplica-<name>`, its controller `ClusterController-<name>`.",
    )
    num_replicas: int = Field(1, ge=1, le=1024, description="LoRA replicas of this group.")
    num_cpus: float | None = Field(None, ge=0, description="CPUs per replica (default: num_cpus).")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica (default: num_gpus).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {finance-node: 1}."
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels the replicas must run on (Ray's label_selector), e.g. "
        "{lora-group: finance}; KubeRay sets them from a worker group's `labels`.",
    )
    adapters: list[str] = Field(
        default_factory=list, max_length=MAX_GROUP_PATTERNS,
        description="Glob patterns (fnmatch, case-sensitive) of the adapter ids this group serves.",
    )
    tenants: list[str] = Field(
        default_factory=list, max_length=MAX_GROUP_PATTERNS,
        description="Tenant names (of the tenants file) whose requests this group serves.",
    )
    model: str | None = Field(
        None,
        description="This group's base model (as `model`: a local folder, a hub id or `demo`); default: "
        "the top-level `model`. Groups on different bases make a cluster of several base models: "
        "/v1/models lists each base with its adapters, and a request's `model` selects the group.",
    )
    served_model_name: str | None = Field(
        None, description="Name of this group's base in the API; default: the top-level "
        "served_model_name when the group keeps the top-level model, else its `model`.",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine settings of this group's replicas (EngineConfig fields other than `model`, "
        "e.g. {max_loras: 16, adapter_source: [s3://bucket/qwen3/], dtype: bfloat16}); the others "
        "are the top-level ones.",
    )

    @field_validator("engine")
    @classmethod
    def _engine_fields_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(k for k in value if k not in EngineConfig.model_fields or k == "model")
        if unknown:
            raise ValueError(f"engine lists {', '.join(unknown)}, which is not an engine setting of a "
                             "replica group (set a group's base model with its `model`)")
        return value


class ServeConfig(EngineConfig):
    """Configuration of the Ray Serve application: every engine field plus replicas, resources and limits.

    These are the application `args` of serve_config.yaml (`lora_cluster.serve.app:build_app`); each one
    is also read from `LORA_CLUSTER_<FIELD>`. Every replica builds its engine from this same config.
    """

    model: str = Field(
        "demo",
        description="Base model (a dense family of docs/model_families.md: Llama, Mistral, Qwen2/3, Gemma "
        "2/3, Phi-3/4, Granite, OLMo 2, SmolLM3): a local folder, a Hugging Face hub id, or `demo` = the "
        "built-in demo zoo "
        "(a tiny random-weight Llama model and its adapters, built into `demo_dir` on first use).",
    )
    demo_dir: str = Field(
        default_factory=_default_demo_dir,
        description="Cache folder of the demo zoo. Default: $XDG_CACHE_HOME/lora-cluster/demo-zoo "
        "(~/.cache/...).",
    )
    demo_num_adapters: int = Field(64, ge=1, le=4096, description="Adapters a0..a{N-1} of the demo zoo.")
    demo_size: Literal["tiny", "base", "1b"] = Field(
        "tiny", description="Demo model size: tiny, base (~88M) or 1b (~1.0B parameters, for a GPU)."
    )
    served_model_name: str | None = Field(
        None, description="Name of the base model in the API (`model` field, /v1/models); default: `model`."
    )
    num_replicas: int = Field(1, ge=1, le=1024, description="LoRA replicas (engines), each its own slots.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per LoRA replica (Ray resource).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per LoRA replica (Ray resource).")
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Requests one replica accepts at once (running + waiting in its engine); more "
        "wait in the router.",
    )
    max_queued_requests: int = Field(
        1024,
        ge=-1,
        description="Requests that may wait in the router for a replica; more are refused with "
        "429. -1 = no limit.",
    )
    ingress_num_replicas: int = Field(
        1, ge=1, description="Replicas of the HTTP ingress (API, router). Several share the tenants' quotas "
        "(quota ledger), the adapters loaded through the vLLM API (adapter registry) and the cluster queue.",
    )
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs reserved per ingress replica.")
    ingress_max_ongoing_requests: int = Field(4096, ge=1, description="Requests one ingress replica accepts.")
    ingress_autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling of the ingress replicas (Ray's `autoscaling_config`, as for "
        "autoscaling_config); when set, it replaces ingress_num_replicas. Environment: a JSON object. "
        "Default: a fixed ingress_num_replicas.",
        examples=[{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 512}],
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens; longer text is fitted or refused as "
        "prompt_truncation says, longer token ids are refused (400). Default: the engine's limit, "
        "max_model_len - 1.",
    )
    prompt_truncation: Literal["auto", "disabled"] = Field(
        "auto", description="A text prompt or chat conversation longer than the prompt limit: auto "
        "serves its most recent part (a text keeps its last tokens; a conversation its system messages "
        "and as many of its latest messages as fit) and says so in the x-lora-truncated-tokens header; "
        "disabled refuses it (400 prompt_too_long, as OpenAI and vLLM). Token-id prompts over the limit "
        "are refused either way (the API schema states their bound). Default auto: a prompt's token "
        "count is the one limit the API schema cannot state, so a schema-valid request is served.",
    )
    max_new_tokens: int = Field(
        1024, ge=1, description="Largest max_tokens / max_new_tokens a request may ask for (400 above)."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="max_new_tokens of chat and LoRAX requests that give none (completions: 16)."
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per prompt) and `best_of` "
                       "(candidates generated per prompt) of OpenAI requests, and LoRAX's `best_of`.")
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often each replica reports its adapters and load to the router."
    )
    router_miss_cost: float = Field(
        4.0,
        ge=0,
        description="Routing: queued requests beyond free batch slots that a replica holding the "
        "adapter may have before a replica without it (which must load it) is preferred.",
    )
    router_placement_ttl_s: float = Field(
        5.0,
        gt=0,
        description="Routing: how long the router trusts its own recent placements before the "
        "replicas' reports confirm them.",
    )
    prefix_aware_routing: bool = Field(
        True,
        description="Routing: weigh the prompt prefixes each replica reports caching, so that a request "
        "goes where its prefix (a shared system prompt, a chat's earlier turns) is cached, unless that "
        "replica is loaded. Off: adapter-only routing (the router and the cluster queue's grants ignore "
        "the replicas' prefix summaries).",
    )
    prefix_routing_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Routing: the most a cached prefix takes off a replica's cost, as a share of "
        "router_miss_cost (a fully cached prefix of 4,096 tokens; shorter ones less). A replica more "
        "loaded than another by more than this share of a miss cost loses the request, prefix or not.",
    )
    controller: bool = Field(
        True,
        description="Run the cluster controller: the cluster-wide priority queue, cross-replica "
        "preemption and adapter placement. Off: requests wait in Ray Serve's own queue (FIFO).",
    )
    controller_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="Cluster controller actors per replica group: each owns the cluster queue, grants and "
        "placement of the adapters a stable hash of the adapter id gives it (base-model requests: shard 0), "
        "over every replica (each replica reports to each, with a share of its free room). Shard 0 keeps "
        "the deployment name `ClusterController[-<group>]`, shard k > 0 adds `-shard<k>` (docs/scale.md).",
    )
    admission_capacity: int | None = Field(
        None,
        ge=1,
        description="Requests one replica is given at once before the ingress parks further ones in "
        "the cluster queue (default: max_num_seqs, the replica's batch slots).",
    )
    admission_window_max: int | None = Field(
        None,
        ge=0,
        description="Most requests a replica is given beyond admission_capacity while the cluster "
        "queue holds tickets, so that a freed slot finds its next request already waiting instead of "
        "idling through the report -> grant -> send round trip; sized at run time by feedback (grows "
        "when a step runs with a free seat and nothing waiting, shrinks while requests wait). Default: "
        "max_ongoing_requests - admission_capacity. 0: no window.",
    )
    cluster_queue_size: int = Field(
        4096, ge=1, description="Requests the cluster queue holds; more are refused with 429 and Retry-After "
        "(a more urgent request bumps the least urgent queued one instead)."
    )
    cluster_queue_aging_s: float = Field(
        10.0,
        gt=0,
        description="Aging of the cluster queue: a waiting request gains one priority level per "
        "this many seconds (never above the most urgent class), so no class starves.",
    )
    cluster_queue_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait in the cluster queue before a request is refused (503); a "
        "request whose predicted wait is longer is refused at once (429)."
    )
    cluster_queue_max_wait_s: float = Field(
        60.0,
        ge=0,
        description="Bound on the cluster-queue wait of a class without a TTFT target (batch): a queued "
        "request that waited three quarters of it gets the next free slot before any other (the last "
        "quarter is the wait for a slot to free); while the class's queued requests already wait half of it "
        "(its oldest, or its backlog at its recent grant rate), new ones are refused at once (429 with "
        "Retry-After) instead of queueing for minutes. 0 turns the bound off (aging alone).",
    )
    cold_shed_window_s: float = Field(
        1.0,
        ge=0,
        description="While a class sheds load (one of its requests was refused for its TTFT target, or for "
        "cluster_queue_max_wait_s, within this many seconds), its requests whose adapter no replica holds "
        "are refused first (429): they "
        "would cost a load and an adapter slot. Not the most urgent class. 0 turns this trigger off "
        "(cold_shed_pressure is the other one).",
    )
    cold_shed_pressure: float = Field(
        0.75,
        ge=0,
        le=1,
        description="A class also sheds load (its requests whose adapter no replica holds are refused first, "
        "429) while a request of it parked now would wait more than this share of its TTFT target (a class "
        "without one: of half of cluster_queue_max_wait_s), by the cluster queue's prediction: the queue "
        "stands near the target between refusals too. Not the most urgent class. 0 turns it off.",
    )
    preempt_after_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An urgent queued request that has waited this fraction of its class's TTFT "
        "target is sent to the replica with the most less-urgent work, which preempts some of it.",
    )
    top_class_preempt_after_fraction: float | None = Field(
        0.0, ge=0, le=1, description="preempt_after_fraction of the most urgent SLA class (null: "
        "preempt_after_fraction): by default its queued requests preempt less urgent work as soon as no "
        "replica has room, since the engine's own prefill under load takes much of a 1 s TTFT target."
    )
    controller_report_period_s: float = Field(
        0.5, gt=0, description="How often each replica reports its memory, adapters and queues."
    )
    controller_report_coalesce_s: float = Field(
        0.2,
        ge=0,
        le=10,
        description="A replica whose request ends while requests wait in the cluster queue reports at "
        "once, unless it reported less than this many seconds ago: then at the end of that window, one "
        "report for every request that ended within it: a busy replica reports at most once per window "
        "(5 times a second at 0.2). Shorter frees slots to the queue sooner, for more reports (docs/scale.md"
        "#reports-that-scale: 0.02 completed 3-4% more requests at 2x load in the simulator, at 8 reports "
        "a second per replica).",
    )
    controller_batch_window_s: float = Field(
        0.0,
        ge=0,
        le=0.1,
        description="The cluster controller takes its parked requests and replica reports in batches: one "
        "dispatch of its queue and one update of each ingress's claims per batch, not per call. 0: a "
        "batch is what reached it within one turn of its event loop (while it was busy), with no added "
        "wait. A positive window also holds them this many seconds (a parked request, or a slot a report "
        "frees, waits that much longer for its grant): in the simulator, 0.002 cut the controller's CPU "
        "by a fifth to a third at 256 replicas and 2x load, but cost 1-2 points of hit rate at 32 replicas "
        "(docs/scale.md#batch-windows).",
    )
    placement_hot_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Placement: an adapter is spread over one more replica each time its load "
        "(request rate x service time) exceeds this share of one replica's batch slots.",
    )

    sla_classes: list[SlaClassConfig] = Field(
        default_factory=lambda: list(DEFAULT_SLA_CLASSES),
        description="SLA classes a request can ask for (header `x-lora-priority: <name>`, or vLLM's "
        "integer `priority` field): name, priority (lower = more urgent), ttft_s and tpot_s targets "
        "(null = none). 1 to 16 classes, unique names. Environment: a JSON list. Default: interactive "
        "(0, 1 s, 0.2 s), standard (1, 5 s, 0.5 s), batch (2, no targets).",
    )
    default_priority_class: str = Field(
        DEFAULT_CLASS, description="The class of a request that names none (one of `sla_classes`)."
    )

    # ----- observability and autoscaling -----
    metrics_max_adapter_labels: int = Field(
        50, ge=0, le=10_000,
        description="Adapters that keep their own `adapter` label in the request metrics: the busiest "
        "ones over the last metrics_label_window_s; every other adapter is counted as adapter=\"other\" "
        "(bounded Prometheus cardinality; 0 = all \"other\").",
    )
    metrics_max_tenant_labels: int = Field(
        50, ge=0, le=10_000,
        description="Tenants that keep their own `tenant` label (the busiest ones, as for adapters); "
        "the others are tenant=\"other\".",
    )
    metrics_label_window_s: float = Field(
        300.0, gt=0, description="Window over which the busiest adapters and tenants are re-ranked."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling of the LoRA replicas (Ray's `autoscaling_config`: "
        "target_ongoing_requests, min_replicas, max_replicas, upscale_delay_s, downscale_delay_s, ...); "
        "when set, it replaces num_replicas. Environment: a JSON object. Default: a fixed num_replicas.",
        examples=[{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 24,
                   "upscale_delay_s": 30, "downscale_delay_s": 600}],
    )

    # ----- operator tooling: log lines -----
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Format of lora-cluster's log lines in the ingress and replicas: text, or json (one "
        "object per line: ts, level, logger, message, request_id). Every line of a request carries its "
        "`x-request-id`.",
    )
    internal_access_log: bool = Field(
        False,
        description="Ray Serve's access line (`CALL <method> OK <ms>`) for every call between lora-cluster's "
        "own deployments: the ingress's calls to the LoRA replicas and the cluster controller, the replicas' "
        "reports, the registry, quota ledger and metrics hub (one to three lines per request). Off: on the "
        "demo server they cost 5% of the server's CPU per request (docs/soak.md, \"Serve's access lines\"), "
        "and lora-cluster's metrics count those calls. The ingress's HTTP access line (method, path, "
        "status, latency) is not one of them and follows the application's `logging_config` as before. "
        "These deployments get `logging_config: {enable_access_log: <this>}` from the application; "
        "serve_config.yaml's per-deployment `logging_config` still overrides it (log level, encoding).",
    )

    # ----- overload protection: the ingress's routing-error breaker -----
    breaker_routing_warn: float = Field(
        0.01, gt=0, le=1, description="Share of routing errors (a replica died, was unreachable or "
        "ended a stream without output) among the last 100 requests at which the ingress warns."
    )
    breaker_routing_trip: float = Field(
        0.03, gt=0, le=1, description="Share at which the ingress's routing-error breaker opens: new "
        "requests are answered 503 with Retry-After (the cool-down left) instead of being sent."
    )
    breaker_routing_recover_requests: int = Field(
        100, ge=1, description="Probe requests in a row without a routing error that close it."
    )

    # ----- replica groups -----
    replica_groups: list[ReplicaGroupConfig] = Field(
        default_factory=list,
        description="Named groups of LoRA replicas, each its own deployment with its own num_replicas, "
        "num_cpus/num_gpus/resources and node_labels, serving the adapters (glob patterns) and "
        "tenants it lists: a request goes to the first group (in this order) matching its adapter "
        "or tenant, else to the first group listing neither (catch-all), else it is a 404. Empty "
        "(the default): one group of num_replicas replicas serving everything. Environment: a JSON list.",
        examples=[[{"name": "finance", "num_replicas": 2, "num_cpus": 4, "num_gpus": 1,
                    "node_labels": {"lora-group": "finance"}, "adapters": ["fin-*"], "tenants": ["finance"]},
                   {"name": "service", "num_replicas": 2}]],
    )

    # ----- tenants, API keys, quotas and input limits -----
    tenants_file: str | None = Field(
        None,
        description="YAML file of tenants (API key hashes, adapter patterns, SLA class, quotas) and admin "
        "keys; re-read when it changes (once the file has settled: a file caught mid-write is never "
        "taken). None: no keys, every route is open (local quickstart).",
    )
    tenants_reload_period_s: float = Field(
        2.0, gt=0, description="How often the ingress looks for a changed tenants file (in a thread)."
    )
    open_routes: list[str] = Field(
        default_factory=lambda: ["/health"],
        description="Routes (path templates, e.g. /health) answered without an API key while a tenants "
        "file is in force. Default: /health only (probes), safe behind a public ingress. Every other "
        "route needs a key: /openapi.json, /docs and /redoc any known key, /metrics an admin key (its "
        "`adapter` and `tenant` labels name every tenant's adapters). List one here only when the "
        "port is not public. A name that is not a route of the API stops the ingress from starting. "
        "Without a tenants file every route is open. Environment: a JSON list.",
    )
    quota_lease_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Each ingress takes a tenant's quota from the shared ledger in leases of this many "
        "seconds of its rates and gives back the unused part after as long (see docs/serving.md).",
    )
    quota_ticket_ttl_s: float = Field(
        900.0,
        gt=0,
        description="Concurrency slots of a tenant held by an ingress that has not given back to the "
        "quota ledger for this long are released (the ingress died, or keeps taking without settling).",
    )
    max_body_bytes: ByteSize = Field(
        1 << 20, ge=1024, description="Largest request body in bytes (above: 400 body_too_large). Accepts "
        "suffixes: 1MiB."
    )
    max_json_depth: int = Field(
        32, ge=2, le=1000, description="Deepest nesting of arrays and objects in a JSON body (above: 400 "
        "json_too_deep)."
    )
    max_stop_sequences: int = Field(
        4, ge=0, le=256, description="Most stop strings one request may give (as OpenAI; 400 above)."
    )
    max_stop_length: int = Field(
        256, ge=1, description="Longest stop string in characters (400 above)."
    )
    max_prompts: int = Field(
        16, ge=1, le=4096, description="Most prompts in one /v1/completions request (400 above)."
    )
    max_chat_messages: int = Field(
        2048, ge=1, le=65536, description="Most messages in one /v1/chat/completions request (400 above). "
        "Default: OpenAI's limit of 2048; a conversation's tokens are bounded by max_prompt_tokens."
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="How chat answers with `tool_choice: auto` are read for tool calls (vLLM's "
        "names): hermes (`<tool_call>{...}</tool_call>`), llama3_json (`{\"name\", \"parameters\"}` "
        "objects, optionally after `<|python_tag|>`), or auto: from the base model's chat template "
        "(hermes when it writes `<tool_call>`, llama3_json when it writes `<|python_tag|>` or "
        "`\"parameters\"`, else hermes)."
    )

    @field_validator("open_routes")
    @classmethod
    def _open_routes_are_paths(cls, value: list[str]) -> list[str]:
        bad = [route for route in value if not route.startswith("/")]
        if bad:
            raise ValueError(f"open_routes lists {bad[0]!r}, which is not a path (it starts with '/')")
        return value

    @model_validator(mode="after")
    def _adapter_wait_bounds_from_classes(self) -> ServeConfig:
        """Adapter rotation's fairness bounds follow the SLA classes unless set explicitly."""
        if "adapter_wait_bounds_s" not in self.model_fields_set:
            self.adapter_wait_bounds_s = {c.priority: c.ttft_s * self.adapter_wait_fraction
                                          for c in self.sla_classes if c.ttft_s is not None}
        return self

    @model_validator(mode="after")
    def _replica_groups_consistent(self) -> ServeConfig:
        names = [g.name for g in self.replica_groups]
        if len(names) > MAX_REPLICA_GROUPS:
            raise ValueError(f"replica_groups lists {len(names)} groups; at most {MAX_REPLICA_GROUPS}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"replica_groups names must be unique; repeated: {', '.join(duplicates)}")
        top = self.served_model_name or self.model
        models: dict[str, str] = {}  # a base's API name -> its model: one model per name
        for g in self.replica_groups:
            model = g.model or self.model
            name = g.served_model_name or (top if model == self.model else model)
            if models.setdefault(name, model) != model:
                raise ValueError(f"replica_groups: group {g.name!r} serves another base model under the name "
                                 f"{name!r}; give each base its own served_model_name")
        return self

    @model_validator(mode="after")
    def _serve_consistent(self) -> ServeConfig:
        if self.default_max_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} must be <= "
                f"max_new_tokens={self.max_new_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _sla_classes_consistent(self) -> ServeConfig:
        names = [c.name for c in self.sla_classes]
        if not 1 <= len(names) <= MAX_CLASSES:
            raise ValueError(f"sla_classes must list between 1 and {MAX_CLASSES} classes, got {len(names)}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"sla_classes names must be unique; repeated: {', '.join(duplicates)}")
        if self.default_priority_class not in names:
            raise ValueError(
                f"default_priority_class={self.default_priority_class!r} is not one of sla_classes "
                f"({', '.join(names)})"
            )
        return self



def serve_defaults() -> ServeConfig:
    """Every field of `ServeConfig` at its default, typed: what the simulator and the router read so
    that they run what a user gets. Neither the environment nor serve_config.yaml is read, and no
    validator runs (`adapter_wait_bounds_s` stays empty; serving derives it from the SLA classes)."""
    return ServeConfig.model_construct()


def load_config(args: dict[str, Any] | None) -> ServeConfig:
    """The `ServeConfig` of a Serve application's args, with `LORA_CLUSTER_*` overrides from the
    environment; raises `ConfigError` naming the field."""
    return build_config(ServeConfig, **(args or {}))

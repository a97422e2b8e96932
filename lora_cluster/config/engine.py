"""The one typed configuration of lora-cluster.

Every field documents itself, is validated when the config is built, and can be overridden by an
environment variable `LORA_CLUSTER_<FIELD>` (for example `LORA_CLUSTER_MAX_LORAS=16`). Explicit
arguments (Python keyword arguments, serve_config.yaml application args) win over the environment,
which wins over the defaults. List fields accept a comma-separated string in the environment.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from lora_cluster.cluster.sla import DEFAULT_CLASS, DEFAULT_SLA_CLASSES, MAX_CLASSES, SlaClass, SlaClasses
from lora_cluster.errors import ConfigError


def _split_list(value: object) -> object:
    """Accept `"a,b"` as well as `["a", "b"]` for list fields."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


StrList = Annotated[list[str], NoDecode]

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def _parse_bytes(value: object) -> object:
    """Accept `"4GiB"`, `"500MB"`, `"1024"` as well as integers for byte budgets."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace("_", "").replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number) :]
    try:
        return int(float(number) * _BYTE_UNITS[unit])
    except (ValueError, KeyError):
        return value  # let pydantic report it


class EngineConfig(BaseSettings):
    """Configuration of one engine (one replica): model, adapter slots, batching and cache tiers."""

    model_config = SettingsConfigDict(env_prefix="LORA_CLUSTER_", extra="forbid", validate_default=True)

    model: str = Field(description="Base model: a local folder or a Hugging Face hub id.")
    adapter_source: StrList = Field(
        default_factory=list,
        description="Where adapters come from, first match wins: folders, file://, s3://bucket/prefix, "
        "hf://org/name[@rev]. An adapter id names a sub-folder (or key prefix) of a source.",
    )
    max_loras: int = Field(8, ge=1, le=4096, description="Adapter slots on the device, allocated at start.")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest adapter rank the slots can hold.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    device: str = Field("auto", description="torch device; auto = cuda when available, else cpu.")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Sequences decoded together (KV cache slots).")
    max_model_len: int = Field(
        2048, ge=16, description="Longest sequence (prompt + output) in tokens; capped by the model's own."
    )
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one engine step (prefill chunks plus decodes)."
    )
    max_waiting: int = Field(
        4096, ge=1, description="Requests that may wait for a slot; more are refused as overloaded."
    )
    kernel: Literal["auto", "reference", "cpu", "triton"] = Field(
        "auto", description="LoRA kernel implementation; auto = triton on CUDA, cpu otherwise."
    )
    adapter_load_workers: int = Field(
        2, ge=1, le=64, description="Threads that load adapters off the step loop."
    )
    max_consecutive_step_failures: int = Field(
        3,
        ge=1,
        description="Engine steps in a row that may fail (their requests end with an error) before the "
        "engine reports itself unhealthy, so that Ray Serve restarts the replica.",
    )

    # ----- SLA classes in the engine's steps (engine.prefill_plan; issue 8) -----
    less_urgent_prefill_chunk: int | None = Field(
        None, ge=1, description="Prefill tokens that sequences less urgent than priority 0 (the interactive "
        "class) may take in one engine step in all: an urgent request that arrives during a step waits for "
        "a short one, at the cost of slower prefills of long prompts (like vLLM's "
        "long_prefill_token_threshold). null (default): only max_num_batched_tokens bounds them."
    )

    # ----- paged KV cache, memory sizing, LoRA fast paths (engine.kv_cache, memory_plan; issue 12) -----
    kv_block_size: int = Field(
        16, ge=1, le=256, description="Tokens per KV cache block (a power of two); sequences take "
        "blocks as they grow instead of a max_model_len reservation."
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV cache blocks. Default: on a GPU, what gpu_memory_utilization leaves "
        "after the base model, the adapter pool and the buffer; on CPU, max_num_seqs full-length sequences. "
        "Set on a GPU, the blocks and the pool need only fit in the memory free there (several engines, "
        "or an engine beside other work, can then share one device)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU's total memory this engine may use (base model, "
        "adapter pool, buffer and KV cache together)."
    )
    adapter_pool_share: float = Field(
        0.3, gt=0, lt=1, description="Most of that budget the adapter slots may take (seed 001's 60/30/10 "
        "split of base, adapter pool and buffer); on a GPU max_loras is lowered to what fits."
    )
    memory_buffer_share: float = Field(
        0.1, ge=0, lt=1, description="Share of that budget kept free for activations and allocator slack."
    )
    lora_decode_kernel: Literal["auto", "sgmv", "bgmv"] = Field(
        "auto", description="LoRA of decode tokens: bgmv = gathered per-token weights, sgmv = one matmul "
        "per adapter segment, auto = bgmv when decode segments are short (many distinct adapters)."
    )
    lora_fused_shrink: bool | None = Field(
        None, description="One LoRA shrink for q/k/v and one for gate/up over stacked A weights. Default: "
        "on with the Triton kernels (fewer launches), off with the CPU ops (measured 3-5% faster there)."
    )
    lora_cpu_native: bool = Field(
        True, description="With the CPU ops, build (once, ~30 s, cached by torch under TORCH_EXTENSIONS_DIR) "
        "and use a C++ kernel for decode-like LoRA batches (each token's adapter weights read in place); "
        "without a C++ compiler the engine logs why and keeps the torch ops. Results are the same."
    )

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {value}")
        return value

    # ----- adapter store and cache tiers (lora_cluster.store, docs/adapter-store.md) -----
    adapter_store: Literal["tiered", "folder"] = Field(
        "tiered",
        description="tiered = the adapter store (folder/s3/hf sources, host and disk caches, "
        "checksums, encryption); folder = the plain local-folder loader, no caching.",
    )
    host_cache_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Byte budget of validated adapter weights kept in host RAM "
        "(0 = no host tier). Accepts suffixes: 512MiB, 4GiB, 1GB.",
    )
    host_int8: bool = Field(
        False,
        description="Keep host copies as per-channel int8 (about 1/4 of the bytes, small error); the "
        "device always gets float weights.",
    )
    host_pin_memory: bool = Field(
        True,
        description="On CUDA, keep host copies in pinned (page-locked) memory for fast copies to the device.",
    )
    disk_cache_dir: str | None = Field(
        None,
        description="Folder of the local-disk tier for remote (s3://) adapters; survives restarts. "
        "Default: $XDG_CACHE_HOME/lora-cluster/adapters (~/.cache/...).",
    )
    disk_cache_bytes: int = Field(
        20 << 30,
        ge=0,
        description="Byte budget of the disk tier (0 = downloads are used once and deleted). "
        "Accepts suffixes.",
    )
    pinned: StrList = Field(
        default_factory=list,
        description="Adapter ids loaded at start and never evicted from any tier "
        "(device, host, disk); fewer than max_loras.",
    )
    preload: StrList = Field(
        default_factory=list, description="Adapter ids loaded into host memory in the background at start."
    )
    negative_cache_ttl_s: float = Field(
        5.0,
        ge=0,
        description="Seconds an adapter id that no source offers is answered 'not found' without asking "
        "the sources again (a bounded cache; registering the id clears it; 0 = off).",
    )
    prefetch_window_s: float = Field(
        60.0,
        gt=0,
        description="Sliding window (seconds) of request counts used by the eviction priority "
        "(0.7*frequency + 0.3*recency) and by hot-adapter promotion.",
    )
    prefetch_min_requests: int = Field(
        4,
        ge=0,
        description="Requests within the window that make an adapter hot: a hot adapter on the "
        "device gets its host copy back in the background (0 = no promotion).",
    )
    fetch_retries: int = Field(
        3, ge=0, le=20, description="Retries of a transient source error (network, 5xx)."
    )
    fetch_backoff_s: float = Field(
        0.5, ge=0, description="First retry delay; doubles on each retry, with jitter."
    )
    fetch_timeout_s: float = Field(60.0, gt=0, description="Connect and read timeout of one S3 request.")
    encryption_key_env: str = Field(
        "LORA_CLUSTER_ADAPTER_KEY",
        description="Name of the environment variable holding the AES-256 key of "
        "encrypted adapters (64 hex digits or base64).",
    )
    encryption_key_file: str | None = Field(
        None, description="File holding the AES-256 key (a mounted secret); wins over encryption_key_env."
    )
    require_encryption: bool = Field(False, description="Refuse adapters whose weights are not encrypted.")
    require_checksum: bool = Field(
        False,
        description="Refuse adapters whose weights have no declared sha256 (checksums.sha256, a "
        ".sha256 sidecar or S3 metadata).",
    )
    base_model_check: Literal["off", "warn", "strict"] = Field(
        "warn",
        description="Compare an adapter's base_model_name_or_path with the served model: warn logs a "
        "mismatch, strict refuses the adapter (shapes are always checked).",
    )

    # ----- log probabilities and merged adapters (engine.logprobs, store.merge; issue 12) -----
    max_logprobs: int = Field(
        20, ge=0, le=1024,
        description="Most alternatives per token a request may ask for (OpenAI `logprobs` / `top_logprobs`, "
        "LoRAX `return_k_alternatives`, prompt logprobs); more is refused with 400. OpenAI allows 0-20.",
    )
    max_merged_adapter_ids: int = Field(
        8, ge=1, le=64,
        description="Most adapters one request may merge (`merged_adapters.ids`); more is refused with 400.",
    )
    max_merged_adapters: int = Field(
        256, ge=1, le=65536,
        description="Merge recipes one replica remembers (least recently used dropped first, never one "
        "that a queued or running request uses); the merged weights themselves live in the host and "
        "device tiers under their byte and slot budgets.",
    )
    merge_seed: int = Field(
        0, ge=0, lt=2**63,
        description="Seed of the random pruning of dare_linear and dare_ties merges: the same request "
        "gives the same merged adapter on every replica and after restarts.",
    )

    # ----- overload protection: circuit breakers (lora_cluster.breaker, docs/serving.md#breakers) -----
    breakers: bool = Field(
        True, description="Run overload protection: the adapter protection that chooses without idling "
        "(victims by recent demand, one-off cold loads behind repeated ones, the thrash miss penalty the "
        "router weighs) with seed 001's switch-rate and load-latency alerts, and the adapter-source and "
        "routing-error breakers; false turns every one of them off (plain LRU placement)."
    )
    breaker_switch_warn_per_s: float = Field(
        3.0, gt=0, description="Adapter switches (adapters placed into a device slot that held another) "
        "per second on one replica at which its switch-rate alert warns (an alert only: work goes on)."
    )
    breaker_switch_trip_per_s: float = Field(
        5.0, gt=0, description="Switches per second at which the switch-rate alert turns critical (state "
        "open in metrics and logs). An alert only: cold adapters are still placed; thrash is judged by its "
        "measured cost (docs/serving.md#adapter-protection)."
    )
    breaker_switch_recover_per_s: float = Field(
        2.0, gt=0, description="Switch rate below which the switch-rate alert clears, once it held "
        "breaker_switch_recover_s seconds."
    )
    breaker_switch_recover_s: float = Field(
        30.0, ge=0, description="How long the switch rate must stay below breaker_switch_recover_per_s."
    )
    breaker_switch_window_s: float = Field(
        1.0, gt=0, description="Window over which the switch rate is measured."
    )
    breaker_load_warn_ms: float = Field(
        50.0, gt=0, description="Latency of placing one adapter's weights into a device slot at which "
        "the replica's load-latency alert warns (an alert only: work goes on)."
    )
    breaker_load_trip_ms: float = Field(
        100.0, gt=0, description="Load latency at which the load-latency alert turns critical (state open) "
        "until loads after the cool-down are fast again. An alert only: cold adapters are still placed."
    )
    breaker_load_recover_ms: float = Field(
        30.0, gt=0, description="Load latency below which a load counts towards clearing the load alert."
    )
    breaker_load_recover_loads: int = Field(
        10, ge=1, description="Fast loads in a row (after the cool-down) that clear the load-latency alert."
    )
    breaker_source_failures: int = Field(
        3, ge=1, description="Failed fetches in a row (network, 5xx, timeouts; not a missing adapter) "
        "after which an adapter source's breaker opens: cold loads from it fail at once with 503 "
        "naming the source, adapters already cached keep serving."
    )
    breaker_source_cooldown_s: float = Field(
        10.0, ge=0, description="How long a source's breaker stays open before one probe load may try it."
    )
    breaker_cooldown_s: float = Field(
        5.0, ge=0, description="How long the routing-error breaker stays open before it probes (half-open), "
        "and the switch-rate and load-latency alerts stay critical before they may clear."
    )

    # ----- adapter rotation and prefetch (lora_cluster.engine.adapters.rotation, issue 12 part 1) -----
    adapter_min_steps: int = Field(
        8, ge=1, description="No thrash: an adapter placed into a device slot runs at least this many "
        "engine steps before rotation may hand its slot to another adapter."
    )
    adapter_wait_bounds_s: dict[int, float] = Field(
        default_factory=dict,
        description="Fairness bound per priority: seconds a request may wait for its adapter to get a "
        "device slot before a resident adapter is drained for it. Serving fills it from the SLA classes "
        "(adapter_wait_fraction of each class's ttft_s) unless set. Priorities not listed use "
        "adapter_max_wait_s.",
    )
    adapter_wait_fraction: float = Field(
        0.5, gt=0, le=1, description="Share of an SLA class's ttft_s that its requests may wait for an "
        "adapter slot (the fairness bound of adapter rotation)."
    )
    adapter_max_wait_s: float = Field(
        10.0, gt=0, description="Fairness bound of priorities without an entry in adapter_wait_bounds_s."
    )
    adapter_prefetch_depth: int = Field(
        4, ge=0, description="Next adapters of the waiting queue (urgency order) copied into free device "
        "slots while the current batch runs."
    )
    adapter_async_copy_bytes: int = Field(
        1 << 20, ge=0, description="Adapters of at least this many bytes are copied into their device slot "
        "off the step thread (CUDA: a side stream), overlapping the forward pass; smaller ones are "
        "copied inline. Accepts suffixes."
    )

    @field_validator("adapter_async_copy_bytes", mode="before")
    @classmethod
    def _copy_bytes(cls, value: object) -> object:
        return _parse_bytes(value)

    @field_validator("pinned", "preload", mode="before")
    @classmethod
    def _adapter_lists(cls, value: object) -> object:
        return _split_list(value)

    @field_validator("host_cache_bytes", "disk_cache_bytes", mode="before")
    @classmethod
    def _byte_sizes(cls, value: object) -> object:
        return _parse_bytes(value)

    @model_validator(mode="after")
    def _pinned_fit(self) -> EngineConfig:
        if len(set(self.pinned)) >= self.max_loras:
            raise ValueError(
                f"{len(set(self.pinned))} pinned adapters need fewer than "
                f"max_loras={self.max_loras} slots (one slot must stay free for the others)"
            )
        return self

    @field_validator("adapter_source", mode="before")
    @classmethod
    def _sources(cls, value: object) -> object:
        return _split_list(value)

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes one token per step)"
            )
        return self


def build_config(cls: type[BaseSettings], **kwargs: object) -> BaseSettings:
    """Build a config, turning pydantic's validation error into a `ConfigError` naming the fields."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"invalid {cls.__name__}: {e}") from e


def _default_demo_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lora-cluster", "demo-zoo")


class SlaClassConfig(BaseModel):
    """One SLA class of `ServeConfig.sla_classes` (see `lora_cluster.cluster.sla`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="What clients send in `x-lora-priority` and get back in `x-lora-priority-class`: "
        "1-64 letters, digits, `_`, `.` or `-`.",
    )
    priority: int = Field(description="Lower is more urgent (vLLM's convention); the engine orders by it.")
    ttft_s: float | None = Field(None, gt=0, description="Time-to-first-token target (None: no target).")
    tpot_s: float | None = Field(None, gt=0, description="Time-per-output-token target (None: no target).")

    def sla_class(self) -> SlaClass:
        return SlaClass(self.name, self.priority, ttft_s=self.ttft_s, tpot_s=self.tpot_s)


def _default_sla_classes() -> list[SlaClassConfig]:
    return [SlaClassConfig(name=c.name, priority=c.priority, ttft_s=c.ttft_s, tpot_s=c.tpot_s)
            for c in DEFAULT_SLA_CLASSES]


# ----- replica groups (issue 10 part 6, lora_cluster.serve.replica_groups) -----
MAX_REPLICA_GROUPS = 16
MAX_GROUP_PATTERNS = 256


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


class ServeConfig(EngineConfig):
    """Configuration of the Ray Serve application: every engine field plus replicas, resources and limits.

    These are the application `args` of serve_config.yaml (`lora_cluster.serve.app:build_app`); each one
    is also read from `LORA_CLUSTER_<FIELD>`. Every replica builds its engine from this same config.
    """

    model: str = Field(
        "demo",
        description="Base model: a local folder, a Hugging Face hub id, or `demo` = the built-in demo zoo "
        "(a tiny random-weight Llama model and its adapters, built into `demo_dir` on first use).",
    )
    demo_dir: str = Field(default_factory=_default_demo_dir, description="Cache folder of the demo zoo.")
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
    ingress_num_replicas: int = Field(1, ge=1, description="Replicas of the HTTP ingress (API, router).")
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs reserved per ingress replica.")
    ingress_max_ongoing_requests: int = Field(4096, ge=1, description="Requests one ingress replica accepts.")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens; longer ones are refused (400). Default: the "
        "engine's limit, max_model_len - 1.",
    )
    max_new_tokens: int = Field(
        1024, ge=1, description="Largest max_tokens / max_new_tokens a request may ask for (400 above)."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="max_new_tokens of chat and LoRAX requests that give none (completions: 16)."
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per prompt) of OpenAI requests.")
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
    controller: bool = Field(
        True,
        description="Run the cluster controller: the cluster-wide priority queue, cross-replica "
        "preemption and adapter placement. Off: requests wait in Ray Serve's own queue (FIFO).",
    )
    admission_capacity: int | None = Field(
        None,
        ge=1,
        description="Requests one replica is given at once before the ingress parks further ones in "
        "the cluster queue (default: max_num_seqs, the replica's batch slots).",
    )
    cluster_queue_size: int = Field(
        4096, ge=1, description="Requests the cluster queue holds; more are refused with 429."
    )
    cluster_queue_aging_s: float = Field(
        10.0,
        gt=0,
        description="Aging of the cluster queue: a waiting request gains one priority level per "
        "this many seconds, so no class starves.",
    )
    cluster_queue_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait in the cluster queue before a request is refused (503)."
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
        "would cost a load and an adapter slot. Not the most urgent class. 0 turns it off.",
    )
    preempt_after_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An urgent queued request that has waited this fraction of its class's TTFT "
        "target is sent to the replica with the most less-urgent work, which preempts some of it.",
    )
    # the most urgent class preempts at once (issue 8's interactive target; cluster.controller)
    top_class_preempt_after_fraction: float | None = Field(
        0.0, ge=0, le=1, description="preempt_after_fraction of the most urgent SLA class (null: "
        "preempt_after_fraction): by default its queued requests preempt less urgent work as soon as no "
        "replica has room, since the engine's own prefill under load takes much of a 1 s TTFT target."
    )
    controller_report_period_s: float = Field(
        0.5, gt=0, description="How often each replica reports its memory, adapters and queues."
    )
    placement_hot_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Placement: an adapter is spread over one more replica each time its load "
        "(request rate x service time) exceeds this share of one replica's batch slots.",
    )

    sla_classes: list[SlaClassConfig] = Field(
        default_factory=_default_sla_classes,
        description="SLA classes a request can ask for (header `x-lora-priority: <name>`, or vLLM's "
        "integer `priority` field): name, priority (lower = more urgent), ttft_s and tpot_s targets "
        "(null = none). 1 to 16 classes, unique names. Environment: a JSON list. Default: interactive "
        "(0, 1 s, 0.2 s), standard (1, 5 s, 0.5 s), batch (2, no targets).",
    )
    default_priority_class: str = Field(
        DEFAULT_CLASS, description="The class of a request that names none (one of `sla_classes`)."
    )

    # ----- observability and autoscaling (issue 11: lora_cluster.serve.ops.metrics, serve.ops.top_labels, app) -----
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
    )

    # ----- operator tooling: log lines (lora_cluster.serve.ops.logs) -----
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Format of lora-cluster's log lines in the ingress and replicas: text, or json (one "
        "object per line: ts, level, logger, message, request_id). Every line of a request carries its "
        "`x-request-id`.",
    )

    # ----- overload protection: the routing-error breaker (lora_cluster.serve.guard) -----
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

    # ----- replica groups (issue 10 part 6, lora_cluster.serve.replica_groups) -----
    replica_groups: list[ReplicaGroupConfig] = Field(
        default_factory=list,
        description="Named groups of LoRA replicas, each its own deployment with its own num_replicas, "
        "num_cpus/num_gpus/resources and node_labels, serving the adapters (glob patterns) and "
        "tenants it lists: a request goes to the first group (in this order) matching its adapter "
        "or tenant, else to the first group listing neither (catch-all), else it is a 404. Empty "
        "(the default): one group of num_replicas replicas serving everything. Environment: a JSON list.",
    )

    # ----- tenants, API keys, quotas and input limits (issue 10 parts 1, 2, 4, 5: lora_cluster.tenancy,
    # serve/auth.py, serve/quotas.py, serve/body_limits.py) -----
    tenants_file: str | None = Field(
        None,
        description="YAML file of tenants (API key hashes, adapter patterns, SLA class, quotas) and admin "
        "keys; re-read when it changes. None: no keys, every route is open (local quickstart).",
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
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body in bytes (400 above). Accepts suffixes: 1MiB."
    )
    max_json_depth: int = Field(
        32, ge=2, le=1000, description="Deepest nesting of arrays and objects in a JSON body (400 above)."
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

    @field_validator("open_routes")
    @classmethod
    def _open_routes_are_paths(cls, value: list[str]) -> list[str]:
        bad = [route for route in value if not route.startswith("/")]
        if bad:
            raise ValueError(f"open_routes lists {bad[0]!r}, which is not a path (it starts with '/')")
        return value

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _body_bytes(cls, value: object) -> object:
        return _parse_bytes(value)

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


def build_sla_classes(config: ServeConfig) -> SlaClasses:
    """The `SlaClasses` of a ServeConfig: its `sla_classes`, defaulting to `default_priority_class`."""
    return SlaClasses((c.sla_class() for c in config.sla_classes), default=config.default_priority_class)

"""The configuration of one engine (one replica): model, adapter slots, batching, KV cache, the
adapter store's tiers, overload protection and adapter rotation. `ServeConfig` (config.serve) adds the
serving fields; how values are read (environment, byte sizes) is config.parsing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from lora_cluster.config.parsing import SETTINGS, ByteSize, StrList


def default_disk_cache_dir() -> Path:
    """The disk tier's folder when `disk_cache_dir` is unset: $XDG_CACHE_HOME/lora-cluster/adapters."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-cluster" / "adapters"


class EngineConfig(BaseSettings):
    """Configuration of one engine (one replica): model, adapter slots, batching and cache tiers."""

    model_config = SETTINGS

    model: str = Field(
        description="Base model (a dense family of docs/model_families.md: Llama, Mistral, Qwen2/3, Gemma "
        "2/3, Phi-3/4, Granite, OLMo 2, SmolLM3): a local folder or a Hugging Face hub id."
    )
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
        "auto", description="LoRA kernel implementation; auto = triton on CUDA, cpu otherwise (reference: "
        "plain torch, for debugging)."
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

    # ----- SLA classes in the engine's steps (replica_policy.prefill_plan) -----
    less_urgent_prefill_chunk: int | None = Field(
        None, ge=1, description="Prefill tokens that sequences less urgent than priority 0 (the interactive "
        "class) may take in one engine step in all: an urgent request that arrives during a step waits for "
        "a short one, at the cost of slower prefills of long prompts (like vLLM's "
        "long_prefill_token_threshold). A step with a priority-0 prefill carries no other prefill whatever "
        "this is. null (default): only max_num_batched_tokens bounds them."
    )
    preempt_patience: float = Field(
        0.25, ge=0, le=1, description="Share of its SLA class's TTFT target that a waiting request waits in "
        "the engine, from its arrival there, before it preempts less urgent running work (which then "
        "recomputes): a batch slot usually frees sooner, and preempting at once throws work away for "
        "nothing (simulator, 32 nodes at 0.9x load: 10,586 engine preemptions a minute at 0, 50 at 0.25; "
        "capacity at SLO up by 0.09-0.21x, docs/scale.md). A class without a TTFT target, or 0, preempts "
        "at once (vLLM's behaviour). Read by the replica, which passes each request's patience to the engine."
    )

    # ----- paged KV cache, memory sizing, LoRA fast paths (engine.schedule.kv_cache, model.memory_plan) -----
    kv_block_size: int = Field(
        16, ge=1, le=256, description="Tokens per KV cache block (a power of two); sequences take "
        "blocks as they grow instead of a max_model_len reservation."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of a prompt prefix already computed with the same adapter at "
        "the same version (a system prompt, few-shot examples, earlier chat turns): a request prefills only "
        "the rest. Full blocks only; a reloaded adapter never reuses its old version's blocks; idle cached "
        "blocks are evicted (least recently used) before any running request is preempted. Requests asking "
        "for prompt logprobs compute their whole prompt."
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
        "without a C++ compiler the engine logs why and keeps the torch ops. Results are the same. A start "
        "waits for another process's build (at most 10 min), and a build killed half-way (a server stopped "
        "during its first start) does not hang the next start."
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
    host_cache_bytes: ByteSize = Field(
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
    disk_cache_bytes: ByteSize = Field(
        20 << 30,
        ge=0,
        description="Byte budget of the disk tier (0 = downloads are used once and deleted). "
        "Accepts suffixes.",
    )
    cluster_tier_bytes: ByteSize = Field(
        8 << 30,
        ge=0,
        description="Byte budget of the cluster tier, cluster-wide: an adapter one node downloaded "
        "from a remote source (s3://, hf://) is published once to Ray's object store (its stored "
        "files, checksummed) and other nodes copy it node to node instead of downloading it "
        "(0 = off; only under Ray Serve). Accepts suffixes.",
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
    prefetch_bytes_per_s: ByteSize = Field(
        100 << 20,
        ge=0,
        description="Demand prefetch (with a cluster controller): bytes per second each replica may "
        "fetch into its host tier ahead of requests, for the adapters of most recent demand in the "
        "cluster (the controller's hot list); paused while a request's adapter load waits or runs "
        "(0 = off). Accepts suffixes.",
    )
    prefetch_max_bytes: ByteSize = Field(
        2 << 30,
        ge=0,
        description="Demand prefetch fills the host tier up to this many bytes (at most "
        "host_cache_bytes) and never evicts anything to do so (0 = off). Default: half the default "
        "host_cache_bytes. Accepts suffixes.",
    )
    prefetch_hot_period_s: float = Field(
        10.0,
        gt=0,
        description="How often each replica asks the cluster controller for its hot list (the 32 "
        "adapters of most recent demand) to prefetch.",
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

    # ----- log probabilities and merged adapters (engine.sample.logprobs, store.merge) -----
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
        "device tiers under their byte and slot budgets. All in use: a new recipe is refused with 429.",
    )
    merge_seed: int = Field(
        0, ge=0, lt=2**63,
        description="Seed of the random pruning of dare_linear and dare_ties merges: the same request "
        "gives the same merged adapter on every replica and after restarts.",
    )

    # ----- structured output (engine.sample.grammar_compiler, docs/structured_output.md) -----
    guided_compile_timeout_s: float = Field(
        10.0, gt=0, description="Longest a structured-output constraint (JSON schema, regex, choice, "
        "grammar) may take to compile; a longer compile is refused with 400 once this passes, and so "
        "is every later request with the same constraint. Compiles usually take about 1 ms; the wait for "
        "the model's grammar tokenizer, built once on the first constrained request, does not count."
    )
    guided_grammar_cache_size: int = Field(
        256, ge=1, le=65536, description="Compiled constraints one engine keeps (least recently used "
        "dropped first; refusals are kept too, so a bad schema sent again is refused without compiling). "
        "A request keeps its own matcher whatever the cache drops."
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

    # ----- adapter rotation and prefetch -----
    adapter_min_steps: int = Field(
        8, ge=1, description="No thrash: an adapter placed into a device slot runs at least this many "
        "engine steps before rotation may hand its slot to another adapter."
    )
    adapter_wait_bounds_s: dict[int, float] = Field(
        default_factory=dict,
        description="Fairness bound per priority: seconds a request may wait for its adapter to get a "
        "device slot before a resident adapter is drained for it. Serving fills it from the SLA classes "
        "(adapter_wait_fraction of each class's ttft_s) unless set. Priorities not listed use "
        "adapter_max_wait_s. Environment: a JSON object ({\"0\": 0.5}).",
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
    adapter_async_copy_bytes: ByteSize = Field(
        1 << 20, ge=0, description="Adapters of at least this many bytes are copied into their device slot "
        "off the step thread (CUDA: a side stream), overlapping the forward pass; smaller ones are "
        "copied inline. Accepts suffixes."
    )

    @model_validator(mode="after")
    def _pinned_fit(self) -> EngineConfig:
        if len(set(self.pinned)) >= self.max_loras:
            raise ValueError(
                f"{len(set(self.pinned))} pinned adapters need fewer than "
                f"max_loras={self.max_loras} slots (one slot must stay free for the others)"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes one token per step)"
            )
        return self

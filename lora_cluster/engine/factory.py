"""The engine's composition root: `build_engine` builds every part of an engine and hands them over.

`Engine` receives its collaborators and builds none of them. `build_engine` resolves the config
(`Engine`'s historical arguments, any `EngineConfig` field as a keyword, or a whole `config`),
loads the base model, sizes the KV cache and the adapter slots from the device's free memory
(after the model is loaded: `model.memory_plan`), and wires the adapter loader: the caller's
`adapter_loader` (an `EnginePort`, or a factory called with the config, the model's shapes and
the device), or by default `store.build_adapter_loader`, the tiered adapter store of
`adapter_source` (`adapter_store="tiered"`) or the plain folder loader (`adapter_store="folder"`).
Then the adapter pool and its residency, the model runner with its sampler, the scheduler with its
admission gate (a grammar first, then the adapter), and the grammar compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from lora_kernels import LoraOps, get_lora_ops
from lora_kernels import native as native_kernel

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.config import EngineConfig, build_config
from lora_cluster.engine.adapters.copier import AdapterCopier
from lora_cluster.engine.adapters.dora import projection_weights
from lora_cluster.engine.adapters.guard import AdapterGuard
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.adapters.residency import AdapterResidency
from lora_cluster.engine.adapters.rotation import rotation_from_config
from lora_cluster.engine.llm_engine import Engine
from lora_cluster.engine.model.base_model import BaseModel, eos_token_ids, fused_splits
from lora_cluster.engine.model.lora_layer import LoraLayer, fused_shrink
from lora_cluster.engine.model.memory_plan import MemoryPlan, plan_engine_memory
from lora_cluster.engine.model.model_loader import load_base_model, resolve_device
from lora_cluster.engine.model.runner import ModelRunner
from lora_cluster.engine.model.step_buffers import StepBuffers
from lora_cluster.engine.sample.grammar_compiler import GrammarCompiler, grammar_tokenizer
from lora_cluster.engine.sample.pipeline import StepSampler
from lora_cluster.engine.schedule.counters import EngineCounters
from lora_cluster.engine.schedule.kv_cache import BlockAllocator, PagedKVCache
from lora_cluster.engine.schedule.prefix_cache import PrefixCacheIndex
from lora_cluster.engine.schedule.scheduler import Scheduler, grammar_first
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.engine.schedule.step_meter import StepMeter
from lora_cluster.replica_policy.prefill_plan import URGENT_PRIORITY
from lora_cluster.replica_policy.prefix_hash import chain_root
from lora_cluster.store import build_adapter_loader
from lora_cluster.store.ports import EnginePort

log = logging.getLogger(__name__)
# builds the engine's loader once the base model's shapes and device are known
LoaderFactory = Callable[[EngineConfig, ModelShapes, torch.device], EnginePort]


def build_engine(
    model: str | None = None,
    adapter_source: str | list[str] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    *,
    config: EngineConfig | None = None,
    adapter_loader: EnginePort | LoaderFactory | None = None,
    **overrides: object,
) -> Engine:
    """An `Engine` of `config` (or of the arguments and overrides) whose loader is `adapter_loader`,
    or (None) the adapter store of its config (see the module docstring)."""
    if config is None:
        given = {"model": model, "adapter_source": adapter_source, "max_loras": max_loras,
                 "max_lora_rank": max_lora_rank, **overrides}
        config = build_config(EngineConfig, **{k: v for k, v in given.items() if v is not None})
    device, dtype = resolve_device(config.device, config.dtype)
    base = load_base_model(config.model, dtype=dtype, device=device)
    # sliding-window layers mask their attention (model.attention): the window does not cap length
    max_model_len = min(config.max_model_len, base.dims.max_position_embeddings)
    # paged KV cache and adapter slots, sized from the device's free memory on a GPU (memory_plan)
    memory = plan_engine_memory(config, base.dims, dtype, device, max_model_len)
    kv = _kv_cache(config, base, memory, max_model_len, dtype, device)
    buffers = StepBuffers(device)
    make_loader = build_adapter_loader if adapter_loader is None else adapter_loader
    loader = make_loader(config, base.dims.shapes(), device) if callable(make_loader) else make_loader
    pool = AdapterPool(base.dims.shapes(), num_slots=memory.num_adapter_slots, max_rank=config.max_lora_rank,
                       dtype=dtype, device=device, policy=loader.slot_policy(),
                       base_weight=projection_weights(base.layers, base.dims))  # fmt: skip
    guard, counters = AdapterGuard(config), EngineCounters()  # counters: steps, batches, placements
    meter = StepMeter()  # shared: the engine charges step time, the residency load time
    adapters = AdapterResidency(
        loader, loader, pool, config.adapter_load_workers, guard=guard, rotation=rotation_from_config(config),
        pinned=config.pinned, copier=AdapterCopier(pool, device, config.adapter_async_copy_bytes),
        counters=counters, meter=meter,
    )
    scheduler = _scheduler(config, kv, pool, adapters)
    eos = eos_token_ids(base)
    runner = _runner(config, base, kv, pool, scheduler.kv_blocks, buffers, eos, device)
    # structured output: grammars compile on their own threads (sample.grammar_compiler)
    grammars = GrammarCompiler(
        functools.partial(grammar_tokenizer, base.tokenizer, base.dims.vocab_size, eos),
        cache_size=config.guided_grammar_cache_size, timeout_s=config.guided_compile_timeout_s,
    )
    return Engine(config=config, model=base, device=device, max_model_len=max_model_len, memory=memory,
                  kv=kv, loader=loader, pool=pool, adapters=adapters, adapter_guard=guard, counters=counters,
                  runner=runner, scheduler=scheduler, grammars=grammars, eos_token_ids=eos, meter=meter)


def prefix_root(pool: AdapterPool, seq: Sequence) -> bytes:
    """The prefix-cache chain root of an admitted sequence: its adapter id and the version of the
    weights in the device slot it runs with (`replica_policy.prefix_hash`)."""
    if seq.adapter_id is None:
        return chain_root(None, 0)
    return chain_root(seq.adapter_id, pool.slot_version(seq.lora_slot))


def _scheduler(config: EngineConfig, kv: PagedKVCache, pool: AdapterPool,
               adapters: AdapterResidency) -> Scheduler:
    """The scheduler over the KV cache's blocks (with the prefix cache when enabled); a sequence is
    admitted once its grammar is ready and then its adapter's gate lets it (`grammar_first`)."""
    kv_blocks = BlockAllocator(
        num_blocks=kv.num_blocks, block_size=kv.block_size, num_slots=config.max_num_seqs,
        prefix_cache=PrefixCacheIndex() if config.enable_prefix_caching else None,
    )
    return Scheduler(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting=config.max_waiting, acquire=grammar_first(adapters.acquire), release=adapters.release,
        slot_to_preempt=adapters.slot_to_preempt, less_urgent_chunk=config.less_urgent_prefill_chunk,
        urgent_priority=URGENT_PRIORITY, kv_blocks=kv_blocks,
        prefix_root=functools.partial(prefix_root, pool),
    )


def _kv_cache(config: EngineConfig, base: BaseModel, memory: MemoryPlan, max_model_len: int,
              dtype: torch.dtype, device: torch.device) -> PagedKVCache:
    """The paged KV cache's block tensors, as many blocks as the memory plan has room for."""
    dims = base.dims
    return PagedKVCache(num_layers=dims.num_layers, num_blocks=memory.num_kv_blocks,
                        block_size=config.kv_block_size, kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
                        max_len=max_model_len, dtype=dtype, device=device)  # fmt: skip


def _lora_ops(config: EngineConfig, device: torch.device) -> LoraOps:
    """The LoRA ops of `config.kernel` on `device`; on the CPU, the native kernel unless it is off or
    cannot be built (then the torch ops, with a warning)."""
    ops = get_lora_ops(config.kernel, device)
    if ops.name == "cpu":
        if not config.lora_cpu_native:
            ops = dataclasses.replace(ops, add_lora=functools.partial(ops.add_lora, native=False))
        elif not native_kernel.load():
            log.warning("no native CPU LoRA kernel, the torch ops run: %s", native_kernel.load_error())
    return ops


def _runner(config: EngineConfig, base: BaseModel, kv: PagedKVCache, pool: AdapterPool,
            kv_blocks: BlockAllocator, buffers: StepBuffers, eos: set[int],
            device: torch.device) -> ModelRunner:
    """The model runner with its LoRA layer (fused shrinks per `fused_shrink`) and its sampler; on an
    accelerator the sampler's token masks fill on their own thread while the forward pass runs
    (sample.token_mask), on the CPU on the step thread."""
    ops = _lora_ops(config, device)
    lora = LoraLayer(pool, ops, fused_splits(base.dims), fused_shrink(config.lora_fused_shrink, ops.name))
    mask_pool = None if device.type == "cpu" else ThreadPoolExecutor(1, thread_name_prefix="token-mask")
    return ModelRunner(base, kv, pool, ops, device, lora=lora,
                       sampler=StepSampler(base.dims.vocab_size, eos, mask_pool), kv_blocks=kv_blocks,
                       buffers=buffers, decode_kernel=config.lora_decode_kernel)

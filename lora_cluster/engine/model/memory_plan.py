"""How many KV blocks and adapter slots an engine gets: a pure function of the device's numbers.

On a GPU (after the base model is loaded) the engine may use `gpu_memory_utilization` of the
device's total memory, the budget. The usual split of that budget is 60% base model, 30% adapter
pool, 10% buffer; here the base model takes what it actually uses, the adapter pool at most
`adapter_pool_share` of the budget (as many `max_lora_rank` slots as fit there, at most
`max_loras`), the buffer `buffer_share` (activations, allocator slack), and the KV cache the rest:

    kv = budget - used_now - buffer - slots * slot_bytes,    blocks = kv // block_bytes

An explicit `num_kv_blocks` replaces that rest (as vLLM's `num_gpu_blocks_override`): those blocks
and the pool must then fit in the memory free now, whatever the budget (so that several engines, or
an engine beside other work, can share one device at sizes their owner chose).

`used_now` is total - free when the plan is made (the base weights and anything else on the
device). What the pool does not need of its share goes to the KV cache. Too little memory for one
adapter slot or for one `max_model_len` sequence is a `ConfigError` naming the numbers.

On CPU there is no device budget: `cpu_plan` keeps the sizes of a fixed per-sequence reservation
(`max_num_seqs` sequences of `max_model_len` tokens) unless `num_kv_blocks` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_cluster.config import EngineConfig
from lora_cluster.engine.model.base_model import ModelDims
from lora_cluster.engine.schedule.kv_cache import PagedKVCache, blocks_for
from lora_cluster.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    num_kv_blocks: int
    num_adapter_slots: int
    kv_bytes: int  # num_kv_blocks * block bytes
    adapter_pool_bytes: int  # num_adapter_slots * slot bytes
    buffer_bytes: int  # left for activations (0 on CPU: not planned)


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    free_bytes: int  # free now, after the base model is loaded


def plan_device_memory(
    device: DeviceMemory,
    *,
    gpu_memory_utilization: float,
    adapter_pool_share: float,
    buffer_share: float,
    block_bytes: int,
    slot_bytes: int,
    max_loras: int,
    min_kv_blocks: int,
    num_kv_blocks: int | None = None,
) -> MemoryPlan:
    """The GPU plan of the module docstring."""
    budget = int(device.total_bytes * gpu_memory_utilization)
    used = device.total_bytes - device.free_bytes
    buffer = int(budget * buffer_share)
    slots = min(max_loras, int(budget * adapter_pool_share) // max(slot_bytes, 1))
    if slots < 1:
        raise ConfigError(
            f"adapter pool: {adapter_pool_share:.0%} of {budget / GIB:.2f} GiB holds no adapter slot of "
            f"{slot_bytes / GIB:.3f} GiB (lower max_lora_rank or raise adapter_pool_share)"
        )
    if num_kv_blocks is not None:
        need = num_kv_blocks * block_bytes + slots * slot_bytes
        if need > device.free_bytes:
            raise ConfigError(
                f"num_kv_blocks={num_kv_blocks} ({num_kv_blocks * block_bytes / GIB:.2f} GiB) and {slots} "
                f"adapter slots ({slots * slot_bytes / GIB:.2f} GiB) need more than the "
                f"{device.free_bytes / GIB:.2f} GiB free on the device"
            )
        return MemoryPlan(num_kv_blocks, slots, num_kv_blocks * block_bytes, slots * slot_bytes, buffer)
    kv = budget - used - buffer - slots * slot_bytes
    blocks = max(0, kv) // block_bytes
    if blocks < min_kv_blocks:
        raise ConfigError(
            f"KV cache: {max(0, kv) / GIB:.2f} GiB left of a {budget / GIB:.2f} GiB budget "
            f"(gpu_memory_utilization={gpu_memory_utilization}, {used / GIB:.2f} GiB in use, "
            f"{buffer / GIB:.2f} GiB buffer, {slots} adapter slots) holds {blocks} blocks; one "
            f"max_model_len sequence needs {min_kv_blocks}"
        )
    return MemoryPlan(blocks, slots, blocks * block_bytes, slots * slot_bytes, buffer)


def cpu_plan(
    *, max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int, slot_bytes: int,
    max_loras: int, num_kv_blocks: int | None,
) -> MemoryPlan:  # fmt: skip
    """Sizes without a device budget: `num_kv_blocks`, or room for `max_num_seqs` full sequences."""
    blocks = num_kv_blocks or max_num_seqs * blocks_for(max_model_len, block_size)
    return MemoryPlan(blocks, max_loras, blocks * block_bytes, max_loras * slot_bytes, 0)


def adapter_slot_bytes(modules: dict[str, tuple[int, int]], num_layers: int, max_rank: int, elem: int) -> int:
    """Device bytes of one adapter slot: A [rank, in] and B [out, rank] of every projection and layer."""
    return num_layers * max_rank * sum(i + o for i, o in modules.values()) * elem


def dora_slot_bytes(modules: dict[str, tuple[int, int]], num_layers: int, elem: int) -> int:
    """Device bytes of one slot's DoRA scale: one value per output feature of every projection and layer."""
    return num_layers * sum(o for _, o in modules.values()) * elem


def plan_engine_memory(config: EngineConfig, dims: ModelDims, dtype: torch.dtype, device: torch.device,
                       max_model_len: int) -> MemoryPlan:  # fmt: skip
    """The engine's plan: from the device's free memory on CUDA (call it once the base model is
    loaded), else `cpu_plan`; an explicit `num_kv_blocks` wins on either. One `max_model_len`
    sequence must fit (else a lone sequence could never finish): ConfigError otherwise."""
    block_size = config.kv_block_size
    block_bytes = PagedKVCache.block_bytes(
        num_layers=dims.num_layers, block_size=block_size, kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
        dtype=dtype,
    )  # fmt: skip
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = dims.shapes()
    slot_bytes = adapter_slot_bytes(shapes.modules, dims.num_layers, config.max_lora_rank, elem)
    # DoRA's scale per output feature of every projection and layer (AdapterPool.dora); the pool's one
    # extra zero row of it (< 1/(2 * max_rank) of one slot) is left to the buffer
    slot_bytes += dora_slot_bytes(shapes.modules, dims.num_layers, elem)
    # LoRA on every expert of a mixture of experts (AdapterPool.expert_a / expert_b)
    slot_bytes += shapes.experts * adapter_slot_bytes(shapes.expert_modules, dims.num_layers,
                                                      config.max_lora_rank, elem)  # fmt: skip
    min_blocks = blocks_for(max_model_len, block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        plan = plan_device_memory(
            DeviceMemory(total, free), gpu_memory_utilization=config.gpu_memory_utilization,
            adapter_pool_share=config.adapter_pool_share, buffer_share=config.memory_buffer_share,
            block_bytes=block_bytes, slot_bytes=slot_bytes, max_loras=config.max_loras,
            min_kv_blocks=min_blocks, num_kv_blocks=config.num_kv_blocks,
        )  # fmt: skip
    else:
        plan = cpu_plan(
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            block_bytes=block_bytes, slot_bytes=slot_bytes, max_loras=config.max_loras,
            num_kv_blocks=config.num_kv_blocks,
        )  # fmt: skip
    if plan.num_kv_blocks < min_blocks:
        raise ConfigError(
            f"num_kv_blocks={plan.num_kv_blocks} of {block_size} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({min_blocks} blocks)"
        )
    return plan

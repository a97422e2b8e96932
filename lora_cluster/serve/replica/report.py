"""What a LoRA replica tells the cluster controller: its `ReplicaReport`, built from the engine.

Memory split (bytes): the base model's weights, the KV cache and the adapter slot pool as the
engine allocated them, the device's free memory (CUDA only; None on CPU), and the adapter store's
host tier (bytes held and budget). Requests: running and waiting (all, per priority, per SLA class),
the replica's busiest adapters since its last report, and the mean time a request held the replica
recently (an exponentially weighted average), which the controller's placement uses. The adapters
its host tier holds (`host_held`: the `MAX_REPORTED_HOST` the host cache used most recently,
`HostCache.recent`, oldest of them first), which a miss prefers (`scheduling.choose_replica`).

Running per priority is the batch the engine runs once it has admitted the waiting requests it has
slots for, more urgent ones preempting less urgent running ones (`projected_batch`): the controller
reads it as the work a preemption there can still free. A request the controller sent over capacity
to preempt is reported as arrived as soon as it reaches the replica, while the engine preempts for it
only at its next step, and a step under load can take a second: counted as running until then, its
victim would look preemptible twice, and further urgent requests would be sent where nothing is
left to preempt, to wait there for a slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lora_cluster.cluster.report_rules import projected_batch
from lora_cluster.cluster.reports import MAX_REPORTED_HOST, MemorySplit, ReplicaReport
from lora_cluster.engine import Engine, EngineStats
from lora_cluster.store import TieredAdapterStore


def host_held(keys: Callable[[], list[str]] | None) -> tuple[str, ...]:
    """The host tier's adapters for a report: the last `MAX_REPORTED_HOST` of `keys()` (the host
    cache's adapters, oldest first; None: the store has no host tier)."""
    return () if keys is None else tuple(keys()[-MAX_REPORTED_HOST:])


def host_by_recency(store: object) -> Callable[[], list[str]] | None:
    """The keys `host_held` reads from a store: its host tier's `MAX_REPORTED_HOST` most recently used
    adapters, oldest of them first (the names a miss is likeliest to find there); None without one."""
    if not isinstance(store, TieredAdapterStore):
        return None
    host = store.host
    return lambda: host.recent(MAX_REPORTED_HOST)[::-1]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def memory_split(engine: Engine, store_tiers: dict[str, Any]) -> MemorySplit:
    """The engine's device memory by use, and the host tier's bytes (see the module docstring)."""
    free = None
    if engine.device.type == "cuda":
        free = int(torch.cuda.mem_get_info(engine.device)[0])
    host = store_tiers.get("host", {})
    return MemorySplit(base_weights=_tensor_bytes(engine.model), kv_cache=engine.kv.nbytes,
                       adapter_pool=engine.pool.nbytes, free=free, host_cache=int(host.get("bytes", 0)),
                       host_cache_budget=int(host.get("budget_bytes", 0)))


def build_report(*, replica_id: str, node_id: str, capacity: int, stats: EngineStats, max_num_seqs: int,
                 max_loras: int, classes: dict[str, Any], adapter_requests: dict[str, int],
                 memory: MemorySplit, service_time_s: float | None, sent_at: float, active: int,
                 arrived_tickets: tuple[str, ...], base: str | None = None,
                 prefixes: tuple[str, ...] = (), host_held: tuple[str, ...] = (),
                 cluster_held: tuple[str, ...] = ()) -> ReplicaReport:
    """The report (the reporter sends it, or its delta, as the plain dict the controller's `report`
    takes); `base`: the served base's API name; `prefixes`: the routing keys of the prompt prefixes
    the replica ran lately; `host_held`: the adapters its host tier holds (`host_held`); `cluster_held`:
    those whose cluster-tier copy it published or copied on its node (`RayClusterTier.local_adapters`)."""
    return ReplicaReport(
        replica_id=replica_id, node_id=node_id, capacity=capacity, max_num_seqs=max_num_seqs,
        max_loras=max_loras, running=stats.num_running, waiting=stats.num_waiting,
        free_adapter_slots=stats.free_adapter_slots, resident=tuple(stats.resident_adapters),
        loading=tuple(stats.loading_adapters),
        running_by_priority=projected_batch(stats.running_by_priority, stats.waiting_by_priority,
                                            max_num_seqs),
        classes=classes, adapter_requests=adapter_requests, memory=memory, service_time_s=service_time_s,
        active=active, arrived_tickets=arrived_tickets, sent_at=sent_at, base=base, prefixes=tuple(prefixes),
        host_held=host_held, cluster_held=cluster_held,
    )

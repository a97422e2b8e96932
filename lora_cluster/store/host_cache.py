"""The host-memory tier: validated adapter weights kept in RAM under a byte budget.

Policy: entries are admitted after every load (unless larger than what unprotected entries can
free); victims are chosen by `tier.TierIndex` (value per byte, never pinned / in-use entries).
With `int8=True` the copy is quantized per channel (`quant`), a quarter of the float bytes, and
dequantized on every hit. With `pin=True` (CUDA only) the tensors live in page-locked memory so
the copy into a device slot is a fast DMA. Entries are immutable once stored: a hit returns the
cached `LoraWeights` itself (float) or a fresh dequantized one (int8); callers must not mutate it.
Entries are kept in recency order (a hit or a store moves one to the end), so `recent(limit)` lists
the most recently used ones in O(limit). Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.replica_policy.tier_stats import StoreStats
from lora_cluster.store.quant import Int8LoraWeights, dequantize, quantize
from lora_cluster.store.tier import TierIndex

HostCopy = LoraWeights | Int8LoraWeights


def _pinned(weights: HostCopy) -> HostCopy:
    """The same copy with every tensor in page-locked memory (CUDA hosts only)."""
    if isinstance(weights, LoraWeights):
        weights.a = {k: t.pin_memory() for k, t in weights.a.items()}
        weights.b = {k: t.pin_memory() for k, t in weights.b.items()}
    else:
        for qt in (*weights.a.values(), *weights.b.values()):
            qt.q, qt.scale = qt.q.pin_memory(), qt.scale.pin_memory()
    return weights


class HostCache:
    def __init__(
        self,
        budget_bytes: int,
        *,
        int8: bool = False,
        pin: bool = False,
        protected: Callable[[str], bool] = lambda adapter_id: False,
        priority: Callable[[str], float] = lambda adapter_id: 0.0,
        on_evict: Callable[[str], None] = lambda adapter_id: None,
        stats: StoreStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.int8 = int8
        self.pin = pin and torch.cuda.is_available()
        self.index = TierIndex(budget_bytes, protected=protected, priority=priority, clock=clock)
        self._data: OrderedDict[str, HostCopy] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.stats = stats or StoreStats()
        self.stats.set("host", budget_bytes=budget_bytes)

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._data

    def keys(self) -> list[str]:
        """The cached adapters, least recently used first."""
        with self._lock:
            return list(self._data)

    def recent(self, limit: int) -> list[str]:
        """At most `limit` cached adapters, most recently used (loaded or hit) first; O(limit)."""
        with self._lock:
            return list(itertools.islice(reversed(self._data), max(0, limit)))

    @property
    def bytes(self) -> int:
        return self.index.bytes

    def nbytes(self, adapter_id: str) -> int | None:
        """Bytes of the cached copy of `adapter_id` (as stored: int8 copies are smaller), or None."""
        with self._lock:
            entry = self.index.entries.get(adapter_id)
            return None if entry is None else entry.nbytes

    def get(self, adapter_id: str) -> LoraWeights | None:
        """The float weights of a cached adapter (dequantized when stored as int8), or None."""
        with self._lock:
            copy = self._data.get(adapter_id)
            if copy is None:
                return None
            self._data.move_to_end(adapter_id)
            self.index.touch(adapter_id)
        return dequantize(copy) if isinstance(copy, Int8LoraWeights) else copy

    def put(self, weights: LoraWeights, reload_cost_s: float, stored: Int8LoraWeights | None = None) -> bool:
        """Keep a copy of `weights`; False when it cannot be admitted within the budget. An int8 cache
        keeps `stored` (the int8 copy the cold tiers already hold, e.g. as received from a peer) as it
        is, and quantizes `weights` only without one."""
        copy: HostCopy = (stored or quantize(weights)) if self.int8 else weights
        if self.pin:
            copy = _pinned(copy)
        aid = weights.adapter_id
        with self._lock:
            evicted = self.index.admit(aid, aid, copy.nbytes, reload_cost_s)
            if evicted is None:
                self.stats.add("host", "rejected")
                return False
            for entry in evicted:
                self._data.pop(entry.key, None)
            self._data[aid] = copy
            self._data.move_to_end(aid)
            self._update_gauges(len(evicted))
        for entry in evicted:
            self._on_evict(entry.key)
        return True

    def remove(self, adapter_id: str) -> bool:
        with self._lock:
            removed = self._data.pop(adapter_id, None) is not None
            self.index.remove(adapter_id)
            self._update_gauges(0)
        return removed

    def _update_gauges(self, evictions: int) -> None:
        self.stats.set("host", bytes=self.index.bytes, entries=len(self._data))
        if evictions:
            self.stats.add("host", "evictions", evictions)

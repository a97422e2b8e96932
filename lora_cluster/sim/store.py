"""One node's adapter store below the device: host memory and local disk, each with a byte budget.

An adapter is in the highest tier that holds it: host, else disk, else only in S3 (the source) and,
with the cluster tier (`sim.cluster_store`), perhaps on other nodes. Fetching it to host memory puts
it in the host tier, and, when it came from S3 or another node, in the disk tier too. Each tier
evicts its least recently used adapters to stay within its budget (the real store
weighs size, reload cost, frequency and recency; LRU is the simulator's simplification). A run
starts with every adapter in S3 only, unless it preloads some (`preload`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence


class _LruBytes:
    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._items: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._items

    def touch(self, adapter_id: str) -> None:
        if adapter_id in self._items:
            self._items.move_to_end(adapter_id)

    def put(self, adapter_id: str, nbytes: int) -> None:
        if adapter_id in self._items:
            self._items.move_to_end(adapter_id)
            return
        if nbytes > self.budget:
            return
        while self.used + nbytes > self.budget:
            _, freed = self._items.popitem(last=False)
            self.used -= freed
        self._items[adapter_id] = nbytes
        self.used += nbytes

    def __len__(self) -> int:
        return len(self._items)

    def recent(self, n: int) -> tuple[str, ...]:
        """Its `n` most recently used adapters, least recent first (what a replica reports): O(n)."""
        latest = list(itertools.islice(reversed(self._items), n))
        return tuple(reversed(latest))

    def fill(self, oldest_first: Sequence[str], sizes: Mapping[str, int]) -> None:
        """The tier as after `put` of `oldest_first` in order into an empty tier, computed directly:
        LRU keeps the longest run of the latest puts that fits the budget (an adapter larger than
        the whole budget is never put), in put order. O(what fits), not O(len(oldest_first))."""
        if self._items:
            for adapter_id in oldest_first:
                self.put(adapter_id, sizes[adapter_id])
            return
        kept: list[tuple[str, int]] = []
        used = 0
        for adapter_id in reversed(oldest_first):
            nbytes = sizes[adapter_id]
            if nbytes > self.budget:
                continue
            if used + nbytes > self.budget:
                break
            kept.append((adapter_id, nbytes))
            used += nbytes
        self._items = OrderedDict(reversed(kept))
        self.used = used


class NodeStore:
    def __init__(self, *, host_bytes: int, disk_bytes: int):
        self.host = _LruBytes(host_bytes)
        self.disk = _LruBytes(disk_bytes)

    def tier(self, adapter_id: str) -> str:
        """Where a fetch of `adapter_id` starts: "host", "disk" or "s3"."""
        if adapter_id in self.host:
            return "host"
        return "disk" if adapter_id in self.disk else "s3"

    def preload(self, adapter_ids: Sequence[str], sizes: Mapping[str, int]) -> None:
        """The store as after the engine's `preload` fetched `adapter_ids` (most popular first) from
        S3 at start: on disk, and in host memory as far as its budget goes; fetched least popular
        first, so that LRU keeps the most popular in host memory."""
        oldest_first = list(reversed(adapter_ids))
        self.disk.fill(oldest_first, sizes)
        self.host.fill(oldest_first, sizes)

    def fetched(self, adapter_id: str, nbytes: int, tier: str) -> None:
        """A fetch from `tier` completed: the adapter is now in host memory (and on disk if from S3 or,
        through the cluster tier, from another node: `sim.cluster_store`)."""
        if tier in ("s3", "peer"):
            self.disk.put(adapter_id, nbytes)
        else:
            self.disk.touch(adapter_id)
        self.host.put(adapter_id, nbytes)

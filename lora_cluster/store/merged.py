"""Merged adapters as adapter ids: the recipes a loader remembers, their versions, and building them.

A request's merge (`merge.MergeSpec`) is defined on the replica before the request is queued
(`define`); from then on its id, `merged/<hash>`, is an ordinary adapter id for the engine: one
device slot shared by every request of that merge, a host-tier copy, the same residency and
eviction rules.

Cache key: a merged adapter's weights are cached under its id, which hashes the spec (ids, weights,
strategy, density, sign method), and carry a version that stands for the versions of its adapters:
`version(merged_id)` is bumped whenever one of them changes (re-registered, invalidated), so the
engine never serves a merge of an adapter's old weights, exactly as for a plain adapter. A merge
is rebuilt from its adapters' copies in the tiers (host, disk, source), never stored on disk.

Bounded: at most `max_entries` recipes (a client chooses them); when full, the least recently
defined recipe that no queued or running request uses (`in_use`) is dropped. If every one is in
use, `define` raises AdapterCapacityError (429). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.errors import AdapterCapacityError, AdapterNotFoundError
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.store.merge import merge
from lora_cluster.store.versions import Versions


class MergedAdapters:
    def __init__(self, *, max_entries: int, load: Callable[[str], LoraWeights], version: Callable[[str], int],
                 versions: Versions, in_use: Callable[[str], bool], module_order: Sequence[str],
                 max_rank: int, seed: int):
        """`load` / `version` are the loader's for plain adapter ids; `versions` keeps the merged ids'
        versions (the loader's own `Versions`)."""
        self.max_entries = max_entries
        self._load, self._version, self._versions, self._in_use = load, version, versions, in_use
        self.module_order, self.max_rank, self.seed = tuple(module_order), max_rank, seed
        self._specs: OrderedDict[str, MergeSpec] = OrderedDict()
        self._seen: dict[str, tuple[int, ...]] = {}  # merged id -> its adapters' versions at the last check
        self._lock = threading.Lock()

    def define(self, spec: MergeSpec) -> str:
        """Remember `spec`; returns its merged adapter id."""
        merged_id = spec.adapter_id
        with self._lock:
            if merged_id in self._specs:
                self._specs.move_to_end(merged_id)
                return merged_id
            if len(self._specs) >= self.max_entries:
                victim = next((m for m in self._specs if not self._in_use(m)), None)
                if victim is None:
                    raise AdapterCapacityError(merged_id, f"all {self.max_entries} merged adapters "
                                               "(max_merged_adapters) are in use")
                del self._specs[victim]
                self._seen.pop(victim, None)
            self._specs[merged_id] = spec
        return merged_id

    def spec(self, merged_id: str) -> MergeSpec | None:
        with self._lock:
            return self._specs.get(merged_id)

    def version(self, merged_id: str) -> int:
        """The merged id's version: bumped when any of its adapters' versions changed (cheap, no I/O)."""
        spec = self.spec(merged_id)
        if spec is None:
            return self._versions.get(merged_id)
        current = tuple(self._version(aid) for aid in spec.ids)
        with self._lock:
            seen = self._seen.get(merged_id)
            self._seen[merged_id] = current
        if seen is not None and seen != current:
            return self._versions.bump(merged_id)
        return self._versions.get(merged_id)

    def build(self, merged_id: str) -> LoraWeights:
        """Load the adapters (through the loader's tiers) and merge them; raises the first adapter's
        AdapterError, or AdapterMergeError."""
        spec = self.spec(merged_id)
        if spec is None:
            raise AdapterNotFoundError(merged_id, "no such merged adapter on this replica (its recipe was "
                                       "dropped; send the request with merged_adapters again)")
        version = self.version(merged_id)
        weights = merge(spec, [self._load(aid) for aid in spec.ids], self.module_order, adapter_id=merged_id,
                        max_rank=self.max_rank, seed=self.seed)
        weights.version = version
        return weights

    def __len__(self) -> int:
        with self._lock:
            return len(self._specs)

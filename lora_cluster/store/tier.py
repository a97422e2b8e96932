"""Byte-budgeted membership of one cache tier: admission, leases and victim choice, no I/O.

Invariants (checked by the property tests):
* `bytes <= budget` at all times: an entry is admitted only if, after evicting victims, it fits;
  otherwise it is refused and nothing is evicted.
* an entry that is protected (pinned, used by a queued/running request: the injected `protected`
  predicate) or leased (a read of it is in progress) is never a victim.
The owning cache holds a lock around every call and does the I/O for what this index decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from lora_cluster.replica_policy.eviction import Candidate, choose_victims


@dataclass
class Entry:
    key: str
    adapter_id: str
    nbytes: int
    reload_cost_s: float
    last_access: float
    leases: int = 0


class TierIndex:
    def __init__(
        self,
        budget_bytes: int,
        *,
        protected: Callable[[str], bool] = lambda adapter_id: False,
        priority: Callable[[str], float] = lambda adapter_id: 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.budget = budget_bytes
        self._protected, self._priority, self._clock = protected, priority, clock
        self.entries: dict[str, Entry] = {}
        self.bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.last_access = self._clock()
        return entry

    def plan(self, nbytes: int, exclude: str | None = None) -> list[str] | None:
        """Victims to evict so that `nbytes` more fit; None when they cannot fit."""
        if nbytes > self.budget:
            return None
        if self.bytes + nbytes <= self.budget:
            return []  # fits: no victim, and no O(entries) scoring of every entry
        candidates = [
            Candidate(e.key, e.nbytes, e.reload_cost_s, self._priority(e.adapter_id), e.last_access,
                      protected=e.leases > 0 or e.key == exclude or self._protected(e.adapter_id))
            for e in self.entries.values()
        ]
        return choose_victims(candidates, self.bytes + nbytes - self.budget)

    def admit(self, key: str, adapter_id: str, nbytes: int, reload_cost_s: float,
              last_access: float | None = None) -> list[Entry] | None:
        """Insert `key` (replacing an older entry of the same key), evicting victims; returns the
        evicted entries (the caller drops their data), or None if refused (nothing changed)."""
        old = self.entries.get(key)
        if old is not None and old.leases:
            return None
        needed = nbytes - (old.nbytes if old is not None else 0)
        victims = self.plan(needed, exclude=key)
        if victims is None:
            return None
        evicted = [self.remove(v) for v in victims]
        if old is not None:
            self.remove(key)
        self.entries[key] = Entry(key, adapter_id, nbytes, reload_cost_s,
                                  self._clock() if last_access is None else last_access)
        self.bytes += nbytes
        assert self.bytes <= self.budget, (self.bytes, self.budget)
        return [e for e in evicted if e is not None]

    def remove(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        return entry

    def lease(self, key: str) -> Entry | None:
        entry = self.touch(key)
        if entry is not None:
            entry.leases += 1
        return entry

    def release(self, key: str) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.leases > 0:
            entry.leases -= 1

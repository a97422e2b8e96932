"""Version numbers of adapter ids: what an id names changes, its version goes up.

An adapter id's version starts at the store's *floor* and is bumped by every register, unregister
and invalidation. Weights read from a source carry the version current when the read began, and a
device slot remembers the version it was filled with, so a changed adapter is never served from an
old copy.

Bounded: explicit versions are kept for at most `max_entries` ids (ids changed by administrators,
not by clients). When the oldest entry is dropped the floor rises above every version handed out
so far, so every id without an entry gets a version that no old copy can carry: the cost of the
bound is at most one extra reload per adapter, never a stale one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class Versions:
    """Thread-safe version counters per adapter id (see the module docstring)."""

    def __init__(self, max_entries: int = 65_536):
        self.max_entries = max_entries
        self._explicit: OrderedDict[str, int] = OrderedDict()
        self._floor = 0
        self._next = 1
        self._lock = threading.Lock()

    def get(self, adapter_id: str) -> int:
        with self._lock:
            return self._explicit.get(adapter_id, self._floor)

    def bump(self, adapter_id: str) -> int:
        """Give `adapter_id` a version higher than any handed out before; returns it."""
        with self._lock:
            version = self._next
            self._next += 1
            self._explicit[adapter_id] = version
            self._explicit.move_to_end(adapter_id)
            while len(self._explicit) > self.max_entries:
                self._explicit.popitem(last=False)
                self._floor = self._next
                self._next += 1
            return version

    def __len__(self) -> int:
        with self._lock:
            return len(self._explicit)

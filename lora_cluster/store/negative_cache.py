"""Adapter ids that no source offers, remembered briefly: a bounded LRU with a time to live.

Clients choose adapter ids, so a client can ask for any number of ids that do not exist. Each miss
costs every source a lookup (for S3, network round trips); the negative cache answers a repeated
miss at once for `ttl_s` seconds, with the same `AdapterNotFoundError`. It holds at most
`max_entries` ids (the least recently added go first) and is the only record the store keeps of an
id that does not exist. Registering the id removes it; a new upload becomes visible after `ttl_s`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from lora_cluster.errors import AdapterNotFoundError


class NegativeCache:
    def __init__(self, ttl_s: float, *, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._expiry: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, adapter_id: str) -> None:
        """No source offers `adapter_id` (now)."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            self._expiry.pop(adapter_id, None)
            self._expiry[adapter_id] = self._clock() + self.ttl_s
            while len(self._expiry) > self.max_entries:
                self._expiry.popitem(last=False)

    def is_missing(self, adapter_id: str) -> bool:
        """True while `adapter_id` is remembered as missing (an expired entry is dropped)."""
        with self._lock:
            expiry = self._expiry.get(adapter_id)
            if expiry is None:
                return False
            if self._clock() >= expiry:
                del self._expiry[adapter_id]
                return False
            return True

    def check(self, adapter_id: str) -> None:
        """Raise AdapterNotFoundError when `adapter_id` is remembered as missing."""
        if self.is_missing(adapter_id):
            raise AdapterNotFoundError(adapter_id, "not found in the configured adapter sources")

    def discard(self, adapter_id: str) -> None:
        with self._lock:
            self._expiry.pop(adapter_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

"""Which adapters requests use right now, which are pinned, and which sit on the device.

The engine reports each request's life (`request_started` when it is queued, `request_finished`
once when it finishes, fails or is aborted) and the device pool reports residency (`on_device`).
From that, `protected(adapter_id)` — pinned, or used by a queued or running request — is what no
tier may evict, and `priority(adapter_id)` (`policy.load_priority`) orders the victims. This object
is the device pool's slot policy (`AdapterPool(policy=...)`). Thread-safe: the engine thread
writes, loader threads read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from lora_cluster.replica_policy.eviction import AccessTracker
from lora_cluster.replica_policy.tier_stats import StoreStats


class AdapterUsage:
    def __init__(
        self,
        tracker: AccessTracker,
        pinned: Iterable[str] = (),
        *,
        stats: StoreStats | None = None,
        on_request: Callable[[str], None] = lambda adapter_id: None,
        on_residency: Callable[[str, bool], None] = lambda adapter_id, resident: None,
    ):
        self.tracker = tracker
        self.pinned = frozenset(pinned)
        self.stats = stats or StoreStats()
        self._uses: dict[str, int] = {}
        self._device: set[str] = set()
        self._lock = threading.Lock()
        self._on_request, self._on_residency = on_request, on_residency

    # ----- engine hooks ---------------------------------------------------------------------

    def request_started(self, adapter_id: str) -> None:
        """A request using `adapter_id` was queued (counts as a use until `request_finished`)."""
        with self._lock:
            self._uses[adapter_id] = self._uses.get(adapter_id, 0) + 1
            on_device = adapter_id in self._device
        self.tracker.record(adapter_id)
        self.stats.add("device", "hits" if on_device else "misses")
        self._on_request(adapter_id)

    def request_finished(self, adapter_id: str) -> None:
        with self._lock:
            n = self._uses.get(adapter_id, 0) - 1
            if n > 0:
                self._uses[adapter_id] = n
            else:
                self._uses.pop(adapter_id, None)

    # ----- device pool policy ---------------------------------------------------------------

    def protected(self, adapter_id: str) -> bool:
        """Pinned, or used by a queued or running request: no tier may evict it."""
        if adapter_id in self.pinned:
            return True
        with self._lock:
            return adapter_id in self._uses

    def priority(self, adapter_id: str) -> float:
        """Load priority in [0, 1]; the device pool evicts the lowest first."""
        return self.tracker.priority(adapter_id)

    def on_device(self, adapter_id: str, resident: bool) -> None:
        """The pool placed `adapter_id` in a slot (True) or dropped it (False)."""
        with self._lock:
            (self._device.add if resident else self._device.discard)(adapter_id)
            count = len(self._device)
        self.stats.set("device", entries=count)
        if not resident:
            self.stats.add("device", "evictions")
        self._on_residency(adapter_id, resident)

    # ----- queries --------------------------------------------------------------------------

    def num_in_use(self) -> int:
        """Adapters that queued or running requests use (bounded by the engine's queues)."""
        with self._lock:
            return len(self._uses)

    def uses(self, adapter_id: str) -> int:
        with self._lock:
            return self._uses.get(adapter_id, 0)

    def on_device_now(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._device

"""The lifecycle of one adapter across the tiers, with every allowed transition in one table.

    REMOTE --download--> ON_DISK --load--> IN_HOST --place--> ON_DEVICE

An adapter's state is the fastest tier that holds a copy of it. Policy and invariants:

* Promotions move exactly one step to the right: an adapter is never placed on the device without
  having been in host memory, nor loaded without being on a disk (the disk cache, a local source
  folder or the Hugging Face cache). `Lifecycle.promote` refuses a skip with an error (a bug).
* Demotions (evictions) may drop several steps at once: the caches are evicted independently, so
  when the device copy goes the state falls to whichever slower tier still holds a copy.
* A local-folder adapter starts ON_DISK (its source is a disk) and never falls below it; a remote
  adapter (S3, hub) starts REMOTE.
* FAILED is entered when a load fails and no usable copy exists; a retry leaves FAILED for the
  adapter's starting state and promotes again from there.
* IN_HOST means host weights exist: in the host cache, or handed to the engine and not yet placed.

The class is thread-safe and keeps a bounded log of transitions (for tests and debugging).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable


class AdapterState(enum.IntEnum):
    """Where an adapter is; higher values are faster tiers (FAILED is outside the order)."""

    FAILED = -1
    REMOTE = 0
    ON_DISK = 1
    IN_HOST = 2
    ON_DEVICE = 3


S = AdapterState
_TIERS = (S.REMOTE, S.ON_DISK, S.IN_HOST, S.ON_DEVICE)

# from-state -> states it may move to. Promotions: one step right; demotions: any tier to the left.
TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    S.REMOTE: frozenset({S.ON_DISK, S.FAILED}),
    S.ON_DISK: frozenset({S.IN_HOST, S.REMOTE, S.FAILED}),
    S.IN_HOST: frozenset({S.ON_DEVICE, S.ON_DISK, S.REMOTE, S.FAILED}),
    S.ON_DEVICE: frozenset({S.IN_HOST, S.ON_DISK, S.REMOTE}),
    S.FAILED: frozenset({S.REMOTE, S.ON_DISK}),  # retry: back to the starting state
}


def is_allowed(old: AdapterState, new: AdapterState) -> bool:
    return new in TRANSITIONS[old]


class LifecycleError(RuntimeError):
    """An illegal transition was attempted: a bug in the store, never a user error."""


class Lifecycle:
    """Per-adapter state; every change goes through `_move`, which checks `TRANSITIONS`."""

    def __init__(self, log_size: int = 10_000, on_change: Callable[[str, AdapterState, AdapterState], None]
                 | None = None):
        self._state: dict[str, AdapterState] = {}
        self._floor: dict[str, AdapterState] = {}
        self._lock = threading.Lock()
        self.log: deque[tuple[str, AdapterState, AdapterState]] = deque(maxlen=log_size)
        self._on_change = on_change

    def state(self, adapter_id: str) -> AdapterState | None:
        with self._lock:
            return self._state.get(adapter_id)

    def states(self) -> dict[str, AdapterState]:
        with self._lock:
            return dict(self._state)

    def ensure(self, adapter_id: str, floor: AdapterState) -> AdapterState:
        """Start tracking an adapter at `floor` (REMOTE or ON_DISK); returns its current state."""
        if floor not in (S.REMOTE, S.ON_DISK):
            raise LifecycleError(f"an adapter starts REMOTE or ON_DISK, not {floor.name}")
        with self._lock:
            self._floor[adapter_id] = floor
            return self._state.setdefault(adapter_id, floor)

    def promote(self, adapter_id: str, target: AdapterState) -> None:
        """Move to `target` if the adapter is exactly one tier below it; no-op if it is already there
        or in a faster tier; a FAILED adapter first returns to its starting state. A skip raises."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is None:
                raise LifecycleError(f"adapter {adapter_id!r} is not tracked")
            if old is S.FAILED:
                old = self._move(adapter_id, old, self._floor.get(adapter_id, S.REMOTE))
            if old >= target:
                return
            if _TIERS.index(target) - _TIERS.index(old) != 1:
                raise LifecycleError(f"adapter {adapter_id!r}: {old.name} -> {target.name} skips a tier")
            self._move(adapter_id, old, target)

    def settle(self, adapter_id: str, best: AdapterState) -> None:
        """After an eviction: the fastest tier still holding a copy is `best` (a demotion or no-op)."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is None or old is S.FAILED:
                return
            best = max(best, self._floor.get(adapter_id, S.REMOTE))
            if best < old:
                self._move(adapter_id, old, best)

    def fail(self, adapter_id: str) -> None:
        """A load failed: FAILED unless a usable host or device copy still exists."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is not None and old < S.IN_HOST and old is not S.FAILED:
                self._move(adapter_id, old, S.FAILED)

    def forget(self, adapter_id: str) -> None:
        with self._lock:
            self._state.pop(adapter_id, None)
            self._floor.pop(adapter_id, None)

    def _move(self, adapter_id: str, old: AdapterState, new: AdapterState) -> AdapterState:
        if not is_allowed(old, new):
            raise LifecycleError(f"adapter {adapter_id!r}: {old.name} -> {new.name} is not a transition")
        self._state[adapter_id] = new
        self.log.append((adapter_id, old, new))
        if self._on_change is not None:
            self._on_change(adapter_id, old, new)
        return new

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

The class is thread-safe and bounded: it keeps a bounded log of transitions (for tests and
debugging), tracks only adapters that a source offered (the store `forget`s an id that is no
longer offered), and tracks at most `max_adapters`: beyond that, the adapter whose state changed
least recently among those holding no cached copy (in their starting state or FAILED) is forgotten.
A forgotten adapter is tracked again, from its starting state, on its next load.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from collections.abc import Callable


class AdapterState(enum.IntEnum):
    """Where an adapter is; higher values are faster tiers (FAILED is outside the order)."""

    FAILED = -1
    REMOTE = 0
    ON_DISK = 1
    IN_HOST = 2
    ON_DEVICE = 3


_TIERS = (AdapterState.REMOTE, AdapterState.ON_DISK, AdapterState.IN_HOST, AdapterState.ON_DEVICE)

# from-state -> states it may move to. Promotions: one step right; demotions: any tier to the left.
TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    AdapterState.REMOTE: frozenset({AdapterState.ON_DISK, AdapterState.FAILED}),
    AdapterState.ON_DISK: frozenset({AdapterState.IN_HOST, AdapterState.REMOTE, AdapterState.FAILED}),
    AdapterState.IN_HOST: frozenset(
        {AdapterState.ON_DEVICE, AdapterState.ON_DISK, AdapterState.REMOTE, AdapterState.FAILED}
    ),
    AdapterState.ON_DEVICE: frozenset({AdapterState.IN_HOST, AdapterState.ON_DISK, AdapterState.REMOTE}),
    # retry: back to the starting state
    AdapterState.FAILED: frozenset({AdapterState.REMOTE, AdapterState.ON_DISK}),
}


def is_allowed(old: AdapterState, new: AdapterState) -> bool:
    return new in TRANSITIONS[old]


class LifecycleError(RuntimeError):
    """An illegal transition was attempted: a bug in the store, never a user error."""


class Lifecycle:
    """Per-adapter state; every change goes through `_move`, which checks `TRANSITIONS`."""

    def __init__(self, log_size: int = 10_000, on_change: Callable[[str, AdapterState, AdapterState], None]
                 | None = None, max_adapters: int = 65_536):
        self.max_adapters = max_adapters
        self._state: OrderedDict[str, AdapterState] = OrderedDict()  # least recently changed first
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
        if floor not in (AdapterState.REMOTE, AdapterState.ON_DISK):
            raise LifecycleError(f"an adapter starts REMOTE or ON_DISK, not {floor.name}")
        with self._lock:
            self._floor[adapter_id] = floor
            if adapter_id not in self._state:
                self._state[adapter_id] = floor
                self._bound()
            return self._state[adapter_id]

    def promote(self, adapter_id: str, target: AdapterState) -> None:
        """Move to `target` if the adapter is exactly one tier below it; no-op if it is already there
        or in a faster tier; a FAILED adapter first returns to its starting state. A skip raises."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is None:
                raise LifecycleError(f"adapter {adapter_id!r} is not tracked")
            if old is AdapterState.FAILED:
                old = self._move(adapter_id, old, self._floor.get(adapter_id, AdapterState.REMOTE))
            if old >= target:
                return
            if _TIERS.index(target) - _TIERS.index(old) != 1:
                raise LifecycleError(f"adapter {adapter_id!r}: {old.name} -> {target.name} skips a tier")
            self._move(adapter_id, old, target)

    def settle(self, adapter_id: str, best: AdapterState) -> None:
        """After an eviction: the fastest tier still holding a copy is `best` (a demotion or no-op)."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is None or old is AdapterState.FAILED:
                return
            best = max(best, self._floor.get(adapter_id, AdapterState.REMOTE))
            if best < old:
                self._move(adapter_id, old, best)

    def fail(self, adapter_id: str) -> None:
        """A load failed: FAILED unless a usable host or device copy still exists."""
        with self._lock:
            old = self._state.get(adapter_id)
            if old is not None and old < AdapterState.IN_HOST and old is not AdapterState.FAILED:
                self._move(adapter_id, old, AdapterState.FAILED)

    def forget(self, adapter_id: str) -> None:
        """Stop tracking `adapter_id` (no source offers it any more)."""
        with self._lock:
            self._state.pop(adapter_id, None)
            self._floor.pop(adapter_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._state)

    def _bound(self) -> None:
        """Forget the least recently changed uncached adapters beyond `max_adapters` (lock held)."""
        excess = len(self._state) - self.max_adapters
        if excess <= 0:
            return
        idle = [a for a, st in self._state.items()
                if st is AdapterState.FAILED or st is self._floor.get(a, AdapterState.REMOTE)]
        for adapter_id in idle[:excess]:
            del self._state[adapter_id]
            self._floor.pop(adapter_id, None)

    def _move(self, adapter_id: str, old: AdapterState, new: AdapterState) -> AdapterState:
        if not is_allowed(old, new):
            raise LifecycleError(f"adapter {adapter_id!r}: {old.name} -> {new.name} is not a transition")
        self._state[adapter_id] = new
        self._state.move_to_end(adapter_id)
        self.log.append((adapter_id, old, new))
        if self._on_change is not None:
            self._on_change(adapter_id, old, new)
        return new

"""Adapter rotation: which resident adapters hand their device slot over, and which come next.

Pure policy (no tensors, injected clock), consulted by `AdapterResidency` once per engine step.

Grouping: requests of an adapter that is on the device are admitted together, so a resident adapter
with a steady stream of requests keeps its slot (no load per request). Other adapters wait for a
slot that frees up naturally (an adapter with no request left is evictable at once).

Fairness bound (LoRAX's adapter exchange, bounded by deadlines instead of a fixed timer): a waiting
request whose adapter is not on the device may wait `wait_bound(priority)` seconds (a fraction of
its SLA class's time-to-first-token target). Once the oldest request of such an adapter is past
its bound (the adapter is *overdue*) and no slot is free or about to be, a resident adapter is
*drained*: it admits no new request, its running requests finish, and its slot then goes to the
overdue adapter; its own waiting requests wait for their turn (their own bound) like any other.
Victims are resident adapters whose most urgent waiting request is no more urgent than the overdue
one's, least urgent first, then the one placed earliest (round robin). Pinned adapters are never
drained.

No thrash: an adapter placed on the device runs at least `min_steps` engine steps (steps in which
one of its requests ran) before it may be drained, so a load is always paid back by a minimum of
work; an adapter with no request left may go at any time (that is not thrash, it is done).

Prefetch: the first `prefetch_depth` distinct adapters of the waiting queue (in urgency order) that
are not on the device are the next to place: their host fetch is started and, once fetched, they
are copied into a slot that is free (or idle and unwanted) while the current batch runs.

Bounds: state is kept per resident adapter only (O(device slots)); a plan costs O(waiting requests +
device slots), never O(adapters known to the store).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lora_cluster.config import EngineConfig
    from lora_cluster.store.ports import SlotPolicy


class Queued(Protocol):
    """A waiting request as rotation sees it (an engine `Sequence` is one)."""

    adapter_id: str | None
    priority: int
    arrival: float


@dataclass(frozen=True)
class Waiting:
    """A plain `Queued` request."""

    adapter_id: str | None
    priority: int
    arrival: float


@dataclass(frozen=True)
class Resident:
    """An adapter in a device slot: `busy` while running requests (or a copy) hold the slot."""

    busy: bool
    pinned: bool = False


@dataclass
class _Placement:
    placed_at: float
    steps: int = 0  # engine steps in which one of its requests ran since placement


@dataclass(frozen=True)
class RotationPlan:
    draining: frozenset[str] = frozenset()  # resident adapters that admit no new request
    overdue: tuple[str, ...] = ()  # adapters not on the device whose oldest request is past its bound
    prefetch: tuple[str, ...] = ()  # next adapters to fetch and place, in urgency order


@dataclass
class AdapterRotation:
    """Per-step rotation decisions (see the module docstring)."""

    min_steps: int
    wait_bounds_s: Mapping[int, float] = field(default_factory=dict)  # priority -> seconds
    default_wait_s: float = math.inf  # priorities without an entry
    prefetch_depth: int = 4
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._placed: dict[str, _Placement] = {}  # resident adapters only

    # ----- residency events -----------------------------------------------------------------

    def placed(self, adapter_id: str) -> None:
        """The adapter was copied into a device slot (its minimum run starts now)."""
        self._placed[adapter_id] = _Placement(self.clock())

    def removed(self, adapter_id: str) -> None:
        """The adapter left its device slot."""
        self._placed.pop(adapter_id, None)

    def ran(self, adapter_ids: Iterable[str]) -> None:
        """One engine step ran requests of these adapters."""
        for adapter_id in adapter_ids:
            placement = self._placed.get(adapter_id)
            if placement is not None:
                placement.steps += 1

    def steps_run(self, adapter_id: str) -> int:
        placement = self._placed.get(adapter_id)
        return 0 if placement is None else placement.steps

    def wait_bound(self, priority: int) -> float:
        return self.wait_bounds_s.get(priority, self.default_wait_s)

    # ----- the plan -------------------------------------------------------------------------

    def plan(self, waiting: Iterable[Queued], resident: Mapping[str, Resident],
             available: int) -> RotationPlan:
        """Decide this step's drains and prefetches.

        `waiting`: the waiting requests in urgency order (base-model ones are skipped); `resident`:
        the adapters in device slots; `available`: slots a newcomer can take now without draining
        anyone (empty, or idle with no request left)."""
        now = self.clock()
        heads: dict[str, Queued] = {}  # each adapter's most urgent waiting request
        for w in waiting:
            if w.adapter_id is not None and w.adapter_id not in heads:
                heads[w.adapter_id] = w
        absent = [w for a, w in heads.items() if a not in resident]
        overdue = [w for w in absent if now - w.arrival >= self.wait_bound(w.priority)]
        prefetch = tuple(w.adapter_id for w in absent[: self.prefetch_depth])
        # slots that free up without draining: idle unwanted ones, and busy ones nobody waits for
        soon = sum(1 for a, r in resident.items() if r.busy and a not in heads)
        need = len(overdue) - available - soon
        if need <= 0:
            return RotationPlan(overdue=tuple(w.adapter_id for w in overdue), prefetch=prefetch)
        candidates = [
            a for a, r in resident.items()
            if a in heads and not r.pinned and self.steps_run(a) >= self.min_steps
        ]
        candidates.sort(key=lambda a: (-heads[a].priority, self._placed_at(a), a))
        draining: list[str] = []
        for w in overdue:
            if len(draining) == need:
                break
            victim = next((a for a in candidates
                           if a not in draining and heads[a].priority >= w.priority), None)
            if victim is not None:
                draining.append(victim)
        return RotationPlan(frozenset(draining), tuple(w.adapter_id for w in overdue), prefetch)

    def _placed_at(self, adapter_id: str) -> float:
        placement = self._placed.get(adapter_id)
        return -math.inf if placement is None else placement.placed_at

    def __len__(self) -> int:
        return len(self._placed)


class RotationSlotPolicy:
    """The device pool's victim policy under rotation (a `SlotPolicy` around the loader's own).

    Protected: adapters with an unfinished request (`wanted`), and what the loader protects
    (pinned), unless rotation drains them; victims by the loader's priority, then least recently
    used; with `demand` (adapter protection: has the adapter repeated recent demand?), adapters
    without repeated demand go first. Placements and removals are reported to the rotation and to
    the loader's policy."""

    def __init__(self, inner: SlotPolicy | None, rotation: AdapterRotation,
                 wanted: Callable[[str], bool], draining: Callable[[str], bool],
                 demand: Callable[[str], bool] | None = None):
        self.inner, self.rotation = inner, rotation
        self._wanted, self._draining, self._demand = wanted, draining, demand

    def protected(self, adapter_id: str) -> bool:
        if self._draining(adapter_id):
            return False
        return self._wanted(adapter_id) or (self.inner is not None and self.inner.protected(adapter_id))

    def priority(self, adapter_id: str) -> float:
        """The loader's priority (in [0, 1]), plus 1 for repeated demand when `demand` is given."""
        inner = 0.0 if self.inner is None else self.inner.priority(adapter_id)
        return inner + (1.0 if self._demand is not None and self._demand(adapter_id) else 0.0)

    def on_device(self, adapter_id: str, resident: bool) -> None:
        (self.rotation.placed if resident else self.rotation.removed)(adapter_id)
        if self.inner is not None:
            self.inner.on_device(adapter_id, resident)


def rotation_from_config(config: EngineConfig) -> AdapterRotation:
    """The engine's rotation policy from its config fields (`adapter_*`)."""
    return AdapterRotation(
        min_steps=config.adapter_min_steps,
        wait_bounds_s=dict(config.adapter_wait_bounds_s),
        default_wait_s=config.adapter_max_wait_s,
        prefetch_depth=config.adapter_prefetch_depth,
    )


__all__ = [
    "AdapterRotation", "Queued", "Resident", "RotationPlan", "RotationSlotPolicy", "Waiting",
    "rotation_from_config",
]

"""One replica's adapters: device slots, host fetches on a few load workers, prefetches.

Modelled on `engine.adapters.residency` and `engine.adapters.pool`:

* A request's adapter is fetched into host memory when the request reaches the replica (unless it
  is in a device slot), from the node store's highest tier that holds it, on `workers` load workers
  (one fetch per adapter however many requests want it); fetches wait for a worker in the order of
  the most urgent request that wants them (then submission order), prefetches after every
  request. The fetch takes the profile's time for that tier and the adapter's size; it is counted
  as a load from that tier (prefetches too). With the cluster tier (`sim.cluster_store`), a fetch of
  an adapter only in S3 may copy it from another node instead (a load from tier "peer").
  `live_waits`, `live_wait_s`, `live_wait_max_s`: how long requests' fetches waited for a worker.
* `acquire` (the scheduler's gate) answers READY (in a slot: a reference is taken; or fetched and
  a slot is free or evictable: the host -> device copy is charged to the current step), PENDING
  (still fetching) or BLOCKED (fetched, but every slot is referenced or kept for queued requests,
  or `may_claim` is false).
* Eviction: an empty slot first, else, among the slots without references whose adapter no queued
  request of this replica wants, the one of lowest load priority (`replica_policy.eviction.AccessTracker`,
  0.7 frequency + 0.3 recency over the engine's default window, as the engine's `AdapterUsage`
  gives its device pool), then the least recently released; for a request of priority p (`acquire(...,
  priority=p)`), else a slot without references whose adapter only strictly less urgent requests
  want, the least urgent first (they fetch it again, from host memory). When every slot is
  referenced, `slot_to_preempt(p)` names the adapter whose requests are all strictly less urgent
  than p, with the fewest running: the replica preempts those (recompute) and the slot frees. Both
  choices are the engine's own functions (`replica_policy.slot_urgency`). So an
  urgent request never waits behind less urgent ones for an adapter slot, as it never does for a
  KV slot (`engine.schedule.scheduler` with `engine.adapters.residency`).
* Fetched weights are dropped when the last request that wanted them ends before they got a slot.
* `prefetch` (placement): a fetch into host memory only, as the live replica's `_prefetch` does;
  at most `MAX_PREFETCHES` at once.
* `pin` (a reference policy's placement, `sim.oracle`): the adapter is in a device slot at once (no
  fetch, no load counted: as if placed before the run) and stays there: a pinned slot is never an
  eviction or preemption victim and is not counted free; `unpin` makes it an ordinary slot again.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from lora_cluster.cluster.report_rules import MAX_PREFETCHES
from lora_cluster.config import EngineConfig
from lora_cluster.replica_policy.eviction import AccessTracker
from lora_cluster.replica_policy.slot_urgency import SlotHolder, busy_victim, idle_victim
from lora_cluster.sim.cluster_store import SimClusterTier
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.profile import ReplicaProfile
from lora_cluster.sim.store import NodeStore

READY, PENDING, BLOCKED = 0, 1, 2
PREFETCH_PRIORITY = 1 << 30  # prefetches wait behind every request's fetch


def _engine_default(name: str) -> Any:
    return EngineConfig.model_fields[name].default


class DeviceAdapters:
    def __init__(self, *, max_loras: int, profile: ReplicaProfile, store: NodeStore, loop: EventLoop,
                 sizes: dict[str, int], on_ready: Callable[[], None], on_load: Callable[[str], None],
                 workers: int = 2, cluster: SimClusterTier | None = None, node_id: str = "node"):
        self.max_loras, self.profile, self.store, self.loop = max_loras, profile, store, loop
        self.cluster, self.node_id = cluster, node_id  # the cluster tier, if modelled
        self.sizes, self._on_ready, self._on_load, self.workers = sizes, on_ready, on_load, workers
        self.refs: dict[str, int] = {}  # adapters in device slots -> running requests using them
        self.idle: OrderedDict[str, None] = OrderedDict()  # slots without references, least recent first
        self.active = 0  # adapters with references (distinct adapters in the running batch)
        self.wanted: dict[str, dict[int, int]] = {}  # adapter -> priority -> unfinished requests here
        self.loading: dict[str, bool] = {}  # queued, fetching or fetched (not on the device) -> explicit
        self.fetched: set[str] = set()
        self.pinned: set[str] = set()  # adapters whose slot is never given up (`pin`)
        self._queue: list[tuple[int, int, str]] = []  # (priority, seq, adapter) waiting for a worker
        self._submitted: dict[str, float] = {}  # adapter -> when its fetch was submitted (queued or not)
        self.live_waits, self.live_wait_s, self.live_wait_max_s = 0, 0.0, 0.0  # a request's fetch waits
        self._seq = itertools.count()
        self._busy = 0
        self._prefetches = 0
        self.copy_s = 0.0  # host -> device copies charged to the step being planned
        # the engine's eviction order (`replica_policy.eviction`): its window and hot count at their defaults
        self.tracker = AccessTracker(_engine_default("prefetch_window_s"),
                                     _engine_default("prefetch_min_requests"), loop.clock)

    # ----- requests -------------------------------------------------------------------------

    def request_started(self, adapter_id: str, priority: int = 0) -> bool:
        """A request for `adapter_id` reached the replica; returns whether it is a device hit."""
        self.tracker.record(adapter_id)
        by_priority = self.wanted.setdefault(adapter_id, {})
        by_priority[priority] = by_priority.get(priority, 0) + 1
        if adapter_id in self.refs:
            return True
        if adapter_id not in self.loading:
            self._submit(adapter_id, explicit=False, priority=priority)
        return False

    def request_finished(self, adapter_id: str, priority: int = 0) -> None:
        by_priority = self.wanted[adapter_id]
        by_priority[priority] -= 1
        if not by_priority[priority]:
            del by_priority[priority]
        if by_priority:
            return
        del self.wanted[adapter_id]
        if adapter_id in self.fetched:  # nobody waits for these weights any more
            self.fetched.discard(adapter_id)
            del self.loading[adapter_id]

    def prefetch(self, adapter_id: str) -> None:
        if self._prefetches >= MAX_PREFETCHES or adapter_id in self.refs or adapter_id in self.loading:
            return
        self._prefetches += 1
        self._submit(adapter_id, explicit=True, priority=PREFETCH_PRIORITY)

    def pin(self, adapter_id: str) -> None:
        """Put `adapter_id` in a device slot for good (see the module docstring); raises ValueError
        when it is being fetched or no slot is empty or evictable."""
        if adapter_id in self.pinned:
            return
        if adapter_id not in self.refs:
            if adapter_id in self.loading or not self._make_room(None):
                raise ValueError(f"cannot pin {adapter_id!r}: it is being fetched or no slot is free")
            self.refs[adapter_id] = 0
            self.idle[adapter_id] = None
        self.pinned.add(adapter_id)

    def unpin(self, adapter_id: str) -> None:
        """Let `adapter_id`'s slot be evicted again, like any other."""
        self.pinned.discard(adapter_id)

    # ----- the scheduler's gate -------------------------------------------------------------

    def acquire(self, adapter_id: str, may_claim: bool, priority: int | None = None) -> int:
        refs = self.refs.get(adapter_id)
        if refs is not None:
            if refs == 0:
                del self.idle[adapter_id]
                self.active += 1
            self.refs[adapter_id] = refs + 1
            return READY
        if adapter_id not in self.fetched:
            return PENDING
        if not may_claim or not self._make_room(priority):
            return BLOCKED
        self.fetched.discard(adapter_id)
        del self.loading[adapter_id]
        self.refs[adapter_id] = 1
        self.active += 1
        self.copy_s += self.profile.host_to_device.seconds(self.sizes[adapter_id])
        return READY

    def release(self, adapter_id: str) -> None:
        refs = self.refs[adapter_id] - 1
        self.refs[adapter_id] = refs
        if refs == 0:
            self.active -= 1
            self.idle[adapter_id] = None

    def _make_room(self, priority: int | None) -> bool:
        if len(self.refs) < self.max_loras:
            return True
        pinned = self.pinned
        unwanted = [(self.tracker.priority(a), i, a) for i, a in enumerate(self.idle)
                    if a not in self.wanted and a not in pinned]
        if unwanted:
            victim = min(unwanted)[2]
            del self.idle[victim]
            del self.refs[victim]
            return True
        if priority is None:
            return False
        wanted_victim = idle_victim(self._holders(priority, idle=True), priority)
        if wanted_victim is None:
            return False
        del self.idle[wanted_victim]
        del self.refs[wanted_victim]
        self._submit(wanted_victim, explicit=False, priority=min(self.wanted[wanted_victim]))  # fetched again
        return True

    def slot_to_preempt(self, priority: int) -> str | None:
        """The adapter in a referenced slot that only requests strictly less urgent than `priority`
        want, with the fewest running requests (None: none): the engine's `busy_victim`."""
        return busy_victim(self._holders(priority, idle=False), priority)

    def _holders(self, priority: int, *, idle: bool) -> list[SlotHolder]:
        """The adapters in device slots that some request wants, as `replica_policy.slot_urgency` sees
        them: only those that policy could choose for a request of `priority` (the idle slots, or
        the referenced ones, that only strictly less urgent requests want), so that a step blocked
        on slots builds none of the others."""
        wanted = self.wanted
        slots = ((a, 0) for a in self.idle) if idle else ((a, r) for a, r in self.refs.items() if r)
        pinned = self.pinned
        return [SlotHolder(a, refs, most) for a, refs in slots
                if a in wanted and a not in pinned and (most := min(wanted[a])) > priority]

    # ----- fetches --------------------------------------------------------------------------

    def _submit(self, adapter_id: str, *, explicit: bool, priority: int) -> None:
        self.loading[adapter_id] = explicit
        self._submitted[adapter_id] = self.loop.now
        if self._busy < self.workers:
            self._start(adapter_id)
        else:
            heapq.heappush(self._queue, (priority, next(self._seq), adapter_id))

    def _start(self, adapter_id: str) -> None:
        self._busy += 1
        waited = self.loop.now - self._submitted.pop(adapter_id, self.loop.now)
        if not self.loading.get(adapter_id, True):  # a request's fetch (not a placement prefetch)
            self.live_waits += 1
            self.live_wait_s += waited
            self.live_wait_max_s = max(self.live_wait_max_s, waited)
        tier = self.store.tier(adapter_id)
        nbytes = self.sizes[adapter_id]
        if tier == "host":
            self.store.host.touch(adapter_id)
        if tier == "s3" and self.cluster is not None:  # another node's copy, or S3 (`sim.cluster_store`)
            tier, seconds = self.cluster.start_fetch(self.node_id, adapter_id)
        else:
            seconds = self.profile.fetch_s(tier, nbytes)
        self._on_load(tier)
        self.loop.after(seconds, self._done, adapter_id, tier)

    def _done(self, adapter_id: str, tier: str) -> None:
        self._busy -= 1
        self.store.fetched(adapter_id, self.sizes[adapter_id], tier)
        if self.cluster is not None:
            self.cluster.fetch_done(self.node_id, adapter_id, tier)
        if self.loading.pop(adapter_id, False):
            self._prefetches -= 1
        if adapter_id in self.wanted and adapter_id not in self.refs:
            self.loading[adapter_id] = False
            self.fetched.add(adapter_id)
        while self._queue and self._busy < self.workers:
            self._start(heapq.heappop(self._queue)[2])
        self._on_ready()

    # ----- what reports show ----------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """Slots empty or holding an idle adapter that is not pinned (a new adapter can go there)."""
        if not self.pinned:
            return self.max_loras - self.active
        return self.max_loras - self.active - sum(1 for a in self.pinned if not self.refs[a])

    @property
    def empty_slots(self) -> int:
        """Slots neither holding nor about to hold an adapter."""
        return max(0, self.max_loras - len(self.refs) - len(self.loading))

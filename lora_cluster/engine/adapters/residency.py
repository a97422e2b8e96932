"""Getting a request's adapter onto the device without ever blocking the step loop.

The engine's scheduler asks `acquire(seq, may_claim_slot)` for each waiting sequence:

- base-model sequences and adapters whose current version is in a device slot are READY (a
  reference is taken);
- otherwise the adapter's host weights are fetched from the weight source on a few workers (`fetch_queue`:
  one fetch per adapter however many sequences wait for it, most urgent request first, prefetches
  last) and the sequence is PENDING meanwhile;
- once fetched, the weights go into a free or evictable slot (READY), or the sequence is BLOCKED
  while every slot is held by running sequences or kept for queued requests (or while an earlier
  sequence is blocked);
- a failed fetch fails every sequence waiting for that adapter in the same step (FAILED, with
  the adapter's error); the next request for it tries again;
- adapter protection (`guard` enabled, docs/serving.md#adapter-protection) chooses and never idles:
  fetched weights are placed at once into a free slot or one whose adapter no request wants. It
  chooses the victim (idle one-offs before adapters with repeated demand, `demand`), the
  order and number of cold loads (a one-off's fetch queues behind repeated adapters' fetches of the
  same priority; while the replica thrashes (`guard.miss_penalty() > 0`), at most `workers - 1`
  one-off fetches run at once, so a repeated adapter's reload always finds a worker), and holds a
  one-off whose placement would evict an adapter with repeated demand while a one-off's slot frees
  anyway (its requests all run), for at most `HOLD_SHARE` of its class's adapter wait bound and
  `HOLD_LOADS` measured load times (never longer than the reload it saves is worth; PENDING: the
  others go on, the batch runs). The switch rate and load latency are alerts
  (`guard`), fed with every placement;
- weights of at least `adapter_async_copy_bytes` are copied into their reserved slot off the step
  thread (`copier`): the sequence is PENDING until the copy is committed.

Rotation (`rotation`, when given): after each step the waiting queue is planned. Adapters
with an unfinished request keep their slot (the pool's victim policy becomes a
`RotationSlotPolicy`), except *draining* ones: their new requests are PENDING (not admitted), and
once their running requests finish their slot goes to an adapter past its fairness bound. The next
adapters of the waiting queue are prefetched: their host fetch runs and, once fetched, they are
copied into a free or idle slot while the batch runs.

Urgency (`urgency`): a sequence that would be BLOCKED takes an idle slot whose adapter only
strictly less urgent requests want (its fetch is queued again), and `slot_to_preempt` names the slot
whose running sequences the scheduler preempts for it. Pinned adapters (`pinned`) are never taken.

Versions: the source's `version(adapter_id)` changes when what the id names changes (re-registered,
unregistered). A slot or a finished fetch of an older version is never used for a new request: an
idle stale slot is evicted, a busy one retired (its running sequences finish on the old weights),
and the fetch is started again.

Bounds: this object holds host weights outside the store's byte budgets only while a request
waits for them. A fetch is kept while an unfinished request of its adapter exists or an explicit
`start_load` awaits it; when the last request of an adapter goes away, a queued fetch is cancelled
and a finished one dropped (the hooks are told with `load_abandoned`, so the store's host tier accounts for
the copy again). Every structure here is keyed by adapters of unfinished requests or of fetches in
flight, never by every id a client ever asked for.

Collaborators (`store.ports`): a `WeightSource` (`load`, `version`) and the store's `ResidencyHooks`
(`request_started`, `request_finished`, `load_abandoned`), usually one store wired twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.engine.adapters.copier import AdapterCopier
from lora_cluster.engine.adapters.demand import DemandTracker
from lora_cluster.engine.adapters.fetch_queue import PREFETCH, FetchQueue
from lora_cluster.engine.adapters.guard import AdapterGuard
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.adapters.rotation import AdapterRotation, Resident, RotationSlotPolicy
from lora_cluster.engine.schedule.counters import EngineCounters
from lora_cluster.engine.schedule.scheduler import Gate
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.engine.schedule.step_meter import StepMeter
from lora_cluster.errors import AdapterError, EngineOverloadedError
from lora_cluster.replica_policy.slot_urgency import SlotHolder, busy_victim, idle_victim
from lora_cluster.store.ports import ResidencyHooks, WeightSource

log = logging.getLogger(__name__)
MAX_QUEUED_PREFETCHES = 64  # prefetches (start_load, rotation) waiting for a loader worker at once
HOLD_SHARE = 0.25  # share of a class's adapter wait bound a one-off may be held to spare a repeated adapter
HOLD_LOADS = 2.0  # ... and at most this many of this replica's measured load times


class AdapterResidency:
    def __init__(self, source: WeightSource, hooks: ResidencyHooks, pool: AdapterPool, workers: int,
                 guard: AdapterGuard | None = None, *, rotation: AdapterRotation | None = None,
                 copier: AdapterCopier | None = None, pinned: Iterable[str] = (),
                 counters: EngineCounters | None = None, meter: StepMeter | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.source, self.hooks, self.pool, self.guard = source, hooks, pool, guard
        self.protect = guard is not None and guard.enabled  # the choices of the module docstring
        self._clock = clock
        self.demand = DemandTracker(clock=clock)
        self.counters = counters or EngineCounters()  # placements and switches, for metrics
        self.meter = meter or StepMeter()  # load time charged to the adapter that needed it
        self.rotation, self._pinned = rotation, frozenset(pinned)
        self.copier = copier or AdapterCopier.inline(pool)
        self._draining: frozenset[str] = frozenset()
        self._queue = FetchQueue(workers, max_prefetches=MAX_QUEUED_PREFETCHES)
        self._thrash_cold_limit = max(1, workers - 1)  # one-off fetches at once while thrashing
        self._fetch_s: dict[str, float] = {}  # seconds of each finished fetch (written by the workers)
        self._fetch_s_lock = threading.Lock()  # the workers write `_fetch_s` while the step loop reads it
        self._loads: dict[str, Future[LoraWeights]] = {}  # host fetches in flight or done, not yet on device
        self._requests: dict[str, dict[int, int]] = {}  # adapter -> priority -> unfinished requests
        self._explicit: set[str] = set()  # fetches started by `start_load` (an admin call awaits them)
        self._failed: dict[str, AdapterError] = {}  # failures seen during the current step
        if rotation is not None:
            pool.policy = RotationSlotPolicy(pool.policy, rotation, self._requests.__contains__,
                                             self._draining_now,
                                             demand=self.demand.repeated if self.protect else None)

    # ----- fetches --------------------------------------------------------------------------

    def fetch(self, adapter_id: str, priority: int = PREFETCH) -> Future[LoraWeights]:
        """The adapter's host fetch of its current version, queued now at `priority` (a request's, or
        `PREFETCH`) unless one is in flight or done; a queued one moves up to `priority` if more urgent."""
        future = self._loads.get(adapter_id)
        if future is not None and self._is_stale(adapter_id, future):
            future = None
        cold = self.protect and priority < PREFETCH and not self.demand.repeated(adapter_id)
        if future is None:
            future = self._queue.submit(self._timed_load, adapter_id, priority, cold=cold)
            self._loads[adapter_id] = future
        elif not future.done():
            self._queue.raise_priority(future, priority, cold=cold)
        return future

    def _timed_load(self, adapter_id: str) -> LoraWeights:
        """`source.load` on a worker, its duration kept for the thrash meter."""
        start = time.perf_counter()
        weights = self.source.load(adapter_id)
        with self._fetch_s_lock:
            self._fetch_s[adapter_id] = time.perf_counter() - start
        return weights

    def start_load(self, adapter_id: str) -> Future[LoraWeights]:
        """`fetch` for a caller that awaits the result without a request (kept until the next step),
        queued as a prefetch; EngineOverloadedError when too many prefetches wait already."""
        future = self.fetch(adapter_id)
        self._explicit.add(adapter_id)
        return future

    def most_urgent(self, adapter_id: str) -> int:
        """The priority of the most urgent unfinished request of the adapter (`PREFETCH`: none)."""
        wanted = self._requests.get(adapter_id)
        return min(wanted) if wanted else PREFETCH

    def _is_stale(self, adapter_id: str, future: Future[LoraWeights]) -> bool:
        if not future.done() or future.exception() is not None:
            return False
        return future.result().version != self.source.version(adapter_id)

    def forget_failed(self, adapter_id: str) -> None:
        """Drop a failed fetch so that the next request retries it."""
        future = self._loads.get(adapter_id)
        if future is not None and future.done() and future.exception() is not None:
            del self._loads[adapter_id]

    # ----- scheduler callbacks --------------------------------------------------------------

    def acquire(self, seq: Sequence, may_claim_slot: bool) -> Gate:
        aid = seq.adapter_id
        if aid is None:
            seq.lora_slot = -1
            return Gate.READY
        if self.copier.copying(aid):
            self._settle_copies()
            if self.copier.copying(aid):
                return Gate.PENDING
        if self.pool.slot_of(aid) is not None:
            if self.pool.version_of(aid) == self.source.version(aid):
                if aid in self._draining:
                    return Gate.PENDING  # its slot is being handed over; it comes back in its turn
                seq.lora_slot = self.pool.acquire(aid)
                return Gate.READY
            self._drop_stale_slot(aid)
        if aid in self._failed:
            seq.error = self._failed[aid]
            return Gate.FAILED
        future = self.fetch(aid, seq.priority)
        if not future.done():
            return Gate.PENDING
        try:
            weights = future.result()
        except AdapterError as e:
            del self._loads[aid]
            self._failed[aid] = seq.error = e
            return Gate.FAILED
        except Exception as e:  # a loader bug must fail this adapter, not the engine
            del self._loads[aid]
            log.error("the loader failed on adapter %r", aid, exc_info=e)
            self._failed[aid] = seq.error = AdapterError(aid, f"loading failed ({type(e).__name__})")
            return Gate.FAILED
        if not may_claim_slot:
            return Gate.BLOCKED
        if not self.pool.can_allocate() and not self._evict_for(seq.priority):
            return Gate.BLOCKED
        if self._holds(seq):
            return Gate.PENDING  # spares a repeated adapter while a slot frees anyway; the others go on
        self._place(weights)
        del self._loads[aid]
        self._explicit.discard(aid)
        if self.copier.copying(aid):
            return Gate.PENDING  # copied off the step thread; live once `end_step` commits it
        seq.lora_slot = self.pool.acquire(aid)
        return Gate.READY

    def _holders(self) -> list[SlotHolder]:
        """Adapters in device slots that a more urgent request may take (`urgency`)."""
        return [SlotHolder(a, self.pool.refs(a), self.most_urgent(a)) for a in self.pool.resident()
                if a in self._requests and a not in self._pinned and not self.copier.copying(a)]

    def _evict_for(self, priority: int) -> bool:
        """Evict the idle slot `idle_victim` names for a sequence of `priority`; its adapter's fetch is
        queued again for the requests that want it (back to the fetch path, not stuck)."""
        victim = idle_victim(self._holders(), priority)
        if victim is None or not self.pool.evict(victim):
            return False
        self.counters.slot_taken()
        self.fetch(victim, self.most_urgent(victim))
        return True

    def slot_to_preempt(self, priority: int) -> int | None:
        """The device slot (`busy_victim`) whose running sequences the scheduler may preempt for a
        sequence of `priority`; `acquire` then evicts it. None when there is none."""
        victim = busy_victim(self._holders(), priority)
        return None if victim is None else self.pool.slot_of(victim)

    def hold_bound(self, priority: int) -> float:
        """Seconds a one-off request of `priority` may be held to spare an adapter with repeated
        demand: `HOLD_SHARE` of its class's adapter wait bound, and at most `HOLD_LOADS` measured
        load times (the reload the hold saves); 0 without rotation or before any load was measured."""
        if self.rotation is None or self.guard is None:
            return 0.0
        saved = HOLD_LOADS * self.guard.thrash.load_time_s
        return min(HOLD_SHARE * self.rotation.wait_bound(priority), saved)

    def _holds(self, seq: Sequence) -> bool:
        """Whether to hold `seq` (a one-off) rather than evict an idle adapter with repeated demand:
        only while the slot of a busy one-off that no waiting request wants frees anyway, and within
        `hold_bound`. A free slot or an idle one-off's slot is always taken at once."""
        if seq.adapter_id is None or not self._would_evict_repeated(seq.adapter_id):
            return False
        if self._clock() - seq.arrival >= self.hold_bound(seq.priority):
            return False
        return any(self.pool.refs(a) > 0 and not self.demand.repeated(a)
                   and sum(self._requests.get(a, {}).values()) <= self.pool.refs(a)
                   for a in self.pool.resident())

    def _would_evict_repeated(self, adapter_id: str) -> bool:
        """Protection on, `adapter_id` is a one-off and placing it now would evict an adapter with
        repeated demand."""
        if not self.protect or self.demand.repeated(adapter_id):
            return False
        victim = self.pool.next_victim()
        return victim is not None and self.demand.repeated(victim)

    def _place(self, weights: LoraWeights) -> None:
        """Put fetched weights into a slot; the placement feeds the alerts and the thrash meter."""
        evicts = len(self.pool.resident()) >= self.pool.num_slots
        start = time.perf_counter()
        self._copy(weights)
        copy_s = time.perf_counter() - start
        with self._fetch_s_lock:
            fetch_s = self._fetch_s.pop(weights.adapter_id, 0.0)
        self.meter.loaded(weights.adapter_id, fetch_s + copy_s)
        if self.guard is not None:
            self.guard.placed(copy_s, evicts, fetch_s)

    def _copy(self, weights: LoraWeights) -> None:
        """`copier.place(weights)`, counted in `counters` (a switch when it takes another adapter's slot)."""
        evicts = len(self.pool.resident()) >= self.pool.num_slots
        start = time.perf_counter()
        try:
            self.copier.place(weights)
        except BaseException:
            self.counters.placement_failed()
            raise
        self.counters.placed(time.perf_counter() - start, evicted=evicts)

    def release(self, seq: Sequence) -> None:
        if seq.adapter_id is not None and seq.lora_slot >= 0:
            self.pool.release(seq.lora_slot)
            seq.lora_slot = -1

    def _drop_stale_slot(self, adapter_id: str) -> None:
        if not self.pool.evict(adapter_id):
            self.pool.retire(adapter_id)

    # ----- request bookkeeping --------------------------------------------------------------

    def request_started(self, adapter_id: str | None, priority: int = 0) -> None:
        """A request of `priority` for `adapter_id` was queued: queue its fetch at that priority
        unless its current version is resident."""
        if adapter_id is None:
            return
        wanted = self._requests.setdefault(adapter_id, {})
        wanted[priority] = wanted.get(priority, 0) + 1
        self.demand.record(adapter_id)
        self.hooks.request_started(adapter_id)
        if self.pool.version_of(adapter_id) != self.source.version(adapter_id):
            self.fetch(adapter_id, priority)

    def request_finished(self, adapter_id: str | None, priority: int = 0) -> None:
        """Once per `request_started` (same priority); the last request gone, its fetch is let go."""
        if adapter_id is None:
            return
        wanted = self._requests.get(adapter_id, {})
        n = wanted.get(priority, 0) - 1
        if n > 0:
            wanted[priority] = n
        else:
            wanted.pop(priority, None)
        if not wanted:
            self._requests.pop(adapter_id, None)
            self._let_go(adapter_id)
        self.hooks.request_finished(adapter_id)

    def _let_go(self, adapter_id: str) -> None:
        """Drop a fetch nobody waits for: cancel it if still queued, hand finished weights back."""
        if adapter_id in self._requests or adapter_id in self._explicit:
            return
        future = self._loads.get(adapter_id)
        if future is None:
            return
        if not future.done() and not self._queue.cancel(future):
            return  # running now: dropped by `end_step` once it finishes
        del self._loads[adapter_id]
        if not future.cancelled() and future.exception() is None:
            self.hooks.load_abandoned(adapter_id)

    def end_step(self, waiting: Iterable[Sequence] = ()) -> None:
        """Forget this step's failures, commit finished device copies, let go of finished fetches
        that nobody waits for, then plan rotation over `waiting` (the queue, in urgency order)."""
        self._failed.clear()
        self._settle_copies()
        self._explicit = {a for a in self._explicit if a in self._loads and not self._loads[a].done()}
        with self._fetch_s_lock:
            for adapter_id in [a for a in self._fetch_s if a not in self._loads]:
                del self._fetch_s[adapter_id]
        for adapter_id in [a for a, f in self._loads.items() if f.done()]:
            self._let_go(adapter_id)
        if self.rotation is not None:
            self._rotate(waiting)
        if self.protect:
            assert self.guard is not None
            thrashing = self.guard.miss_penalty() > 0
            self._queue.limit_cold(self._thrash_cold_limit if thrashing else None)

    def _settle_copies(self) -> None:
        for adapter_id, error in self.copier.settle().items():
            log.error("copying adapter %r to the device failed", adapter_id, exc_info=error)
            reason = f"copy to the device failed ({type(error).__name__})"
            self._failed[adapter_id] = AdapterError(adapter_id, reason)

    def _draining_now(self, adapter_id: str) -> bool:
        return adapter_id in self._draining

    def _rotate(self, waiting: Iterable[Sequence]) -> None:
        """One rotation plan (O(waiting + slots)): drains, and device prefetch of the next adapters."""
        assert self.rotation is not None
        resident = {a: Resident(busy=self.pool.refs(a) > 0, pinned=a in self._pinned)
                    for a in self.pool.resident()}
        self.rotation.ran(a for a, r in resident.items() if r.busy and not self.copier.copying(a))
        held_idle = sum(1 for a, r in resident.items()
                        if not r.busy and (r.pinned or a in self._requests) and a not in self._draining)
        plan = self.rotation.plan(waiting, resident, self.pool.num_free - held_idle)
        self._draining = plan.draining
        for adapter_id in plan.prefetch:
            self._prefetch(adapter_id)

    def _prefetch(self, adapter_id: str) -> None:
        """Copy a fetched adapter into a free or idle slot now, ahead of its request's admission."""
        if self.pool.slot_of(adapter_id) is not None or self.copier.copying(adapter_id):
            return
        try:
            future = self.fetch(adapter_id)  # queued as a prefetch unless its requests' fetch exists
        except EngineOverloadedError:
            return  # enough prefetches wait already: its requests' own fetch brings it
        if not future.done() or future.exception() is not None or not self.pool.can_allocate():
            return
        if self._would_evict_repeated(adapter_id):
            return  # speculative: its request's own placement decides (`_holds`)
        self._place(future.result())
        del self._loads[adapter_id]
        self._explicit.discard(adapter_id)

    # ----- queries and commands -------------------------------------------------------------

    def unload(self, adapter_id: str) -> bool:
        """Drop an adapter's pending host copy and device slot; False when a sequence uses it."""
        if adapter_id not in self._requests:
            future = self._loads.pop(adapter_id, None)
            if future is not None:
                self._queue.cancel(future)
        if self.pool.refs(adapter_id) or self.copier.copying(adapter_id):
            return False
        self.pool.evict(adapter_id)
        return True

    def pending(self) -> list[Future]:
        """Host fetches and device copies in flight (an idle step waits for one of them)."""
        return [f for f in self._loads.values() if not f.done()] + self.copier.pending()

    def has_fetches(self) -> bool:
        """Fetches in flight or finished and not yet placed or let go, or device copies to commit."""
        return bool(self._loads) or bool(self.copier.in_flight())

    def loading(self) -> tuple[str, ...]:
        return tuple(a for a, f in self._loads.items() if not f.done()) + self.copier.in_flight()

    def live_fetches(self) -> int:
        """Request fetches queued or running on the loader workers now (thread-safe, `FetchQueue.live`)."""
        return self._queue.live()

    def held(self) -> int:
        """Fetches this object holds (in flight or finished, not yet on the device or let go)."""
        return len(self._loads)

    def close(self) -> None:
        self._queue.close()
        self.copier.close()

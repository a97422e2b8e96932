"""One simulated LoRA replica: the engine's continuous batching, event by event.

The schedule follows `engine.schedule.scheduler` step for step:

1. every running sequence past its prefill decodes one token;
2. running sequences still in their prefill get the next chunk of the step's token budget, most
   urgent first; one less urgent than the most urgent waiting request only after the waiting
   requests were admitted (`replica_policy.prefill_plan`);
3. waiting sequences are admitted in (priority, arrival) order while a KV slot and budget remain
   and their adapter is READY (`adapters.DeviceAdapters.acquire`); once one is BLOCKED, later
   ones may not claim a new adapter slot; when no KV slot is free, the least urgent running
   sequence is preempted for a strictly more urgent one (recompute: it returns to the waiting
   queue and re-prefills its prompt and the tokens it had produced); when no adapter slot is free,
   the running sequences of an adapter that only strictly less urgent requests want are
   preempted the same way, and its slot goes to the urgent request; either only once the waiting
   request's patience has run out (`preempt_patience` times its class's TTFT target from its arrival
   here, as the live replica passes it to the engine; until then it waits for a slot to free);
4. a step that carries the prefill chunk of an urgent request (`prefill_plan.URGENT_PRIORITY`)
   carries no less urgent one (they continue at the next step). The engine's
   `less_urgent_prefill_chunk` is not modelled: it is off by default.

A step takes `profile.step_s(prefill tokens, decode tokens, distinct adapters)` plus the host ->
device copies of adapters placed in it. The step that completes a prefill samples a token (the
first token, for a new request). Time jumps: while the batch is decode-only and nothing changes,
the k steps until the next sequence finishes are one event; an arrival or a finished fetch cuts
such a run at the next step boundary (where the real engine would next schedule). Invariants: a
request is in exactly one of `waiting` and `running` until it finishes; `kv_free + len(running)`
is `max_num_seqs`; `ongoing` is `len(waiting) + len(running)`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable

from lora_cluster.cluster.prefix_keys import PrefixSummary
from lora_cluster.cluster.report_rules import AdapterDemand, ServiceTime, projected_batch
from lora_cluster.cluster.reports import MAX_REPORTED_HOST, ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import EngineConfig
from lora_cluster.replica_policy.prefill_plan import URGENT_PRIORITY
from lora_cluster.sim.adapters import BLOCKED, READY, DeviceAdapters
from lora_cluster.sim.cluster_store import SimClusterTier
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.prefix_cache import SimPrefixCache
from lora_cluster.sim.profile import ReplicaProfile
from lora_cluster.sim.store import NodeStore
from lora_cluster.sim.workload import SimRequest

PREEMPT_PATIENCE: float = EngineConfig.model_fields["preempt_patience"].default


def _urgency(req: SimRequest) -> tuple[int, int]:
    return req.priority, req.order


class SimReplica:
    def __init__(self, replica_id: str, *, profile: ReplicaProfile, max_num_seqs: int, max_loras: int,
                 loop: EventLoop, sizes: dict[str, int], on_finish: Callable[[SimReplica, SimRequest], None],
                 on_load: Callable[[str], None],
                 on_first_token: Callable[[SimReplica, SimRequest], None] | None = None,
                 on_plan: Callable[[SimReplica], None] | None = None, base: str = "base",
                 prefix_cache: SimPrefixCache | None = None, preempt_patience: float = PREEMPT_PATIENCE,
                 cluster: SimClusterTier | None = None,
                 on_miss: Callable[[SimReplica, SimRequest], None] | None = None):
        self.replica_id, self.node_id = replica_id, f"node-{replica_id}"
        self.base = base  # the API name of the base model it serves, reported as a live replica does
        self.profile, self.loop, self.max_num_seqs = profile, loop, max_num_seqs
        self.budget = profile.max_num_batched_tokens
        self._on_finish, self._on_first_token, self._on_plan = on_finish, on_first_token, on_plan
        self._on_miss = on_miss  # told of each request that reaches it without its adapter in a slot here
        self.store = store = NodeStore(host_bytes=profile.host_cache_bytes,
                                       disk_bytes=profile.disk_cache_bytes)
        self.cluster = cluster  # the cluster tier and prefetch (`sim.cluster_store`), if modelled
        if cluster is not None:
            cluster.register(self.node_id, store)
        self.adapters = DeviceAdapters(max_loras=max_loras, profile=profile, store=store, loop=loop,
                                       sizes=sizes, on_ready=self._kick_now, on_load=on_load,
                                       cluster=cluster, node_id=self.node_id)
        self.waiting: list[SimRequest] = []
        self.running: dict[int, SimRequest] = {}
        self._least: SimRequest | None = None  # the least urgent of `running` (None: to find again)
        self.prefilling: list[SimRequest] = []
        self.kv_free = max_num_seqs
        self.n_decoding = 0
        self.decode_steps = 0  # decode steps run since the start (a decoding request ends at its mark)
        self._finishes: list[tuple[int, int, int, SimRequest]] = []
        self.running_by_priority: dict[int, int] = {}
        self.ongoing = 0
        self.demand = AdapterDemand()
        self.service_time = ServiceTime()
        self.preemptions = 0
        self._orders = itertools.count()
        self._busy = self._in_end = False
        self._version, self._start, self._step_s, self._steps = 0, 0.0, 0.0, 0
        self._chunks: list[tuple[SimRequest, int]] = []
        self.prefix_cache = prefix_cache  # None: the engine's prefix cache is off (`sim.prefix_cache`)
        self.prefixes = PrefixSummary()  # prompt prefixes run here lately, reported as a live replica does
        self.preempt_patience = preempt_patience  # `EngineConfig.preempt_patience`, as the live replica
        self._patience_due = math.inf  # the earliest wake-up set for a waiting request's patience to end

    # ----- requests in ----------------------------------------------------------------------

    def add(self, req: SimRequest, now: float) -> None:
        req.order, req.replica, req.reached_at = next(self._orders), self.replica_id, now
        req.preempt_at = now + req.sla.preempt_after_s(self.preempt_patience)
        req.joined = req.adapter in self.adapters.loading
        req.hit = self.adapters.request_started(req.adapter, req.priority)
        if not req.hit and req.adapter is not None and self._on_miss is not None:
            self._on_miss(self, req)
        self.demand.record(req.adapter)
        if self.cluster is not None:  # what the live replica reports as `adapter_requests`
            self.cluster.observe(req.adapter)
        if self.prefix_cache is not None:  # as the live replica: with the prefix cache on
            self.prefixes.record(req.prefix)
        self.ongoing += 1
        bisect.insort(self.waiting, req, key=_urgency)
        self._kick(now)

    def prefetch(self, adapter_id: str) -> None:
        self.adapters.prefetch(adapter_id)

    def pin(self, adapter_id: str) -> None:
        """Keep `adapter_id` in a device slot for good, from now (`DeviceAdapters.pin`: a reference
        policy's placement); ValueError when no slot is free for it."""
        self.adapters.pin(adapter_id)

    def unpin(self, adapter_id: str) -> None:
        self.adapters.unpin(adapter_id)

    def preload(self, adapter_ids: list[str]) -> None:
        """Start as after the engine's `preload` setting fetched `adapter_ids` (see `NodeStore.preload`)."""
        self.store.preload(adapter_ids, self.adapters.sizes)
        if self.cluster is not None:
            self.cluster.preloaded(self.node_id, adapter_ids)

    def _kick_now(self) -> None:
        self._kick(self.loop.now)

    def _kick(self, now: float) -> None:
        """Something changed: schedule now if idle, else cut a multi-step run at the next boundary."""
        if self._in_end:
            return
        if not self._busy:
            self._busy = True
            self._plan(now)
            return
        if self._steps > 1:
            steps = int((now - self._start) / self._step_s) + 1
            if steps < self._steps:
                self._steps = steps
                self._version += 1
                self.loop.at(self._start + steps * self._step_s, self._end, self._version)

    # ----- the schedule ---------------------------------------------------------------------

    def _plan(self, now: float) -> None:
        budget = self.budget - self.n_decoding
        chunks: list[tuple[SimRequest, int]] = []
        head = self.waiting[0] if self.waiting else None
        deferred: list[SimRequest] = []
        for r in sorted(self.prefilling, key=_urgency):  # most urgent first (`replica_policy.prefill_plan`)
            if head is not None and r.priority > URGENT_PRIORITY and _urgency(head) < _urgency(r):
                deferred.append(r)  # after the more urgent waiting requests are admitted
            elif budget > 0:
                n = min(r.prefill_left, budget)
                chunks.append((r, n))
                budget -= n
        adapters = self.adapters
        adapters.copy_s = 0.0
        if self.waiting:
            budget = self._admit(chunks, budget)
        for r in deferred:
            if r.rid in self.running and budget > 0:
                n = min(r.prefill_left, budget)
                chunks.append((r, n))
                budget -= n
        if any(r.priority <= URGENT_PRIORITY for r, _ in chunks):  # an urgent prompt goes alone
            chunks = [(r, n) for r, n in chunks if r.priority <= URGENT_PRIORITY]
        if self._on_plan is not None:  # the step's admission is done (`AdmissionWindow.observe`)
            self._on_plan(self)
        if not chunks and not self.n_decoding:
            self._busy = False
            return
        steps = 1 if chunks else self._next_finish() - self.decode_steps
        prefill = sum(n for _, n in chunks)
        self._chunks, self._steps, self._start = chunks, steps, now
        self._step_s = self.profile.step_s(prefill, self.n_decoding, adapters.active) + adapters.copy_s
        self._version += 1
        self.loop.at(now + steps * self._step_s, self._end, self._version)

    def _admit(self, chunks: list[tuple[SimRequest, int]], budget: int) -> int:
        """Admit waiting requests into this step (see the module docstring); returns the budget left."""
        blocked = False
        keep: list[SimRequest] = []
        preempted: list[SimRequest] = []
        waiting = self.waiting
        now = self.loop.now
        for i, req in enumerate(waiting):
            victim, refund = None, 0
            patient = now < req.preempt_at
            if not self.kv_free:
                victim = None if patient else self._victim(req.priority)
                if victim is None:
                    if patient and self._victim(req.priority) is not None:
                        self._wake_at(req.preempt_at)
                    keep.extend(waiting[i:])
                    break
                refund = 1 if victim.finish_mark >= 0 else next((n for r, n in chunks if r is victim), 0)
            if budget + refund <= 0:
                keep.extend(waiting[i:])
                break
            gate = self.adapters.acquire(req.adapter, not blocked, req.priority)
            if gate == BLOCKED and not blocked and patient:
                self._wake_at(req.preempt_at)
            elif gate == BLOCKED and not blocked:
                freed = self._free_adapter_slot(req.priority, chunks, preempted)
                if freed is not None:  # the preempted sequences also gave back their KV slots
                    budget += freed
                    victim, refund = None, 0
                    gate = self.adapters.acquire(req.adapter, True, req.priority)
            if gate != READY:
                blocked = blocked or gate == BLOCKED
                keep.append(req)
                continue
            if victim is not None:
                budget += refund
                if victim.finish_mark < 0:
                    chunks[:] = [(r, n) for r, n in chunks if r is not victim]
                self._preempt(victim)
                preempted.append(victim)
            self.kv_free -= 1
            self.running[req.rid] = req
            if req.admitted_at is None:
                req.admitted_at = self.loop.now
            self._least = None
            self.prefilling.append(req)
            self.running_by_priority[req.priority] = self.running_by_priority.get(req.priority, 0) + 1
            if self.prefix_cache is not None:
                self.prefix_cache.admit(req)  # its cached prefix is not computed again
            n = min(req.prefill_left, budget)
            chunks.append((req, n))
            budget -= n
        self.waiting = keep
        for req in preempted:
            bisect.insort(self.waiting, req, key=_urgency)
        return budget

    def _wake_at(self, when: float) -> None:
        """Plan again at `when`, when a waiting request's patience ends (it may then preempt): cuts a
        multi-step run as an arrival does. One wake-up at a time, the earliest."""
        if when < self._patience_due:
            self._patience_due = when
            self.loop.at(when, self._patience_ended)

    def _patience_ended(self) -> None:
        self._patience_due = math.inf
        self._kick_now()

    def _free_adapter_slot(self, priority: int, chunks: list[tuple[SimRequest, int]],
                           preempted: list[SimRequest]) -> int | None:
        """Preempt the running requests of the adapter `slot_to_preempt(priority)` names (all less
        urgent than `priority`), so that its slot can go to a more urgent request; returns the step
        budget they gave back (None: no such adapter, nothing preempted)."""
        adapter_id = self.adapters.slot_to_preempt(priority)
        if adapter_id is None:
            return None
        refund = 0
        for victim in [r for r in self.running.values() if r.adapter == adapter_id]:
            if victim.finish_mark >= 0:
                refund += 1
            else:
                refund += next((n for r, n in chunks if r is victim), 0)
                chunks[:] = [(r, n) for r, n in chunks if r is not victim]
            self._preempt(victim)
            preempted.append(victim)
        return refund

    def _victim(self, priority: int) -> SimRequest | None:
        """The least urgent running request if it is strictly less urgent than `priority`."""
        if max((p for p, n in self.running_by_priority.items() if n), default=priority) <= priority:
            return None
        if self._least is None:  # kept until `running` changes: a step asks once per waiting request
            self._least = max(self.running.values(), key=_urgency)
        victim = self._least
        return victim if victim.priority > priority else None

    def _preempt(self, req: SimRequest) -> None:
        self._leave_running(req)
        if req.finish_mark >= 0:
            req.generated = req.output - (req.finish_mark - self.decode_steps)
            req.finish_mark = -1
            self.n_decoding -= 1
        else:
            self.prefilling.remove(req)
        if self.prefix_cache is not None:  # what it computed stays cached for its re-admission
            self.prefix_cache.release(req, req.prompt + req.generated - max(req.prefill_left, 1))
        req.prefill_left = req.prompt + req.generated
        req.preemptions += 1
        self.preemptions += 1

    def _leave_running(self, req: SimRequest) -> None:
        del self.running[req.rid]
        self._least = None
        self.kv_free += 1
        self.running_by_priority[req.priority] -= 1
        self.adapters.release(req.adapter)

    def _next_finish(self) -> int:
        heap = self._finishes
        while heap[0][3].finish_mark != heap[0][0] or heap[0][3].preemptions != heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0]

    def _end(self, version: int) -> None:
        if version != self._version:
            return
        now = self.loop.now
        self._in_end = True
        self.decode_steps += self._steps
        for r, n in self._chunks:
            r.prefill_left -= n
            if r.prefill_left:
                continue
            self.prefilling.remove(r)
            if self.prefix_cache is not None:
                self.prefix_cache.computed(r, r.prompt + r.generated)
            r.generated += 1
            if r.first_token_at is None:
                r.first_token_at = now
                if self._on_first_token is not None:
                    self._on_first_token(self, r)
            left = r.output - r.generated
            if left <= 0:
                self._finish(r, now)
            else:
                r.finish_mark = self.decode_steps + left
                heapq.heappush(self._finishes, (r.finish_mark, r.order, r.preemptions, r))
                self.n_decoding += 1
        heap = self._finishes
        while heap and heap[0][0] <= self.decode_steps:
            mark, _, preemptions, r = heapq.heappop(heap)
            if r.finish_mark == mark and r.preemptions == preemptions:
                self.n_decoding -= 1
                self._finish(r, now)
        self._in_end = False
        self._plan(now)

    def _finish(self, req: SimRequest, now: float) -> None:
        self._leave_running(req)
        req.finish_mark = -1
        req.finish_at = now
        if self.prefix_cache is not None:
            self.prefix_cache.release(req, req.prompt + req.output - 1)
        self.ongoing -= 1
        self.adapters.request_finished(req.adapter, req.priority)
        self.service_time.record(now - req.reached_at)
        self._on_finish(self, req)

    # ----- what it reports ------------------------------------------------------------------

    def routing_stats(self) -> RoutingStats:
        """What `record_routing_stats` reports, as far as the request router reads it."""
        a = self.adapters
        return RoutingStats(resident=tuple(a.refs), loading=tuple(a.loading),
                            empty_adapter_slots=a.empty_slots, free_adapter_slots=a.free_slots,
                            max_loras=a.max_loras,
                            num_running=len(self.running), num_waiting=len(self.waiting),
                            max_num_seqs=self.max_num_seqs, base=self.base, prefixes=self.prefixes.keys(),
                            host_held=self.store.host.recent(MAX_REPORTED_HOST))

    def report(self, capacity: int, now: float, arrived_tickets: tuple[str, ...] = ()) -> ReplicaReport:
        """The controller report (`serve.replica.report.build_report` without memory and class stats,
        with its host tier's most recently used adapters and the cluster tier's copies on its node;
        the batch per priority as `projected_batch` gives it);
        `active` (generate calls in progress) is the ongoing count."""
        a = self.adapters
        return ReplicaReport(
            replica_id=self.replica_id, node_id=self.node_id, capacity=capacity,
            max_num_seqs=self.max_num_seqs,
            max_loras=a.max_loras, running=len(self.running), waiting=len(self.waiting),
            free_adapter_slots=a.free_slots, resident=tuple(a.refs), loading=tuple(a.loading),
            running_by_priority=projected_batch({p: n for p, n in self.running_by_priority.items() if n},
                                                dict(Counter(r.priority for r in self.waiting)),
                                                self.max_num_seqs),
            adapter_requests=self.demand.take(), service_time_s=self.service_time.mean, sent_at=now,
            active=self.ongoing, arrived_tickets=arrived_tickets, base=self.base,
            prefixes=self.prefixes.keys(), host_held=self.store.host.recent(MAX_REPORTED_HOST),
            cluster_held=() if self.cluster is None else self.cluster.held_on(self.node_id))

"""An oracle-placement yardstick (`--policy oracle`) with perfect knowledge of adapter popularity, NOT a
shipped policy.

It answers "how good could placement be?" for a run: it is given the workload's true popularity
(`SimContext.demand`, `context.TrueDemand`: each adapter's share of the offered requests, the offered
rate and a request's expected slot hold), which no live policy knows, and places the adapters once,
before the first request, the way the pinned-slot bound (`sim.slot_bound`) counts them. Compare
`lora-cluster` against it; never deploy it (there is no live counterpart, and its knowledge is the
simulator's own workload).

* Placement (`place`, at `start`): adapter a's expected requests in flight are x_a = rate * share_a * W
  (Little's law), W the slot hold at a full batch, `max_num_seqs / replica_rate` (the rated
  capacity's own figure, `sim.simulation`). Most popular first, adapter a is pinned on
  c_a = max(1, ceil(x_a / q)) replicas (copies in proportion to its load, at most one per replica),
  q = min(max_num_seqs, sum of x / replicas), while the pinned slots plus the tail's expected slot
  use, sum over the unpinned of 1 - exp(-x_i), fit in the cluster's slots (replicas x max_loras):
  the bound's S(k) <= C. At full load q is the bound's `max_num_seqs` (a slot per full batch);
  below it a copy carries no more than a replica's mean load, so that a hot adapter's holders are
  not busier than the rest (copies of a full batch each left them near saturation at 0.6 load,
  with batch TTFT p99 of 12 s against 0.14 s). Every replica keeps one slot unpinned, so that tail
  adapters always get a slot there. The copies (x_a / c_a requests in flight each), heaviest first,
  then go each to a distinct replica: the one with the least expected load pinned so far among
  those with the fewest pins (at most the mean), so that both the load and the slots left to the
  tail are even. Pinned adapters are in their replicas' device slots at once (`SimReplica.pin`: no
  load counted) and are never evicted nor preempted for a slot.
* Room: a replica is given up to admission's `max_ongoing_requests` at once (running and waiting in
  its engine), as Serve's queue gives it (`sim.baselines`) and as `lora-cluster` gives it with its
  admission window at its default size. (Giving it only its batch slots, `admission_capacity`,
  idles a slot while a tail adapter loads and queues more: a worse yardstick.)
* Routing: a request of a pinned adapter goes only to the replicas pinning it (the bound counts
  every request of a pinned adapter as a hit), the one with room and the least ongoing; none has
  room: it waits. A request of an unpinned (tail) adapter goes to a replica with room that holds
  its adapter (in a device slot, or being fetched there), the least ongoing first; else to the
  replica with room and a free slot (empty, or idle and unpinned) not yet claimed by a fetch
  there, the least ongoing first (then the most such slots), where its adapter is loaded on
  demand; later requests of that adapter then join it there (the tail co-located). No replica
  with room: it waits.
* Queueing: the waiting requests are ordered by SLA class priority (more urgent first), then
  arrival, the same order as `lora-cluster`'s cluster queue, so that the yardstick measures
  placement, not queueing: one queue for the tail and one per pinned adapter (so that a request
  waiting for its holders does not hold up the others). When a request ends, its replica takes
  the most urgent waiting request it may run (of its pinned adapters or of the tail) while it has
  room. More than admission's `max_queued_requests` waiting in all (-1: no bound) refuses the
  arriving request, as Serve's queue does (`sim.baselines`); there is no queue timeout.

The replicas, their engine (`SimReplica`) and the SLA classes are the same as for every policy.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lora_cluster.sim.context import SimContext
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest


@dataclass(frozen=True)
class Placement:
    """Which replicas pin which adapters, and the slots the unpinned tail is expected to use."""

    holders: dict[str, tuple[str, ...]]  # pinned adapter -> the replicas pinning it (most popular first)
    tail_slots: float  # sum over the unpinned adapters of 1 - exp(-x)

    @property
    def pinned_slots(self) -> int:
        return sum(len(rids) for rids in self.holders.values())


def place(in_flight: Sequence[tuple[str, float]], replica_ids: Sequence[str], *, max_loras: int,
          max_num_seqs: int) -> Placement:
    """The placement (see the module docstring) of adapters with `in_flight` (adapter, expected
    requests in flight), most popular first, on `replica_ids` of `max_loras` slots each. Raises
    ValueError for a slot count or batch size that is not positive."""
    if max_loras < 1 or max_num_seqs < 1:
        raise ValueError(f"max_loras={max_loras} and max_num_seqs={max_num_seqs} must be >= 1")
    n = len(replica_ids)
    slots, pinnable = n * max_loras, n * (max_loras - 1)  # each replica keeps one slot for the tail
    tail = [1.0 - math.exp(-x) for _, x in in_flight]
    used = sum(tail)  # S(0): no adapter pinned
    pinned: list[tuple[str, float, int]] = []  # (adapter, in flight, copies), most popular first
    per_copy = min(max_num_seqs, sum(x for _, x in in_flight) / n) if n else max_num_seqs
    for (adapter, x), tail_share in zip(in_flight, tail, strict=True):
        copies = min(max(1, math.ceil(x / per_copy)), n) if per_copy > 0 else 1
        if copies > pinnable or used + copies - tail_share > slots:
            break
        pinned.append((adapter, x, copies))
        pinnable -= copies
        used += copies - tail_share
    # the copies, heaviest first, each to the least loaded replica not holding it among those with the
    # fewest pins so far (at most the mean, rounded up): balanced in load and in slots
    even = -(-sum(c for _, _, c in pinned) // n) if n else 0
    load = dict.fromkeys(replica_ids, 0.0)  # expected requests in flight pinned there
    pins = dict.fromkeys(replica_ids, 0)
    chosen: dict[str, list[str]] = {adapter: [] for adapter, _, _ in pinned}
    copies_by_weight = sorted(((x / c, i, a) for i, (a, x, c) in enumerate(pinned) for _ in range(c)),
                              key=lambda copy: (-copy[0], copy[1]))
    for weight, _, adapter in copies_by_weight:
        free = [rid for rid in replica_ids if rid not in chosen[adapter] and pins[rid] < max_loras - 1]
        even_free = [rid for rid in free if pins[rid] < even]
        if not free:
            continue  # no distinct replica has a slot left for this copy
        rid = min(even_free or free, key=lambda r: load[r])
        chosen[adapter].append(rid)
        load[rid] += weight
        pins[rid] += 1
    return Placement(holders={a: tuple(rids) for a, rids in chosen.items() if rids},
                     tail_slots=sum(tail[len(pinned):]))


def true_placement(ctx: SimContext) -> Placement:
    """`place` of the workload's true demand (`SimContext.demand`) on the context's replicas; raises
    ValueError for a context without it (no shares, rate or slot hold)."""
    if not ctx.demand.shares or ctx.demand.rate_rps <= 0 or ctx.demand.hold_s <= 0:
        raise ValueError("a yardstick's placement needs the true demand (SimContext.demand: shares, rate, "
                         "hold)")
    replicas = [ctx.replicas[rid] for rid in sorted(ctx.replicas)]
    return place(ctx.demand.in_flight(), sorted(ctx.replicas),
                 max_loras=min(r.adapters.max_loras for r in replicas),
                 max_num_seqs=min(r.max_num_seqs for r in replicas))


class OraclePolicy:
    """The oracle-placement reference policy (see the module docstring): a yardstick, not shipped."""

    name = "oracle"

    def __init__(self, ctx: SimContext):
        self.ctx, self.loop, self.replicas, self.metrics = ctx, ctx.loop, ctx.replicas, ctx.metrics
        self.max_ongoing = ctx.serve.admission.max_ongoing_requests  # requests a replica is given at once
        self.max_queued = ctx.serve.admission.max_queued_requests
        self._ordered: list[SimReplica] = [ctx.replicas[rid] for rid in sorted(ctx.replicas)]
        self.placement = true_placement(ctx)
        holders = self.placement.holders
        self._holders = {a: [ctx.replicas[rid] for rid in rids] for a, rids in holders.items()}
        self._pinned_on: dict[str, list[str]] = {rid: [] for rid in ctx.replicas}
        for adapter, rids in holders.items():
            for rid in rids:
                self._pinned_on[rid].append(adapter)
        # the waiting requests, heaps of (priority, arrival, request): the tail's, and each pinned adapter's
        self._tail: list[tuple[int, int, SimRequest]] = []
        self._queues: dict[str, list[tuple[int, int, SimRequest]]] = {a: [] for a in holders}
        self._seq = itertools.count()
        self.queued = self.queued_max = 0

    def start(self) -> None:
        """Pin the placement's adapters in their replicas' device slots, before the first request."""
        for adapter, rids in self.placement.holders.items():
            for rid in rids:
                self.replicas[rid].pin(adapter)

    def route(self, req: SimRequest) -> SimReplica | None:
        """The replica with room that takes `req` now (see the module docstring); None: it waits."""
        adapter, best, best_key = req.adapter, None, None
        pinned = self._holders.get(adapter)
        for replica in pinned if pinned is not None else self._ordered:
            if replica.ongoing >= self.max_ongoing:
                continue
            slots = replica.adapters
            if pinned is not None or adapter in slots.refs or adapter in slots.loading:
                key: tuple[int, ...] = (0, 0, replica.ongoing)
            else:
                usable = slots.free_slots - len(slots.loading)  # free slots no fetch here claims
                key = (1, usable <= 0, replica.ongoing, -usable)
            if best_key is None or key < best_key:
                best, best_key = replica, key
        return best

    def arrive(self, req: SimRequest) -> None:
        queue = self._queues.get(req.adapter, self._tail)
        if not queue:
            replica = self.route(req)
            if replica is not None:
                replica.add(req, self.loop.now)
                return
        if self.max_queued >= 0 and self.queued >= self.max_queued:
            self.metrics.rejected(req, "oracle queue full")
            return
        heapq.heappush(queue, (req.priority, next(self._seq), req))
        self.queued += 1
        self.queued_max = max(self.queued_max, self.queued)

    def first_token(self, replica: SimReplica, req: SimRequest) -> None:
        return None

    def planned(self, replica: SimReplica) -> None:
        return None  # room frees when a request ends: the queues are served on `finished`

    def finished(self, replica: SimReplica, req: SimRequest) -> None:
        """`replica` has room again: it takes the most urgent queued request it may run (one of
        its pinned adapters, or of the tail), while it has room."""
        self.metrics.finished(req)
        heads = [self._tail, *(self._queues[a] for a in self._pinned_on[replica.replica_id])]
        while self.queued and replica.ongoing < self.max_ongoing:
            queue = min((q for q in heads if q), key=lambda q: q[0][:2], default=None)
            if queue is None:
                return
            queued = heapq.heappop(queue)[2]
            self.queued -= 1
            target = self.route(queued) if queue is self._tail else replica
            (target or replica).add(queued, self.loop.now)

    def pending(self) -> list[SimRequest]:
        return [req for queue in (self._tail, *self._queues.values()) for _, _, req in queue]

    def details(self) -> dict[str, object]:
        holders = self.placement.holders
        top = next(iter(holders.values()), ())
        return {"pinned_adapters": len(holders), "pinned_slots": self.placement.pinned_slots,
                "top_adapter_copies": len(top), "tail_slots_expected": self.placement.tail_slots,
                "queue_max": self.queued_max}

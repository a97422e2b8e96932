"""The `lora-cluster` policy: the ingress's admission, the affinity router and the cluster controller,
wired to simulated replicas the way the live deployments are wired to each other.

* Arrival (`serve.routing.admission.ClusterAdmission.admit`): while the replicas have room (their free
  slots, each the admission capacity minus the larger of the replica's last routing-stats count
  and the ingress's own requests running there, add up to more than the ingress's requests on
  their way), the request goes the fast path: the affinity router picks the replica
  (`routing.AffinityRouting`, i.e. `rank_replicas`). Otherwise a `Ticket` is parked at the
  `Controller` with the ingress's claims, with the other parks of its batch window
  (`controller_batch_window_s`: `cluster.batch_window.BatchWindow`, the object the live actor runs,
  on the simulated clock, handing them to `Controller.park_many`; a refusal is a rejection); the
  request waits until a grant sends it, pinned, to its replica, or until `cluster_queue_timeout_s`
  (then it is rejected, 503). Parks go as the live ingress sends them, coalesced
  (`cluster.park_batch.ParkBatcher`: one park call in flight, the parks that arrive meanwhile in the next
  call, at most `controller_park_batch_max`); a batch's reply carries the outcomes decided at once, later
  grants come with the answers to the ingress's grants poll (`sim.control_inbox`). Before it parks, the
  ingress's edge (`sim.edge`, the live ingress's `cluster.edge` rule) refuses it when the controller's
  last published state says the controller would (a rejection the controller never sees). As in
  `serve.routing.dispatch`, a request counts as on its way until its first item (its first token: requests
  stream) and then as running on its replica until it ends. The request's prompt routing keys
  (`SimRequest.prefix`: chats) go to the router and on the ticket, none with `prefix_aware_routing` off
  (adapter-only routing, as the live router and controller do).
* Replicas report to the controller as the live reporter does (`sim.replica_reports`: the period,
  reports on finish coalesced, both stretched to the controller's report budget).
* The controller ticks every `TICK_S` (stale replicas, preemption of long-waiting urgent tickets);
  grants are delivered after every controller call. The ingress fetches the placement table for
  its router every `controller_report_period_s`; each replica's routing stats refresh every
  `routing_stats_period_s`, staggered.

Priority order (checked over random workloads by `tests/sim/test_priority_order.py`): a request
never enters a running batch before a more urgent one that arrived earlier and still waits where the
two wait together. In the cluster queue, grants go in its order; the exceptions are its starvation
guard (an overdue ticket of a class without a TTFT target: `cluster.cluster_queue`) and, with
`controller_shards` > 1, the shards: each grants its own tickets from its share of the room, split
by queued counts, not urgency (`cluster.sharding`), so a ticket of one shard may pass a more urgent
one of another. In one replica's waiting queue, admission goes by priority, then arrival; the
exception is a more urgent request whose adapter is not on the device yet (loading, or waiting for a
slot that requests at least as urgent hold), which does not hold back one whose adapter is there
(`sim.replica`). The fast path is closed while tickets wait, so a later request never passes a
parked one that way. A request does not move once sent: one waiting at its replica (for a slot
there, its adapter, or the replica's next step) may be passed by a later, less urgent request sent
where there was room. A refused or timed-out request no longer waits, and a preempted one already
entered a batch.

With `controller_shards` > 1 the controller is the shards as the live deployment runs them
(`sim.sharded_controller`'s `Controller`s: parks batched per shard at the adapter's shard, a report
round to every shard with its share of the room, ticks and placement fetches to each, a cancel to
its ticket's shard), each with its own actor loop, batch window and grants poll (`ShardPlane`); the
`control_plane` gives the busiest shard's loop and CPU per simulated second.

One ingress is modelled, and each controller actor's loop (`sim.control_inbox`: a measured cost per
input, inputs that arrive while it is busy taken in its next turn, outputs at the turn's end); with
`--control-cost none` or a positive window, a report, a grant and a send happen at one simulated
instant. The controller's CPU is measured (the thread's CPU clock) and reported with the calls; with
`trace` set to a list, every controller call and its answer is recorded there, for replay.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from lora_cluster.cluster.batch_window import BatchWindow
from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import TICK_S, Controller, Grant, Refusal
from lora_cluster.cluster.park_batch import ClaimHints, ParkBatcher
from lora_cluster.cluster.report_rules import AdmissionWindow, window_limit
from lora_cluster.cluster.sharding import merge_placement, owns, shard_of
from lora_cluster.errors import ClusterOverloadedError, LoraClusterError
from lora_cluster.sim.context import SimContext
from lora_cluster.sim.control_inbox import ControlInbox, ShardPlane, shard_loop_figures
from lora_cluster.sim.control_loop import ControlCost
from lora_cluster.sim.edge import SimEdge, edge_figures
from lora_cluster.sim.metrics import refusal_reason
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.replica_reports import SimReporters
from lora_cluster.sim.routing import AffinityRouting
from lora_cluster.sim.sharded_controller import ShardedController
from lora_cluster.sim.workload import SimRequest

INGRESS_ID = "sim-ingress"
T = TypeVar("T")


def _raise(error: BaseException) -> None:
    raise error


class LoraClusterPolicy:
    name = "lora-cluster"

    def __init__(self, ctx: SimContext):
        self.ctx, self.loop, self.replicas, self.metrics = ctx, ctx.loop, ctx.replicas, ctx.metrics
        s, router, admission, control = ctx.serve, ctx.serve.router, ctx.serve.admission, ctx.serve.controller
        self.sharded = None if control.controller_shards <= 1 else ShardedController(
            ctx.classes, s.controller_settings(), shards=control.controller_shards, clock=ctx.loop.clock,
            measure_from=ctx.metrics.measure_from)
        self.controller = self.sharded if self.sharded is not None else Controller(
            ctx.classes, s.controller_settings(), clock=ctx.loop.clock)
        # refusals at the edge (`sim.edge`): one controller (the live ingress keeps a view per shard)
        self.edge = SimEdge(ctx.loop.clock) if self.sharded is None and control.edge_max_age_s > 0 else None
        self.routing = AffinityRouting(ctx.replicas, miss_cost=router.router_miss_cost,
                                       placement_ttl_s=router.router_placement_ttl_s, clock=ctx.loop.clock,
                                       prefix_share=router.prefix_routing_share)
        self.capacity = {rid: admission.admission_capacity or r.max_num_seqs
                         for rid, r in ctx.replicas.items()}
        self.windows = {rid: AdmissionWindow(window_limit(admission.admission_window_max,
                                                          admission.max_ongoing_requests, self.capacity[rid]))
                        for rid in ctx.replicas}
        self._reported = dict.fromkeys(ctx.replicas, 0)  # ongoing as of each replica's last routing stats
        self._inflight = dict.fromkeys(ctx.replicas, 0)  # the ingress's requests running on each replica
        self._claimed: dict[str, int] = {}  # those of `_inflight` above 0: what the ingress claims
        self._claim: dict[str, int] | None = None  # the copy of `_claimed` sent last (None: changed since)
        self._unassigned = 0  # fast-path requests on their way (no first item yet)
        self._free = dict(self.capacity)  # each replica's free slots, as the admission check sees them
        self._free_total = sum(self._free.values())
        self._tickets: dict[str, SimRequest] = {}  # parked: in a park batch, a window or at the controller
        self.shards: list[Controller] = [self.controller] if self.sharded is None else self.sharded.shards
        self._parked_at = [0] * len(self.shards)  # `_tickets` of each shard's adapters
        self._hints = ClaimHints(len(self.shards))  # what `_claimed` changed since each shard's last call
        self._tables: list[dict[str, tuple[str, ...]]] = [{} for _ in self.shards]  # each shard's placement
        # each controller (shard)'s actor loop (`sim.control_inbox`), modelled at window 0 (the default)
        cost = ctx.control_cost if control.controller_batch_window_s == 0 else None
        self.planes = [self._plane(k, cost) for k in range(len(self.shards))]
        self.inbox, self.window = self.planes[0].inbox, self.planes[0].window
        self.reports = SimReporters(ctx.replicas, ctx.loop, control, planes=self.planes, shards=self.shards,
                                    call=self._call_on, taken=self._taken, depth=self._controller_depth)
        self.controller_s = self.router_s = 0.0
        # after the warm-up: reports and controller CPU seconds, as of the latest arrival (steady state)
        self._measured_reports, self._measured_cpu_s = 0, 0.0
        self.cpu_by_call: dict[str, float] = {}  # after the warm-up: CPU seconds per controller call
        self._steady: tuple[int, float, float] = (0, 0.0, 0.0)
        self._shards_steady: tuple[float, ...] = ()  # each shard's CPU seconds, as of the latest arrival
        self.calls: Counter[str] = Counter()
        self.trace: list[tuple[float, str, tuple[Any, ...], Any]] | None = None  # a list: record calls
        self.fast = self.parked = self.preempting = 0
        self._depth_sum = self._depth_samples = self._depth_max = 0

    def start(self) -> None:
        s, n = self.ctx.serve, len(self.replicas)
        self.reports.start()
        for i, rid in enumerate(sorted(self.replicas)):
            self.loop.at(s.router.routing_stats_period_s * i / n, self._stats_tick, rid, i == 0)
        self.loop.at(0.0, self._tick)
        self.loop.at(0.0, self._fetch_placement)

    def _plane(self, k: int, cost: ControlCost | None) -> ShardPlane:
        inbox = ControlInbox(cost, self.loop, partial(self._deliver, k), self._grant,
                             awaiting=partial(self._awaiting, k))
        window = BatchWindow(partial(self._park_window, k), partial(self._dispatch_window, k),
                             self.ctx.serve.controller.controller_batch_window_s, inbox.window_timer,
                             after=partial(self._deliver, k))
        return ShardPlane(inbox, window, ParkBatcher(self.ctx.serve.controller.controller_park_batch_max))

    def _shard(self, adapter_id: str | None) -> int:
        return 0 if self.sharded is None else shard_of(adapter_id, len(self.shards))

    def _awaiting(self, k: int) -> bool:
        """The ingress has tickets at shard `k` (parked, not in its batcher): it polls for grants."""
        return self._parked_at[k] > self.planes[k].batcher.waiting

    def _call_on(self, k: int, name: str, fn: Callable[..., T], *args: Any) -> T:
        """A controller call on shard `k` (`_call`; with shards, its CPU counted to that shard too)."""
        if self.sharded is None:
            return self._call(name, fn, *args)
        return self._call(name, self.sharded.timed, k, fn, *args)

    def _call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        t0 = time.thread_time()
        answer: Any = None
        try:
            answer = fn(*args)
            return answer
        except ClusterOverloadedError as e:
            answer = e
            raise
        finally:
            spent = time.thread_time() - t0
            self.controller_s += spent
            self.calls[name] += 1
            if self.loop.now >= self.metrics.measure_from:
                self._measured_reports += name == "report"
                self._measured_cpu_s += spent
                self.cpu_by_call[name] = self.cpu_by_call.get(name, 0.0) + spent
            if self.trace is not None:
                self.trace.append((self.loop.now, name, args, answer))

    # ----- requests -------------------------------------------------------------------------

    def has_room(self) -> bool:
        """The ingress's admission check (`ClusterAdmission.has_room`)."""
        return not self._tickets and self._free_total > self._unassigned

    def arrive(self, req: SimRequest) -> None:
        self._steady = (self._measured_reports, self._measured_cpu_s, self.loop.now)
        if self.sharded is not None:
            self._shards_steady = tuple(self.sharded.cpu_s)
        prefix = req.prefix if self.ctx.serve.router.prefix_aware_routing else ()  # off: adapter-only routing
        if self.has_room():
            self.fast += 1
            self._unassigned += 1
            t0 = time.thread_time()
            rid = self.routing.choose(req.adapter, prefix)
            self.router_s += time.thread_time() - t0
            self._send(req, rid)
            return
        tid, sla = str(req.rid), req.sla
        ticket = Ticket(
            ticket_id=tid, ingress_id=INGRESS_ID, sla_class=sla.name, priority=sla.priority,
            adapter_id=req.adapter, enqueued_at=req.arrival, ttft_s=sla.ttft_s, prefix=prefix,
            deadline=None if sla.ttft_s is None else req.arrival + sla.ttft_s)
        if self.edge is not None and (refused := self.edge.refusal(ticket)) is not None:
            self.metrics.rejected(req, refusal_reason(refused))  # the controller never sees it
            return
        self.parked += 1
        self._tickets[tid] = req  # parked from now: the fast path stays closed
        k = self._shard(req.adapter)
        self._parked_at[k] += 1
        timeout_s = self.ctx.serve.controller.cluster_queue_timeout_s
        self.loop.at(ticket.enqueued_at + timeout_s, self._timeout, tid)
        self._send_parks(k, self.planes[k].batcher.add(tid, ticket))

    def _unpark(self, ticket_id: str) -> SimRequest | None:
        req = self._tickets.pop(ticket_id, None)
        if req is not None:
            self._parked_at[self._shard(req.adapter)] -= 1
        return req

    def _send_parks(self, k: int, batch: list[Ticket]) -> None:
        """One park call of the ingress to shard `k` (`ParkBatcher`): its batch arrives together."""
        if batch:
            self.planes[k].inbox.input("park", partial(self._park_act, k, batch), count=len(batch))

    def _park_act(self, k: int, batch: list[Ticket]) -> Callable[[], None] | None:
        """Shard `k` takes a batch of parks into its window; the reply leaves when the window is sent."""
        plane = self.planes[k]
        for ticket in batch:  # a ticket that timed out meanwhile is left out (`wanted`)
            plane.window.park(ticket, None, deliver=partial(self._parked, k, ticket), fail=_raise,
                              wanted=partial(self._tickets.__contains__, ticket.ticket_id))
        if plane.inbox.loop is not None:
            plane.inbox.carry()
            return partial(self._batch_replied, k)
        if self.ctx.serve.controller.controller_batch_window_s > 0:
            plane.window.on_sent(partial(self._batch_replied, k))
        else:
            self._batch_replied(k)
        return None

    def _batch_replied(self, k: int) -> None:
        """A park call's reply: its grants decided at once go, the next batch goes, the ingress polls."""
        plane = self.planes[k]
        immediate, plane.immediate = plane.immediate, []
        for ticket_id, grant in immediate:
            self._grant(ticket_id, grant)
        self._send_parks(k, plane.batcher.replied())
        plane.inbox.poll()

    def _park_window(self, k: int, parks: Sequence[tuple[Ticket, Any]]) -> list[Any]:
        """The window's parks reach shard `k` at once (`Controller.park_many`), with the claims now."""
        if self._claim is None:  # the counts changed since the last claim sent: a new mapping
            self._claim = dict(self._claimed)
        claims = self._hints.stamp(k, {"inflight": self._claim, "unassigned": self._unassigned})
        outcomes = self._call_on(k, "park_many", self.shards[k].park_many, [(t, claims) for t, _ in parks])
        if self.edge is not None:  # the live actor sends it with its replies to these parks (and grants)
            self.edge.offer(self._call("edge_state", self.controller.edge_state))
        return outcomes

    def _dispatch_window(self, k: int) -> None:
        """A window of reports alone: one dispatch for their room."""
        self._call_on(k, "dispatch", self.shards[k].dispatch)

    def _parked(self, k: int, ticket: Ticket, outcome: Any) -> None:
        """A parked ticket's outcome from its window: refused, granted at once, or waiting."""
        if self.edge is not None:
            self.edge.judged(ticket, outcome)
        if isinstance(outcome, ClusterOverloadedError):
            self.metrics.rejected(self._unpark(ticket.ticket_id), refusal_reason(outcome))
        elif isinstance(outcome, LoraClusterError):
            raise outcome
        elif outcome is not None:
            self.planes[k].immediate.append((ticket.ticket_id, outcome))

    def _controller_depth(self) -> int:  # tickets queued at the controller (with shards: at all of them)
        c = self.controller
        return len(c.queue) if isinstance(c, Controller) else c.queue_depth()

    def first_token(self, replica: SimReplica, req: SimRequest) -> None:
        """The request's first item reached the ingress (`ClusterAdmission.started`)."""
        if req.ticket is None:
            self._unassigned -= 1
        rid = replica.replica_id
        self._inflight[rid] = self._claimed[rid] = self._inflight[rid] + 1
        self._claim = None
        self._hints.changed(rid)
        self._refree(rid)

    def finished(self, replica: SimReplica, req: SimRequest) -> None:
        self.metrics.finished(req)
        rid = replica.replica_id
        self._inflight[rid] -= 1
        if self._inflight[rid]:
            self._claimed[rid] = self._inflight[rid]
        else:
            del self._claimed[rid]
        self._claim = None
        self._hints.changed(rid, ended=req.ticket is not None)
        self._refree(rid)
        self.routing.changed(rid)
        self.reports.finished(replica)

    def planned(self, replica: SimReplica) -> None:
        """A replica planned a step: its admission window observes it (as the live replica's does)."""
        rid = replica.replica_id
        self.windows[rid].observe(free_seats=replica.max_num_seqs - len(replica.running),
                                  waiting=len(replica.waiting),
                                  tickets_queued=self.reports.queue_depth[rid] > 0)

    def _taken(self, replica_id: str) -> int:
        """What the replica reports it takes: its admission capacity plus its window."""
        return self.capacity[replica_id] + self.windows[replica_id].extra

    def _send(self, req: SimRequest, replica_id: str) -> None:
        self.replicas[replica_id].add(req, self.loop.now)
        self.routing.changed(replica_id)

    def _refree(self, replica_id: str) -> None:
        free = max(0, self.capacity[replica_id] - max(self._reported[replica_id], self._inflight[replica_id]))
        self._free_total += free - self._free[replica_id]
        self._free[replica_id] = free

    def _grant(self, ticket_id: str, grant: Grant | Refusal) -> None:
        req = self._unpark(ticket_id)
        if req is None:
            return
        if isinstance(grant, Refusal):
            self.metrics.rejected(req, "bumped from the full queue")
            return
        self.preempting += grant.preempt
        req.ticket = ticket_id
        self.reports.ticket_arrived(grant.replica_id, ticket_id, req.adapter)
        self.routing.record(grant.replica_id, req.adapter)
        self._send(req, grant.replica_id)

    def _deliver(self, k: int) -> None:
        grants = self._call_on(k, "take_grants", self.shards[k].take_grants)
        for ticket_id, grant in grants.items():
            self.planes[k].inbox.granted(ticket_id, grant)
        if grants and self.edge is not None:  # the live actor's grant replies carry it
            self.edge.offer(self._call("edge_state", self.controller.edge_state))

    def _timeout(self, ticket_id: str) -> None:
        req = self._unpark(ticket_id)
        if req is None:
            return
        k = self._shard(req.adapter)
        if not self.planes[k].batcher.withdraw(ticket_id):  # sent: its shard drops it (unsent: never goes)
            cancel = partial(self._call_on, k, "cancel", self.shards[k].cancel, ticket_id)
            self.planes[k].inbox.input("cancel", cancel)
        self.metrics.rejected(req, "cluster queue timeout")

    def pending(self) -> list[SimRequest]:
        return list(self._tickets.values())

    # ----- the periodic parts ---------------------------------------------------------------

    def _tick(self) -> None:
        for k, plane in enumerate(self.planes):
            plane.inbox.input("tick", partial(self._tick_act, k))
        depth = self._controller_depth()
        self._depth_sum += depth
        self._depth_samples += 1
        self._depth_max = max(self._depth_max, depth)
        self.loop.after(TICK_S, self._tick)

    def _tick_act(self, k: int) -> None:
        self._call_on(k, "tick", self.shards[k].tick)
        if self.planes[k].inbox.loop is None:  # with the loop, its turn's end takes the grants
            self._deliver(k)

    def _fetch_placement(self) -> None:
        for k, plane in enumerate(self.planes):
            plane.inbox.input("placement", partial(self._placement_act, k))
        self.loop.after(self.ctx.serve.controller.controller_report_period_s, self._fetch_placement)

    def _placement_act(self, k: int) -> Callable[[], None]:
        placement = self._call_on(k, "placement", self.shards[k].placement)
        # with the adapters the replicas hold, as the live `ingress_view`
        state = None if self.edge is None else self._call("edge_state", self.controller.edge_state, True)
        return partial(self._placed, k, placement, state)

    def _placed(self, k: int, placement: dict[str, tuple[str, ...]], state: Any) -> None:
        """Shard `k`'s placement reaches the ingress (with shards, the union of each one's own)."""
        if self.sharded is None:
            self.routing.placement = placement
        else:
            n = len(self.shards)
            self._tables[k] = {a: r for a, r in placement.items() if owns(a, k, n)}
            self.routing.placement = {a: tuple(r) for a, r in merge_placement(self._tables).items()}
        if self.edge is not None:
            self.edge.offer(state)

    def refresh_stats(self, replica_id: str) -> None:
        """The replica's routing stats arrive at the router and the ingress's admission check."""
        self.routing.refresh_stats(replica_id)
        replica = self.replicas[replica_id]
        self._reported[replica_id] = len(replica.running) + len(replica.waiting)
        self._refree(replica_id)

    def _stats_tick(self, replica_id: str, prune: bool) -> None:
        self.refresh_stats(replica_id)
        if prune:
            self.routing.prune()
        self.loop.after(self.ctx.serve.router.routing_stats_period_s, self._stats_tick, replica_id, prune)

    def details(self) -> dict[str, object]:
        c = self.controller
        return {
            "fast_path": self.fast, "parked": self.parked, "preempting_grants": self.preempting,
            **edge_figures(self.edge),
            "controller_counts": dict(c.counts), "controller_calls": dict(self.calls),
            "controller_cpu_s": self.controller_s, "router_cpu_s": self.router_s,
            "controller_cpu_s_by_call_after_warmup": dict(self.cpu_by_call),
            "router_decisions": self.routing.decisions,
            "queue_depth_mean": self._depth_sum / max(self._depth_samples, 1),
            "queue_depth_max": self._depth_max,
            "placement_entries": len(c.placement()),
            "control_plane": self.control_plane(),
        }

    def control_plane(self) -> dict[str, float | bool | None]:
        """At steady state (from the end of the warm-up to the last arrival): reports per second per
        replica (with shards: a shard's, all shards' over n), CPU seconds in the controller's calls per
        simulated second (with shards: all of them, and the busiest one); with the actor's loop
        modelled, the share of the whole run it was busy and its inputs per turn."""
        reports, cpu_s, until = self._steady
        span = until - self.metrics.measure_from
        if span <= 0:
            return {"reports_per_s_per_replica": None, "controller_cpu_s_per_sim_s": None}
        plane: dict[str, float | bool | None] = {
            "reports_per_s_per_replica": reports / len(self.shards) / span / len(self.replicas),
            "controller_cpu_s_per_sim_s": cpu_s / span}
        loops = [p.inbox.figures() for p in self.planes]  # each actor's loop, when modelled
        plane.update(loops[0] if len(loops) == 1 else shard_loop_figures(loops))
        if self.sharded is not None:
            plane["shards"] = len(self.sharded.shards)
            plane["busiest_shard_cpu_s_per_sim_s"] = max(self._shards_steady, default=0.0) / span
        return plane

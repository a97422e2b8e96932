"""The cluster controller's state machine: replica reports in, queued requests out to replicas.

Inputs: `report` (each replica, every period and when a request finishes while requests are
queued), `park` / `park_many` (an ingress has a request that no replica can take now; the actor
hands over the parks of one batch window at once, and dispatches once for that window's reports:
`report(..., dispatch=False)`, then `dispatch`), `cancel` (the request went
away) and `tick` (time passes: stale replicas are forgotten, waiting tickets may now preempt).
Outputs: grants (`take_grants`: ticket -> replica, and whether it preempts), each report's reply
(how many requests are queued, so the replica reports again as soon as it frees a slot, and which
adapters to prefetch because placement chose that replica for them), and `snapshot` (the cluster
view served at `GET /v1/cluster`).

Policies (each in its own module): `cluster_queue` orders and admits tickets (and bounds the wait of
classes without a TTFT target: one that waited 3/4 of the bound is granted first), `shedding` refuses
first the requests that would load an adapter while their class sheds load, `scheduling` picks the
replica for a ticket, `preemption` sends urgent tickets over capacity where less urgent work runs,
`placement` spreads hot adapters, `edge` is what it publishes (`edge_state`) for the ingresses to
refuse by before they park (the refusals it would make; it never sees, nor counts, those). The controller
holds no request bodies and no Ray objects; the actor (`serve.controller_actor`) wraps it. Its state is
soft: a restarted controller starts empty, rebuilds its view from the next reports (a delta it
cannot apply gets `resync`, and the replica sends its full report at once), and the
ingresses park their waiting requests again. Pure: injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.cluster_queue import ClusterQueue, Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller_settings import ControllerSettings
from lora_cluster.cluster.edge import ClassEdge, DrainEdge, EdgeState
from lora_cluster.cluster.hit_index import HitIndex
from lora_cluster.cluster.holder_queue import holder_queue_target
from lora_cluster.cluster.placement import DemandTracker, PlacementPolicy
from lora_cluster.cluster.preemption import Preemption
from lora_cluster.cluster.report_delta import ReportDelta, apply_delta
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.scheduling import (
    choose_replica,
    hit_window_s,
    holder_preemption_target,
    holds,
    holds_for,
    will_preempt,
)
from lora_cluster.cluster.shedding import ColdShedding
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.errors import DeadlineOutOfReachError, LoraClusterError, WaitBoundError

DEFAULT_SERVICE_TIME_S = 1.0
TICK_S = 0.05  # `tick` runs this often: stale replicas, preemption of long-waiting urgent tickets
REPLAN_EVERY_S = 1.0  # placement is recomputed this often, and when a replica joins or goes away
MAX_UNCLAIMED_GRANTS = 65_536
_SETTINGS = ControllerSettings()  # the defaults (`controller_settings`)


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class Grant:
    replica_id: str
    preempt: bool = False


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class Refusal:
    """A parked ticket's request is refused after all (bumped out of the full queue)."""

    reason: str
    retry_after_s: float


class Controller:
    def __init__(self, classes: SlaClasses, settings: ControllerSettings = _SETTINGS,
                 clock: Callable[[], float] = time.monotonic):
        self.classes, self.settings, self._clock = classes, settings, clock
        self.queue = ClusterQueue(max_size=settings.queue_bound(0), aging_s=settings.aging_s, clock=clock,
                                  top_priority=classes.classes[0].priority,
                                  wait_bound_s=settings.wait_bound_s)
        self.view = ClusterView(stale_after_s=settings.stale_after_s, clock=clock)
        self.demand = DemandTracker(window_s=settings.demand_window_s, clock=clock)
        self.shedding = ColdShedding(
            settings.cold_shed_window_s, clock, pressure=settings.cold_shed_pressure,
            no_target_bound_s=settings.wait_bound_s / 2 if settings.wait_bound_s else None)
        self._placement: dict[str, tuple[str, ...]] = {}
        self._planned_at = -float("inf")
        self._grants: dict[str, Grant | Refusal] = {}
        self._by_replica: dict[str, list[str]] = {}  # the placement table by replica
        urgent = frozenset(c.priority for c in classes.classes if c.ttft_s is not None)  # with a TTFT target
        self.hits = HitIndex(self.queue, self.view)  # where a queued ticket would hit, kept between looks
        self.preemption = Preemption(self.queue, self.view, settings, urgent, clock,
                                     lambda ticket, replica_id: self._grant(ticket, replica_id, preempt=True),
                                     self.hits)
        self._dispatch_due = False  # a report was taken without its dispatch (`report(dispatch=False)`)
        # replica -> its batch slots over its service time (0.0 without one), in the view's order
        self._rates: dict[str, float] = {}
        self._rate_sum: float | None = None  # their sum, until one of them changes (None: to sum again)
        self.started = clock()
        # each class with a ticket standing for it in `edge_state` (the shedding rule reads its target)
        self._probes = [(c, Ticket("", "", c.name, c.priority, None, 0.0, None, c.ttft_s))
                        for c in classes.classes]
        self.counts = {"parked": 0, "granted": 0, "preempting_grants": 0, "rejected": 0, "cancelled": 0,
                       "bumped": 0, "shed_cold": 0, "wait_bound": 0, "overdue_grants": 0, "reports": 0,
                       "resyncs": 0}

    # ----- inputs ---------------------------------------------------------------------------

    def report(self, report: ReplicaReport | ReportDelta, dispatch: bool = True) -> dict[str, Any]:
        """Take a replica's report, full or a delta (`report_delta`); returns its reply (`queue_depth`,
        `prefetch`, `replicas`: how many replicas it sees, which paces the reports
        (`report_rules.ReportPacer.pace`), and `resync` when a delta's base is not the report held for
        that replica: after a restart, or a lost reply; its arrived tickets and demand still count, and
        the replica sends a full report at once). With `dispatch` False the queue is not dispatched for
        the room it reports: the caller calls `dispatch` later, once for every report of its batch window,
        and reads the queue's depth after it for the reply (`queue_depth` here counts tickets that
        dispatch may grant)."""
        self.counts["reports"] += 1
        base = self.view.get(report.replica_id)
        if isinstance(report, ReportDelta):
            if base is None or base.seq != report.base_seq:
                self.counts["resyncs"] += 1
                self.view.arrived(report.replica_id, report.arrived_tickets)
                self.demand.record(report.adapter_requests)
                return {"queue_depth": len(self.queue), "prefetch": [], "resync": True,
                        "replicas": len(self.view)}
            report = apply_delta(base, report)
        joined = base is None
        self.view.update(report)
        if joined:
            self._replicas_changed()
        service = report.service_time_s
        rate = report.capacity / service if service else 0.0
        if self._rates.get(report.replica_id) != rate:
            self._rate_sum = None
        self._rates[report.replica_id] = rate
        self.preemption.reported(report.replica_id)
        self.demand.record(report.adapter_requests)
        if joined or self._clock() - self._planned_at >= REPLAN_EVERY_S:
            self._replan()
        if dispatch:
            self._dispatch()
        else:
            self._dispatch_due = True  # by `dispatch`, or the next `park_many`
        targeted = self._by_replica.get(report.replica_id, ())
        prefetch = [a for a in targeted if a not in report.resident and a not in report.loading]
        return {"queue_depth": len(self.queue), "prefetch": sorted(prefetch), "replicas": len(self.view)}

    def park(self, ticket: Ticket, claims: Mapping[str, Any] | None = None) -> Grant | Refusal | None:
        """Queue a request that no replica can take now; returns its grant if one is decided at once
        (it still waits its turn behind more urgent tickets). `claims`: the parking ingress's
        requests in flight (`{"inflight": {replica: n}, "unassigned": n}`, see `ClusterView.claim`; with
        `seq`, `base` and `changed` from `park_batch.ClaimHint`: the replicas changed since its last call).
        Raises ClusterOverloadedError (a `ColdAdapterShedError` while its class sheds load and no
        replica holds its adapter: `cluster.shedding`)."""
        outcome = self.park_many([(ticket, claims)])[0]
        if isinstance(outcome, LoraClusterError):
            raise outcome
        return outcome

    def park_many(self, parks: Sequence[tuple[Ticket, Mapping[str, Any] | None]]
                  ) -> list[Grant | Refusal | LoraClusterError | None]:
        """Queue several tickets at once (the parks that reached the controller in one batch:
        `serve.batch_window`), each admitted as `park` admits it, in the order given; then the queue
        is dispatched once for all of them and for the reports taken without a dispatch since the
        last one (not when every ticket was refused and no such report waits: nothing changed).
        Returns each ticket's outcome, in order: its grant or refusal if decided at once, None if it
        waits, or the error that refused it (a ClusterOverloadedError; a RequestError for a ticket
        id already queued), returned, not raised: the others still count. Each ingress's latest
        claims are applied once. Equal to parking them one by one except that a ticket granted at
        once is granted at the batch's end, in queue order, so the batch's most urgent go first;
        while the queue is full and replicas have room after admissions (or reports) it was not
        dispatched for, it is dispatched before the next admission (a full queue never refuses a
        ticket a free slot could take; a batch of one decides exactly as one `park` did). Cost:
        O(batch) for the admission plus one dispatch, where one by one costs a dispatch and a claim
        comparison per ticket."""
        latest: dict[str, Mapping[str, Any]] = {}
        last: Mapping[str, Any] | None = None
        for ticket, claims in parks:
            if claims is not None:
                latest[ticket.ingress_id] = claims
                if claims is not last:  # one call's parks share its claims: its ends count once
                    last = claims
                    self.ended(claims.get("ended") or {})
        for ingress_id, claims in latest.items():
            changed = claims.get("changed")  # the ingress's hint (`park_batch.ClaimHint`)
            hint = None if changed is None else (int(claims["seq"]), int(claims["base"]), changed)
            self.view.claim(ingress_id, claims.get("inflight") or {}, int(claims.get("unassigned", 0)), hint)
        outcomes: list[Grant | Refusal | LoraClusterError | None] = []
        room: int | None = None  # read when the queue is full: admitting changes no replica's room
        undispatched = self._dispatch_due  # admissions (or reports) the queue was not dispatched for
        for ticket, _ in parks:
            if undispatched and len(self.queue) >= self.queue.max_size:
                room = self._room() if room is None else room
                if room > 0:
                    full = len(self.queue)
                    self._dispatch()
                    room = None if len(self.queue) < full else 0  # 0: nothing it can grant now
                    undispatched = False
            try:
                self._admit(ticket)
            except LoraClusterError as error:
                outcomes.append(error)
            else:
                outcomes.append(None)
                undispatched = True
        if self._dispatch_due or any(outcome is None for outcome in outcomes):  # refusals change nothing
            self._dispatch()
        return [self._grants.pop(t.ticket_id, None) if outcome is None else outcome
                for (t, _), outcome in zip(parks, outcomes, strict=True)]

    def _admit(self, ticket: Ticket) -> None:
        """Shed, refuse or queue one ticket (no dispatch); raises ClusterOverloadedError (or
        RequestError: its id is already queued)."""
        rate = self._expected_rate()

        def predicted() -> float | None:
            return self.queue.predicted_wait_s(ticket, rate)

        if self.shedding.refuses(ticket, self.view, self.queue.top_priority, predicted):
            self.counts["rejected"] += 1
            self.counts["shed_cold"] += 1
            raise self.shedding.error(ticket, predicted())

        def at_risk() -> bool:  # asked by the queue only once it has room for the ticket
            return ticket.ttft_s is None or not will_preempt(ticket, self.view)

        try:
            bumped = self.queue.park(ticket, deadline_at_risk=at_risk, expected_rate=rate,
                                     max_wait_s=self.settings.queue_timeout_s)
        except DeadlineOutOfReachError:
            self.counts["rejected"] += 1
            self.shedding.record(ticket.priority)
            raise
        except WaitBoundError:
            self.counts["rejected"] += 1
            self.counts["wait_bound"] += 1
            self.shedding.record(ticket.priority)
            raise
        except Exception:
            self.counts["rejected"] += 1
            raise
        self.counts["parked"] += 1
        self.hits.parked(ticket)
        if bumped is not None:
            error = self.queue.bumped_error(bumped)
            self._grants[bumped.ticket_id] = Refusal(str(error), error.retry_after_s)
            self.counts["bumped"] += 1
        if ticket.ttft_s is not None:
            self.preemption.watch(ticket)

    def ended(self, counts: Mapping[str, int]) -> bool:
        """Granted requests that ended at each replica, told by an ingress with a park call (`park_many`
        applies each call's; the actor calls it for a call that parked nothing, its tickets all parked
        here already: the ingress parks again after a call that failed on its side), whose ends no
        later call repeats: each counts a free seat there (`ClusterView.ended`). True when any
        counted; the queue is then due a dispatch (`dispatch`, or the next `park_many`)."""
        counted = self.view.ended(counts)
        self._dispatch_due = self._dispatch_due or counted
        return counted

    def dispatch(self) -> None:
        """Grant what the replicas' room allows, and let urgent tickets preempt (after reports taken
        with `dispatch=False`); `take_grants` then has the grants."""
        self._dispatch()

    def cancel(self, ticket_id: str, replica_id: str | None = None) -> None:
        """The request went away, or its grant will not be used (the caller left after it was
        decided, or sending the request to `replica_id`, its grant, failed): drop its ticket, its
        unclaimed grant, and the room its grant reserved at its replica (`ClusterView.release`;
        without `replica_id` every replica is looked at)."""
        queued = self.queue.remove(ticket_id) is not None
        unclaimed = self._grants.pop(ticket_id, None) is not None
        released = not queued and self.view.release(ticket_id, replica_id)
        if queued or unclaimed or released:
            self.counts["cancelled"] += 1

    def tick(self) -> None:
        """Forget replicas that stopped reporting; let long-waiting urgent tickets preempt."""
        if gone := self.view.prune():
            self._replicas_changed()
            for rid in gone:
                del self._rates[rid]
            self._rate_sum = None
            self._replan()
        self._dispatch()

    # ----- outputs --------------------------------------------------------------------------

    def take_grants(self) -> dict[str, Grant | Refusal]:
        """Grants decided since the last call (ticket id -> grant), and the refusals of tickets that a
        more urgent one bumped out of the full queue."""
        grants, self._grants = self._grants, {}
        return grants

    def placement(self) -> dict[str, tuple[str, ...]]:
        """adapter -> replicas that should hold it (hot adapters only)."""
        return dict(self._placement)

    def edge_state(self, held: bool = False) -> EdgeState:
        """The admission state the ingresses refuse by (`cluster.edge`), as of now: the queue's
        fullness and least urgent rank, and per class its predicted wait, whether a ticket of it
        could count on preemption, and whether it sheds cold requests. `held`: with the adapters some
        replica holds (O(those adapters): sent with the periodic fetch, not every reply). O(classes)
        otherwise. Changes nothing."""
        now, queue, view, shedding = self._clock(), self.queue, self.view, self.shedding
        full = len(queue) >= queue.max_size and (not self._dispatch_due or self._room() <= 0)
        drain = queue.drain.rate()
        rate = max(drain or 0.0, self._expected_rate() or 0.0)  # `predicted_wait_s`'s rate
        classes = {}
        for c, probe in self._probes:
            wait = queue.wait_at(queue.rank_of(c.priority, now), rate) if rate else None
            # no deadline to miss without a TTFT target; under half of it, only a request that already
            # waited the other half before parking would miss it: left to the controller (False parks)
            at_risk = (c.ttft_s is not None and wait is not None and wait > c.ttft_s / 2
                       and not (view.preemptible_ids(c.priority) or view.claimed_less_urgent_ids(c.priority)))
            classes[c.name] = ClassEdge(c.priority, c.ttft_s, wait, at_risk, shedding.shed_until(c.priority),
                                        shedding.under_pressure(probe, wait),
                                        c.priority == queue.top_priority)
        count, head = queue.drain.head(self.settings.edge_max_age_s)
        return EdgeState(now, self.settings.edge_max_age_s, queue.max_size, full, queue.least_rank(),
                         DrainEdge(queue.drain.window_s, count, head), queue.top_priority, queue.aging_s,
                         shedding.window_s, classes,
                         view.held_adapters() if held else None, now if held else float("-inf"),
                         self.settings.edge_held_max_age_s)

    # ----- policy ---------------------------------------------------------------------------

    def _grant(self, ticket: Ticket, replica_id: str, *, preempt: bool) -> None:
        self.queue.remove(ticket.ticket_id)
        self.view.granted(replica_id, ticket.ticket_id, preempting=preempt, adapter_id=ticket.adapter_id)
        self.queue.drain.record()
        self.queue.class_granted(ticket)
        self._grants[ticket.ticket_id] = Grant(replica_id, preempt)
        self.counts["granted"] += 1
        self.counts["preempting_grants"] += int(preempt)
        if len(self._grants) > MAX_UNCLAIMED_GRANTS:  # nobody takes them: the actor is gone
            self._grants.pop(next(iter(self._grants)))

    def _replicas_changed(self) -> None:
        """A replica joined or was forgotten: the silence that forgets one and the queue's bound
        (`cluster_queue_size` None: it grows with the replicas; tickets over a smaller bound stay)."""
        self.view.stale_after_s = self.settings.silent_after_s(len(self.view))
        self.queue.max_size = self.settings.queue_bound(len(self.view))

    def _room(self) -> int:
        """The free room to grant: direct requests on their way will take some of it."""
        return self.view.total_free() - self.view.unassigned()

    def _dispatch(self) -> None:
        self._dispatch_due = False
        if not len(self.queue):
            return
        room = self._room()
        while room > 0:
            overdue = self.queue.overdue()  # waited the bound of its class: it goes first, wherever
            ticket = overdue or self.queue.peek()
            if ticket is None:
                break
            replica_id = choose_replica(ticket, self.view, self._placement)
            if replica_id is None:
                break
            self.counts["overdue_grants"] += overdue is not None
            # a miss there, or a copy its adapter's demand does not need: a hit elsewhere first?
            placement = self._placement
            if overdue is None and not holds_for(self.view, replica_id, ticket, placement):
                window = hit_window_s(ticket, self.settings.affinity_wait_fraction, self.settings.aging_s)
                hit = self.hits.hit(ticket.priority, self.view.free_ids(), ticket.enqueued_at + window)
                held = holds(self.view, replica_id, ticket.adapter_id)
                if hit is not None:
                    ticket, replica_id = hit
                elif (ticket.ttft_s is not None and not held
                      and (holder := holder_preemption_target(ticket, self.view, placement))):
                    self._grant(ticket, holder, preempt=True)  # a hit by preemption beats a miss
                    continue
                elif not held and (holder := holder_queue_target(ticket, self.view, placement)):
                    self._grant(ticket, holder, preempt=False)  # a hit a little later beats a copy
                    continue
            self._grant(ticket, replica_id, preempt=False)
            room -= 1
        if len(self.queue):
            self.preemption.run()

    def _expected_rate(self) -> float | None:
        """Requests per second the live replicas should complete: batch slots over service time
        (each replica's share kept from its report, summed in the view's order when one changed)."""
        if self._rate_sum is None:
            self._rate_sum = sum(self._rates.values())
        return self._rate_sum * self.settings.rate_share or None

    def _replan(self) -> None:
        self._planned_at = self._clock()
        replicas = self.view.replicas()
        times = [r.service_time_s for r in replicas if r.service_time_s]
        service = sum(times) / len(times) if times else DEFAULT_SERVICE_TIME_S
        policy = PlacementPolicy(service_time_s=service, hot_share=self.settings.hot_share)
        self._placement = policy.targets(self.demand.rates(), replicas, self.view.holders)
        self._by_replica = {}
        for adapter_id, replica_ids in self._placement.items():
            for rid in replica_ids:
                self._by_replica.setdefault(rid, []).append(adapter_id)

    def hot_adapters(self, k: int) -> list[tuple[str, int]]:
        """The `k` adapters of most recent demand, busiest first, with their rates in requests per
        1,000 s (`DemandTracker.hot`): what the replicas prefetch ahead of requests."""
        return self.demand.hot(k)

    # ----- the view -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole cluster as JSON: nodes -> replicas -> adapters, queues, memory, placement."""
        nodes: dict[str, dict[str, Any]] = {}
        for report in sorted(self.view.replicas(), key=lambda r: r.replica_id):
            rid = report.replica_id
            node = nodes.setdefault(report.node_id, {"replicas": {}})
            node["replicas"][rid] = {
                "base": report.base,
                "capacity": report.capacity, "running": report.running, "waiting": report.waiting,
                "free": self.view.free(rid), "max_num_seqs": report.max_num_seqs,
                "max_loras": report.max_loras, "free_adapter_slots": report.free_adapter_slots,
                "adapters": {"resident": list(report.resident), "loading": list(report.loading)},
                "memory": dict(vars(report.memory)),
                "classes": {k: dict(v) for k, v in report.classes.items()},
                "running_by_priority": {str(p): n for p, n in report.running_by_priority.items()},
                "service_time_s": report.service_time_s, "report_age_s": round(self.view.age_s(rid), 3),
            }
        rates = sorted(self.demand.rates().items(), key=lambda kv: -kv[1])[:50]
        return {
            "controller": {"up_s": round(self._clock() - self.started, 3), "replicas": len(self.view),
                           "counts": dict(self.counts)},
            "classes": {c.name: {"priority": c.priority, "ttft_s": c.ttft_s, "tpot_s": c.tpot_s}
                        for c in self.classes.classes},
            "queue": {"depth": len(self.queue), "size": self.queue.max_size,
                      "by_class": self.queue.depth_by_class(),
                      "oldest_wait_s": round(self.queue.oldest_wait_s(), 3)},
            "nodes": nodes,
            "placement": {a: list(r) for a, r in sorted(self._placement.items())},
            "demand_rps": {a: round(r, 4) for a, r in rates},
        }

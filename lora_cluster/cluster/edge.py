"""The ingress's refusals of what the controller would refuse, from the admission state it publishes.

An ingress refuses, before parking it, a request that the controller would refuse, with the same
error (class, message and `retry_after_s`, so the same 429 body and `Retry-After`), from an
`EdgeState` the controller publishes (`Controller.edge_state`) and the ingress receives with what it
already gets from the controller: every `admit` reply and every `ingress_view` fetch (the live
actor), every park batch and placement fetch (the simulator). No call is added per request. The
decision, `edge_refusal(state, ticket, now)`, is a pure function; it checks the controller's rules
in the controller's order (`Controller._admit`, `ClusterQueue.park`):

* cold shedding (`cluster.shedding`): the ticket's class shed load at `published_at` (a refusal
  within `cold_shed_window_s`, counted on to `now`, or the queue's predicted wait for the class over
  `cold_shed_pressure` of its bound) and its adapter is in no replica's report as of `held_at`
  (`held`: published with the placement fetch; None, never published, refuses nothing cold);
* queue full per class: the queue was full (and the controller had no room to grant) and its least
  urgent ticket is not strictly less urgent than this one, which would otherwise bump it. Its
  retry-after (the queue over the drain rate, `cluster_queue.full_retry_after_s`) is computed at the
  moment of refusal from the drain meter's published inputs (`DrainEdge`), as the controller computes
  it then: the measured rate falls as its oldest grants age, so a value computed at publication
  would be up to `max_age_s` behind the controller's, another `Retry-After` across a whole second;
* deadline out of reach: the class's predicted wait at `published_at` ends past the ticket's
  deadline and no replica runs less urgent work that a ticket of this class could preempt (nor
  such work claimed by preempting grants): then no adapter's ticket can count on preemption.

Staleness bound. Each part of the state is the controller's own decision input at its publication
time. The admission part older than `max_age_s` (`edge_max_age_s`, default 0.1 s, counted from its
arrival on the receiving side) refuses nothing, and `max_age_s` 0 turns the edge off; the held
adapters (they come with the periodic fetch) refuse nothing cold once older than `held_max_age_s`
(two report periods, 1 s by default). So a refusal at the edge is the refusal the controller made,
or would have made, for this ticket on a queue at most `max_age_s` old (and a residency view at most
`held_max_age_s` old): a stale view costs at most a refusal the controller would have made then
(the queue drained or an adapter was loaded since), or a park the controller then refuses itself
(the queue filled since: it is parked, and the controller decides as before). It never refuses on a
state older than the bound. The wait estimate is the one for a ticket parked at `published_at`; a
later ticket of the class ranks behind more aged tickets, so the estimate errs towards parking.
Measured (a replay of the simulator's parks against states of age d, and runs with the edge on and
off): docs/scale.md#refusals-at-the-edge. Under load the state is refreshed with every reply (each
refusal and each grant), so it is milliseconds old; the bound matters when replies stop: then one
park per bound refreshes it.

Clocks: the state is in the controller's clock (`published_at`); the receiver maps its own clock onto
it (`EdgeView`), so that a state's age is counted from its arrival (its transit is not counted: a
few milliseconds). Pure: plain Python, no Ray; the controller's counts never include these
requests, which it never saw; the ingress counts them (`lora_cluster_edge_refusals_total`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from lora_cluster.cluster.cluster_queue import Ticket, drain_rate, full_retry_after_s
from lora_cluster.errors import (
    ClusterOverloadedError,
    ColdAdapterShedError,
    DeadlineOutOfReachError,
    QueueFullError,
)

REASONS = ("cold_shed", "queue_full", "deadline")  # the metric's `reason` label values


class ClassEdge(NamedTuple):
    """One SLA class as the controller's admission saw it at publication."""

    priority: int
    ttft_s: float | None  # its TTFT target (None: none)
    wait_s: float | None  # the queue's predicted wait of a ticket of the class parked then (None: none yet)
    at_risk: bool  # no ticket of the class, whatever its adapter, could count on preemption then
    shed_until: float  # its shedding window ends then (a refusal for its deadline or wait bound)
    pressured: bool  # its predicted wait was over `cold_shed_pressure` of its bound
    exempt: bool  # never shed cold: the most urgent class


class DrainEdge(NamedTuple):
    """The controller's drain meter at publication (`DrainMeter.head`): enough to compute its rate at
    any moment the state is valid, as the controller would then (its rate falls as its oldest events
    age, and steps when they leave the window), so that a refusal's retry-after is the controller's
    at the moment of refusal, not at publication."""

    window_s: float
    events: int  # events in the window at publication
    head: tuple[float, ...]  # the oldest events: those that leave within max_age_s, then one that stays

    def rate(self, now: float) -> float | None:
        """`DrainMeter.rate` at `now` (the controller's clock), no event recorded since publication.
        Exact while at most `DRAIN_HEAD` events leave the window within the state's max age; past
        that (hundreds of grants a second), the oldest event kept is the last of `head`, a rate that
        errs low by one event in hundreds."""
        head, gone = self.head, 0
        while gone < len(head) and now - head[gone] > self.window_s:
            gone += 1
        count = self.events - gone
        if count <= 0 or not head:
            return None
        return drain_rate(count, head[min(gone, len(head) - 1)], now, self.window_s)


class EdgeState(NamedTuple):
    """What the controller publishes for the edge (see the module docstring); the controller's clock.
    Tuples, cheap to build: the controller publishes one per batch window."""

    published_at: float
    max_age_s: float  # a part older than this refuses nothing (0: the edge is off)
    queue_size: int
    full: bool  # the queue was full and the controller had no room to grant
    least: tuple[int, float] | None  # the least urgent queued ticket's rank (`rank`)
    drain: DrainEdge  # the full queue's retry-after is computed from it at the moment of refusal
    top_priority: int | None
    aging_s: float
    cold_window_s: float
    classes: Mapping[str, ClassEdge]  # by class name
    held: frozenset[str] | None = None  # adapters some replica holds or loads (None: not published)
    held_at: float = float("-inf")
    held_max_age_s: float = 0.0  # the held adapters older than this refuse nothing cold

    def with_held(self, held: frozenset[str] | None, held_at: float) -> EdgeState:
        """This state with another publication's held adapters (they travel less often)."""
        return self._replace(held=held, held_at=held_at)

    def to_wire(self) -> dict[str, Any]:
        """A plain dict for a Ray reply (`from_wire` reads it back)."""
        wire = {k: getattr(self, k) for k in ("published_at", "max_age_s", "queue_size", "full", "least",
                                              "top_priority", "aging_s", "cold_window_s", "held_at",
                                              "held_max_age_s")}
        wire["drain"] = (self.drain.window_s, self.drain.events, list(self.drain.head))
        wire["classes"] = {name: (c.priority, c.ttft_s, c.wait_s, c.at_risk, c.shed_until, c.pressured,
                                  c.exempt) for name, c in self.classes.items()}
        wire["held"] = None if self.held is None else sorted(self.held)
        return wire

    @staticmethod
    def from_wire(wire: Mapping[str, Any]) -> EdgeState:
        least, (window_s, count, head) = wire["least"], wire["drain"]
        held = wire.get("held")
        return EdgeState(
            published_at=float(wire["published_at"]), max_age_s=float(wire["max_age_s"]),
            queue_size=int(wire["queue_size"]), full=bool(wire["full"]),
            least=None if least is None else (int(least[0]), float(least[1])),
            drain=DrainEdge(float(window_s), int(count), tuple(float(t) for t in head)),
            top_priority=None if wire["top_priority"] is None else int(wire["top_priority"]),
            aging_s=float(wire["aging_s"]), cold_window_s=float(wire["cold_window_s"]),
            classes={str(name): ClassEdge(int(c[0]), None if c[1] is None else float(c[1]),
                                          None if c[2] is None else float(c[2]), bool(c[3]), float(c[4]),
                                          bool(c[5]), bool(c[6])) for name, c in wire["classes"].items()},
            held=None if held is None else frozenset(str(a) for a in held),
            held_at=float(wire.get("held_at", float("-inf"))),
            held_max_age_s=float(wire.get("held_max_age_s", 0.0)))


def rank(ticket: Ticket, top_priority: int | None, aging_s: float) -> tuple[int, float]:
    """The queue's rank of `ticket` (`ClusterQueue._rank`): lower is more urgent."""
    tier = 0 if top_priority is not None and ticket.priority <= top_priority else 1
    return tier, ticket.priority + ticket.enqueued_at / aging_s


def edge_refusal(state: EdgeState, ticket: Ticket, now: float) -> tuple[str, ClusterOverloadedError] | None:
    """The controller's refusal of `ticket` as `state` shows it, with its reason (one of `REASONS`);
    None: park it (the controller decides). `now` and the ticket's times in the state's clock."""
    if state.max_age_s <= 0 or now - state.published_at > state.max_age_s:
        return None
    edge = state.classes.get(ticket.sla_class)
    if edge is not None and _cold(state, edge, ticket, now):
        return "cold_shed", ColdAdapterShedError(
            f"the {ticket.sla_class} class is over capacity and adapter {ticket.adapter_id!r} is loaded on "
            f"no replica: while a class sheds load, its requests that need their adapter loaded are refused "
            f"first (cold_shed_window_s, cold_shed_pressure)",
            retry_after_s=max(1.0, state.cold_window_s, edge.wait_s or 0.0))
    if state.full and not (state.least is not None
                           and state.least > rank(ticket, state.top_priority, state.aging_s)):
        return "queue_full", QueueFullError(
            f"the cluster queue is full ({state.queue_size} requests wait; cluster_queue_size)",
            retry_after_s=full_retry_after_s(state.queue_size, state.drain.rate(now)))
    if (edge is not None and edge.at_risk and edge.wait_s is not None and ticket.deadline is not None
            and now + edge.wait_s > ticket.deadline):
        return "deadline", DeadlineOutOfReachError(
            f"the {ticket.sla_class} class's time-to-first-token target of {ticket.ttft_s:g} s cannot be "
            f"met: about {edge.wait_s:.1f} s of queued work is ahead",
            retry_after_s=edge.wait_s)
    return None


def _cold(state: EdgeState, edge: ClassEdge, ticket: Ticket, now: float) -> bool:
    """Its class sheds cold requests and no replica held its adapter (`ColdShedding.refuses`)."""
    if edge.exempt or ticket.adapter_id is None or state.held is None:
        return False
    if now - state.held_at > state.held_max_age_s or ticket.adapter_id in state.held:
        return False
    return now < edge.shed_until or edge.pressured


class EdgeView:
    """The latest `EdgeState` an ingress received, on the ingress's clock: `offer` each state as it
    arrives (a reply's, a fetch's), `refusal` per request. The state's clock is mapped onto the
    ingress's at arrival, so ages count from then."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.state: EdgeState | None = None
        self._offset = 0.0  # the state's clock minus this one, at its arrival

    def offer(self, state: EdgeState) -> None:
        """A state arrived. One published before the state held is dropped (a reply that was on its
        way), unless the held one is past its bound (a restarted controller's clock may start
        lower). One without held adapters keeps the last held adapters received (they come with the
        periodic fetch only), with their own age."""
        now = self._clock()
        held = self.state
        if (held is not None and state.published_at < held.published_at
                and now + self._offset - held.published_at <= held.max_age_s):
            return
        offset = state.published_at - now
        if state.held is None and self.state is not None and self.state.held is not None:
            held_at = self.state.held_at - self._offset + offset  # its arrival, in the new state's clock
            state = state.with_held(self.state.held, held_at)
        self.state, self._offset = state, offset

    def ticket(self, ticket_id: str, ingress_id: str, sla_class: str, adapter_id: str | None,
               arrived_at: float) -> Ticket | None:
        """The ticket the controller would queue for a request of `sla_class` that arrived at
        `arrived_at` (this clock), from the class's priority and TTFT target as published (None: no
        state yet, or a class it does not list)."""
        edge = None if self.state is None else self.state.classes.get(sla_class)
        if edge is None:
            return None
        deadline = None if edge.ttft_s is None else arrived_at + edge.ttft_s
        return Ticket(ticket_id, ingress_id, sla_class, edge.priority, adapter_id, arrived_at, deadline,
                      edge.ttft_s)

    def refusal(self, ticket: Ticket, arrived_at: float) -> tuple[str, ClusterOverloadedError] | None:
        """`edge_refusal` for `ticket` (its times on this clock, `arrived_at` its arrival), or None."""
        state = self.state
        if state is None:
            return None
        offset = self._offset
        deadline = None if ticket.deadline is None else ticket.deadline + offset
        moved = replace(ticket, enqueued_at=arrived_at + offset, deadline=deadline)
        return edge_refusal(state, moved, self._clock() + offset)


__all__ = ["REASONS", "ClassEdge", "DrainEdge", "EdgeState", "EdgeView", "edge_refusal", "rank"]

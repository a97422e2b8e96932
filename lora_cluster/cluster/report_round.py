"""One replica's rounds of reports to the controller's shards: which shards a round goes to, what each
is sent, and the replies taken back as one (pure, no I/O: the caller sends).

The live replica (`serve.replica.reporter.ControllerReporter`, over Ray handles) and the simulator
(`sim.sharded_controller`, by direct calls) both run a round through this one object, so the
simulator checks the composition the server runs:

1. `arrived(ticket_id, adapter_id)`: a granted ticket reached the replica; its adapter's shard
   (`shard_of`) granted it, so that shard alone is told of it, and its grant took one slot of its own
   share of the room.
2. `messages(report)`: the report each shard gets, in shard order, or None for a shard the round
   does not concern. Each shard's report is cut to its own adapters (`sharding.shard_report`) and
   carries its share of the replica's free room (`split_room`, from the queue depths of the shards'
   last replies and the shares they hold; the round number rotates who gets a remainder slot),
   encoded by that shard's own `ReportEncoder` (a delta against what that shard acknowledged, or a
   full report). A round concerns shard k, and goes to it, when
   * the room it may still grant changed: its new share differs from the share it was last sent
     less its grants that arrived since (an arrival alone changes nothing there: the shard counts
     its grant against its share until it hears of the arrival, which is the same room),
   * its adapters resident, loading, in the host tier or on the node's cluster tier changed,
   * an arrived ticket's shard is not known (that one goes to every shard),
   * its encoder owes it a full report (the first, one every `full_every_s`, or a `resync`), or
   * `heartbeat_s` passed since it was last sent one (so a shard that nothing concerns still hears
     that the replica lives, and its load, well within `ControllerSettings.stale_after_s`, and its
     grants' arrivals well within `grant_ttl_s`).
   A shard's events (its arrived tickets, the requests per adapter of its adapters) wait for the
   next report it is sent, summed over the rounds in between. So a shard's view of the replica's
   shared fields (running, waiting, the per-class stats, prefixes) and of its adapters' demand is at
   most `heartbeat_s` older than the replica's last report, and exactly as fresh for what its grants
   depend on: the room it may grant and its adapters' residency. With one shard the report goes as
   built, without a room, every round.
3. `replied(replies)`: each sent shard's reply, or None for a sent shard that could not be reached
   (it counts as queueing nothing, so no room is held back for it; its successor starts empty);
   entries of shards not sent to are ignored. Each reply acknowledges its encoder's report and sets
   that shard's queue depth; the answered replies merge into one (`merge_replies`: queue depths
   summed, prefetch lists united, each shard's list cut to the adapters it owns). Returns that
   reply (None when no sent shard answered; a round sent to no shard is answered at once with the
   depths known) and whether any shard asked for a full report (`resync`: the caller reports again
   soon).

Invariants: `queued` holds one depth per shard, each from the latest reply of that shard (0 for a
silent one), and `queue_depth` is their sum, what the replica acts on
(`report_rules.report_on_finish`); `rooms[k]` is the share shard k was last sent, so a shard's
share changes only in a report it receives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lora_cluster.cluster.report_delta import ReportDelta, ReportEncoder
from lora_cluster.cluster.reports import MAX_ARRIVED_TICKETS, MAX_REPORTED_ADAPTERS, ReplicaReport
from lora_cluster.cluster.sharding import merge_replies, owns, shard_of, shard_report, split_room

SHARD_HEARTBEAT_S = 1.0  # each shard hears from a replica at least this often (controller_shard_heartbeat_s)
# arrived tickets whose shard is kept until a report lists them; past it the oldest is forgotten (a
# ticket that no report listed: it left the replica's bounded list), and a forgotten one goes to every shard
MAX_TICKETS_KEPT = 4096

Lists = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def _lists(report: ReplicaReport) -> Lists:
    return report.resident, report.loading, report.host_held, report.cluster_held


def _busiest(requests: dict[str, int]) -> dict[str, int]:
    """The `MAX_REPORTED_ADAPTERS` adapters with the most requests (a report's bound)."""
    if len(requests) <= MAX_REPORTED_ADAPTERS:
        return requests
    return dict(sorted(requests.items(), key=lambda item: -item[1])[:MAX_REPORTED_ADAPTERS])


class ReportRounds:
    """The report rounds of one replica to `shards` controller shards (see the module docstring)."""

    def __init__(self, shards: int, clock: Callable[[], float], heartbeat_s: float = SHARD_HEARTBEAT_S):
        if shards < 1:
            raise ValueError(f"a controller has at least one shard, got {shards}")
        self.encoders = [ReportEncoder(clock=clock) for _ in range(shards)]
        self.queued = [0] * shards  # each shard's queue depth, from its last reply
        self.rooms = [0] * shards  # the room share each shard was last sent
        self.rounds = 0
        self.heartbeat_s, self._clock = heartbeat_s, clock
        self._sent_at = [-float("inf")] * shards
        self._lists: list[Lists | None] = [None] * shards  # its adapters as last sent to each shard
        self._sent: list[bool] = [False] * shards  # the current round went to this shard
        self._tickets: dict[str, int] = {}  # arrived ticket -> the shard that granted it
        self._arrived: list[list[str]] = [[] for _ in range(shards)]  # each shard's, not sent yet
        self._requests: list[dict[str, int]] = [{} for _ in range(shards)]  # per adapter, not sent yet
        self._seen = 0  # replicas the shards see, from the latest replies

    @property
    def queue_depth(self) -> int:
        return sum(self.queued)

    def arrived(self, ticket_id: str, adapter_id: str | None) -> None:
        """A granted ticket of `adapter_id` reached the replica (step 1)."""
        if len(self.encoders) > 1:
            if len(self._tickets) >= MAX_TICKETS_KEPT:
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket_id] = shard_of(adapter_id, len(self.encoders))

    def messages(self, report: ReplicaReport) -> list[ReplicaReport | ReportDelta | None]:
        """What each shard is sent for `report`, in shard order; None: not sent (step 2)."""
        self.rounds += 1
        n = len(self.encoders)
        if n == 1:
            self._sent = [True]
            return [self.encoders[0].encode(report)]
        unknown = self._take_events(report)
        # what each shard may still grant: its share, less its grants that arrived since it was told
        held = [max(0, room - len(self._arrived[k])) for k, room in enumerate(self.rooms)]
        rooms = split_room(report.capacity - report.ongoing, self.queued, turn=self.rounds, held=held)
        now = self._clock()
        out: list[ReplicaReport | ReportDelta | None] = []
        for k, encoder in enumerate(self.encoders):
            message = shard_report(report, k, n, rooms[k], tuple(self._arrived[k]) + unknown)
            lists = _lists(message)
            concerned = (rooms[k] != held[k] or bool(unknown) or lists != self._lists[k]
                         or encoder.needs_full or now - self._sent_at[k] >= self.heartbeat_s)
            self._sent[k] = concerned
            if not concerned:
                out.append(None)
                continue
            message = dataclasses.replace(message, adapter_requests=_busiest(self._requests[k]))
            self.rooms[k], self._lists[k], self._sent_at[k] = rooms[k], lists, now
            self._arrived[k], self._requests[k] = [], {}
            out.append(encoder.encode(message))
        return out

    def _take_events(self, report: ReplicaReport) -> tuple[str, ...]:
        """`report`'s events kept for the shards they belong to until each is next sent a report:
        its arrived tickets by the shard that granted them, its requests per adapter by the adapter's
        shard. Returns the arrived tickets whose shard is not known (they go to every shard now)."""
        n = len(self.encoders)
        unknown: list[str] = []
        for ticket in report.arrived_tickets:
            k = self._tickets.pop(ticket, -1)
            if k < 0:
                unknown.append(ticket)
            elif len(self._arrived[k]) < MAX_ARRIVED_TICKETS:
                self._arrived[k].append(ticket)
        for adapter_id, count in report.adapter_requests.items():
            requests = self._requests[shard_of(adapter_id, n)]
            requests[adapter_id] = requests.get(adapter_id, 0) + count
        return tuple(unknown)

    def replied(self, replies: Sequence[Mapping[str, Any] | None]) -> tuple[dict[str, Any] | None, bool]:
        """The round's replies taken back (step 3): (the merged reply or None, resync asked)."""
        n = len(self.encoders)
        answered: list[dict[str, Any]] = []
        resync = False
        for k, reply in enumerate(replies):
            if not self._sent[k]:
                continue
            if reply is None:
                self.queued[k] = 0
                continue
            self.encoders[k].replied(reply)
            resync = resync or bool(reply.get("resync"))
            self.queued[k] = int(reply.get("queue_depth", 0))
            answered.append(dict(reply) if n == 1 else
                            {**reply, "prefetch": [a for a in reply.get("prefetch", ()) if owns(a, k, n)]})
        if not any(self._sent):  # nothing concerned any shard: the depths known stand
            return {"queue_depth": self.queue_depth, "prefetch": [], "replicas": self._seen}, False
        if not answered:
            return None, resync
        merged = answered[0] if n == 1 else {**merge_replies(answered), "queue_depth": self.queue_depth}
        self._seen = int(merged.get("replicas", self._seen))
        return merged, resync

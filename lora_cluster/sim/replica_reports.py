"""The simulated replicas' reports to the cluster controller, paced as the live reporter paces them
(`serve.replica.reporter.ControllerReporter`: the same `report_rules.ReportPacer` and `ReportEncoder`).

Each replica reports every `controller_report_period_s` and, when a request finishes while its last
reply said tickets are queued or while it was full (`report_on_finish`), at most one such report per
`controller_report_coalesce_s`; both stretch to `replicas / controller_report_budget_per_s` as the
controller's replies say how many replicas it sees (`ReportPacer.pace`). One report at a time per
replica: a report due while the previous one awaits its reply goes right after it. A report lists
the granted tickets that arrived since the previous one; its reply's `prefetch` list is fetched into
host memory. With the controller's loop modelled (`sim.control_inbox`), a report's room is granted
at its turn's end and its reply leaves then; with a positive batch window, when the window is sent;
else at once. With `controller_shards` > 1 a report is a round (`cluster.report_round.ReportRounds`,
as the live reporter sends it): one report to each shard, each an input of that shard's loop, the
round replied when every shard has answered. Deterministic: every time is the simulated clock's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.report_delta import ReportEncoder
from lora_cluster.cluster.report_round import ReportRounds
from lora_cluster.cluster.report_rules import ReportPacer, report_on_finish
from lora_cluster.config import ControllerConfig
from lora_cluster.sim.control_inbox import ShardPlane
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.replica import SimReplica

Call = Callable[..., Any]  # the policy's timed controller call: call(shard, name, fn, *args)


class SimReporters:
    """Every simulated replica's reporter (see the module docstring). `queue_depth[rid]` is the queue
    depth the replica last heard of; `arrived[rid]` its granted tickets not reported yet."""

    def __init__(self, replicas: dict[str, SimReplica], loop: EventLoop, control: ControllerConfig, *,
                 planes: list[ShardPlane], shards: list[Controller], call: Call,
                 taken: Callable[[str], int], depth: Callable[[], int]):
        self.replicas, self.loop, self.control = replicas, loop, control
        self.planes, self.shards, self._call = planes, shards, call
        self.inbox, self.window = planes[0].inbox, planes[0].window
        self.sharded, self._taken, self._depth = len(shards) > 1, taken, depth
        n = len(shards)
        heartbeat_s = control.controller_shard_heartbeat_s
        self._rounds = ({rid: ReportRounds(n, loop.clock, heartbeat_s) for rid in replicas}
                        if self.sharded else {})
        self.in_flight: dict[str, bool] = {}  # replica -> its report awaits its reply; another is due after
        self.arrived: dict[str, list[str]] = {rid: [] for rid in replicas}
        self.queue_depth = dict.fromkeys(replicas, 0)
        self._report_at: dict[str, float] = {}
        self._version = dict.fromkeys(replicas, 0)
        self.pacers = {rid: ReportPacer(period_s=control.controller_report_period_s,
                                        coalesce_s=control.controller_report_coalesce_s, clock=loop.clock,
                                        budget_per_s=control.controller_report_budget_per_s)
                       for rid in replicas}
        self.encoders = {rid: ReportEncoder(clock=loop.clock) for rid in replicas}

    def start(self) -> None:
        """Stagger the first reports over one period."""
        n = len(self.replicas)
        for i, rid in enumerate(sorted(self.replicas)):
            self.schedule(rid, self.control.controller_report_period_s * i / n)

    def ticket_arrived(self, replica_id: str, ticket_id: str, adapter_id: str | None) -> None:
        """A granted ticket of `adapter_id` reached `replica_id`: its next report tells of it (with
        shards, the shard that granted it)."""
        self.arrived[replica_id].append(ticket_id)
        if self.sharded:
            self._rounds[replica_id].arrived(ticket_id, adapter_id)

    def finished(self, replica: SimReplica) -> None:
        """One of `replica`'s requests ended: report soon if `report_on_finish` says so."""
        rid = replica.replica_id
        if report_on_finish(self.queue_depth[rid], replica.ongoing + 1, self._taken(rid)):
            self.schedule(rid, self.pacers[rid].finish_at())

    def schedule(self, replica_id: str, when: float) -> None:
        """A report of `replica_id` at `when`, unless one is due sooner."""
        pending = self._report_at.get(replica_id)
        if pending is not None and pending <= when:
            return
        self._report_at[replica_id] = when
        self._version[replica_id] += 1
        self.loop.at(when, self._report, replica_id, self._version[replica_id])

    def _report(self, replica_id: str, version: int) -> None:
        if version != self._version[replica_id]:
            return
        del self._report_at[replica_id]
        if replica_id in self.in_flight:  # as the live reporter: one report at a time, the next after it
            self.in_flight[replica_id] = True
            return
        self.pacers[replica_id].sent()
        arrived, self.arrived[replica_id] = tuple(self.arrived[replica_id]), []
        built = self.replicas[replica_id].report(self._taken(replica_id), self.loop.now, arrived)
        if self.sharded:
            self._round(replica_id, built)
            return
        sent = self.encoders[replica_id].encode(built)
        self.inbox.input("report", partial(self._act, replica_id, sent))

    def _round(self, replica_id: str, built: Any) -> None:
        """One round of reports, each to the loop of a shard it concerns (see the module docstring);
        a round that concerns no shard is answered at once."""
        self.in_flight[replica_id] = False
        messages = self._rounds[replica_id].messages(built)
        replies: list[dict[str, Any] | None] = [None] * len(messages)
        waiting = [m is not None for m in messages]
        if not any(waiting):
            self._round_replied(replica_id, replies)
            return
        for k, message in enumerate(messages):
            if message is not None:
                self.planes[k].inbox.input("report", partial(self._shard_act, replica_id, k, message,
                                                             replies, waiting))

    def _shard_act(self, replica_id: str, k: int, message: Any, replies: list[dict[str, Any] | None],
                   waiting: list[bool]) -> Callable[[], None] | None:
        """Shard `k` takes its report without a dispatch; its window dispatches for its room."""
        reply = self._call(k, "report", self.shards[k].report, message, False)
        answer = partial(self._shard_replied, replica_id, k, reply, replies, waiting)
        plane = self.planes[k]
        if plane.inbox.loop is not None:
            plane.window.dispatch_soon()
            return answer
        plane.window.on_sent(answer)
        return None

    def _shard_replied(self, replica_id: str, k: int, reply: dict[str, Any],
                       replies: list[dict[str, Any] | None], waiting: list[bool]) -> None:
        """Shard `k`'s reply (its queue as its dispatch left it); the round's, once every shard sent
        to has answered."""
        replies[k] = {**reply, "queue_depth": len(self.shards[k].queue)}
        waiting[k] = False
        if not any(waiting):
            self._round_replied(replica_id, replies)

    def _round_replied(self, replica_id: str, replies: list[dict[str, Any] | None]) -> None:
        merged, resync = self._rounds[replica_id].replied(replies)
        reply = {**(merged or {"queue_depth": 0, "prefetch": []}), "resync": resync}
        self._replied(replica_id, reply)
        self.queue_depth[replica_id] = self._rounds[replica_id].queue_depth

    def _act(self, replica_id: str, sent: Any) -> Callable[[], None] | None:
        """The controller takes a report (see the module docstring for when its room is granted)."""
        windowed = self.control.controller_batch_window_s > 0
        reply = self._call(0, "report", self.shards[0].report, sent, not (windowed or self.inbox.loop))
        if windowed:  # its room is granted when the window is sent, and its reply's depth set then
            self.window.on_sent(partial(self._reply_depth, replica_id))
        elif self.inbox.loop is not None:
            self.window.dispatch_soon()
            self.in_flight[replica_id] = False
            return partial(self._replied, replica_id, reply)
        self._replied(replica_id, reply)
        if not windowed:
            self.inbox.deliver()
        return None

    def _reply_depth(self, replica_id: str) -> None:
        """A report of the window gets its reply's queue depth: what is left after its dispatch."""
        self.queue_depth[replica_id] = self._depth()

    def _replied(self, replica_id: str, reply: dict[str, Any]) -> None:
        """A report's reply reaches its replica (with the loop, the queue as its turn left it)."""
        if not self.sharded:
            self.encoders[replica_id].replied(reply)
        self.queue_depth[replica_id] = int(reply["queue_depth"])
        if self.inbox.loop is not None and not self.sharded:
            self._reply_depth(replica_id)
        for adapter_id in reply["prefetch"]:
            self.replicas[replica_id].prefetch(adapter_id)
        pacer, due = self.pacers[replica_id], self.in_flight.pop(replica_id, False)
        pacer.pace(int(reply.get("replicas", 0)))
        soon = due or reply.get("resync")
        self.schedule(replica_id, pacer.finish_at() if soon else pacer.periodic_at())

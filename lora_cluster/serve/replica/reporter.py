"""A LoRA replica's reports to the cluster controller.

A report period after its previous report, and when one of its requests finishes while the
controller said requests are queued or while the replica was full (`report_on_finish`: a freed slot
is then granted without waiting for the period; a full replica cannot know whether a ticket was
parked since its last report, so it tells the controller of every slot it frees), the replica sends
a report: at once, or, when it reported less than `coalesce_s` ago, at the end of that window, one
report for every finish inside it (`ReportPacer`). The replica builds a `ReplicaReport` (engine
stats, memory split, per-class stats, requests per adapter since the last report); what goes out
is, mostly, its delta against the report the controller last acknowledged, and a full report first,
periodically, and at once when the controller's reply says it lacks the delta's base (`resync`: a
restarted controller) (`ReportEncoder`). The reply names adapters to prefetch (placement chose this
replica for them), how many requests are queued, and how many replicas the controller sees: the
window and the period stretch to keep the controller within `budget_per_s` reports a second
(`controller_report_budget_per_s`, `ReportPacer.pace`). A controller that cannot be reached is retried
at the next period; the replica keeps serving meanwhile.

A controller in shards (`cluster.sharding`; `controller` is then the list of the shards' handles):
each round of reports goes at once to the shards it concerns (one pacer: the rounds per second do not
grow with the shards). Which shards those are, what each is sent and how the replies merge is
`cluster.report_round.ReportRounds`, the object the simulator runs too: a shard whose room share,
adapters or arrived tickets changed, or that has not heard from the replica for
`controller_shard_heartbeat_s`; one encoder per shard (deltas and resyncs per shard), each report
listing that shard's adapters and tickets only and carrying the share of the replica's free room that
shard may grant; the queue depth the replica acts on is the sum of the shards', its prefetch list
the union. A shard that cannot be reached counts as queueing nothing (no room is held back for it:
its tickets park again at its successor, which starts empty) and is retried with the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lora_cluster.cluster.report_round import SHARD_HEARTBEAT_S, ReportRounds
from lora_cluster.cluster.report_rules import ReportPacer, report_on_finish
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.serve.ops.background import keep_running, within

log = logging.getLogger(__name__)


class ControllerReporter:
    def __init__(self, controller: Any, build_report: Callable[[], Awaitable[ReplicaReport]],
                 on_reply: Callable[[dict[str, Any]], Awaitable[None]], period_s: float,
                 coalesce_s: float = 0.2, clock: Callable[[], float] = time.monotonic,
                 budget_per_s: float = 0.0, heartbeat_s: float = SHARD_HEARTBEAT_S):
        """`controller`: the controller's handle, or the list of its shards' handles."""
        self._shards = list(controller) if isinstance(controller, list | tuple) else [controller]
        self._build, self._on_reply = build_report, on_reply
        self.period_s, self._clock = period_s, clock
        self.pacer = ReportPacer(period_s=period_s, coalesce_s=coalesce_s, clock=clock,
                                 budget_per_s=budget_per_s)
        # encoders, shards' depths and room shares (as the simulator)
        self.rounds = ReportRounds(len(self._shards), clock, heartbeat_s)
        self.queue_depth = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = keep_running(self._task, self._run)

    def ticket_arrived(self, ticket_id: str | None, adapter_id: str | None) -> None:
        """A granted ticket of `adapter_id` reached the replica: a report tells its shard (a request
        that was not granted, `ticket_id` None: nothing to tell)."""
        if ticket_id is not None:
            self.rounds.arrived(ticket_id, adapter_id)

    def request_finished(self, ongoing_before: int, capacity: int) -> None:
        """A request ended here (`ongoing_before` requests ran before it ended, of `capacity`):
        report now, or at the end of the coalescing window, when `report_on_finish` says so."""
        if report_on_finish(self.queue_depth, ongoing_before, capacity):
            self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), max(0.0, self.pacer.periodic_at() - self._clock()))
            if self._wake.is_set():  # a finish to tell: finishes until the window's end share the report
                await asyncio.sleep(max(0.0, self.pacer.finish_at() - self._clock()))
            self._wake.clear()
            await self.report_once()

    async def report_once(self) -> None:
        """Build and send one report. A report that cannot be built is a defect of this replica:
        logged as an error (the controller, which sees no report, grants it nothing); a controller
        that cannot be reached is retried at the next period."""
        self.pacer.sent()
        try:
            payloads = [None if message is None else message.to_dict()
                        for message in self.rounds.messages(await self._build())]
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the replica's report to the cluster controller could not be built")
            return
        replies = await asyncio.gather(*(self._send(shard, payload)
                                         for shard, payload in zip(self._shards, payloads, strict=True)))
        reply, resync = self.rounds.replied(replies)
        if resync:  # a shard lacks this replica's state: a full report to it now
            self._wake.set()
        if reply is None:  # no shard answered: retried at the next period
            return
        self.queue_depth = self.rounds.queue_depth
        self.pacer.pace(int(reply.get("replicas", 0)))
        await self._on_reply(reply)

    @staticmethod
    async def _send(controller: Any, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        """One shard's reply to `payload` (None: the shard could not be reached, or nothing to send)."""
        if payload is None:
            return None
        try:
            return await controller.report.remote(payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("cluster controller unreachable: %s", exc)
            return None

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

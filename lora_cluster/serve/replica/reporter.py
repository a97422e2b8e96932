"""A LoRA replica's reports to the cluster controller.

Every `period_s`, and at once when one of its requests finishes while the controller said requests
are queued or while the replica was full (`report_on_finish`: a freed slot is then granted without
waiting for the period; a full replica cannot know whether a ticket was parked since its last
report, so it tells the controller of every slot it frees), the replica sends a
`ReplicaReport` (built by the replica: engine stats, memory split, per-class stats, requests per
adapter since the last report). The reply names adapters to prefetch (placement chose this replica
for them) and how many requests are queued. A controller that cannot be reached is retried at the
next period; the replica keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from lora_cluster.cluster.report_rules import MIN_GAP_S, report_on_finish
from lora_cluster.serve.ops.logs import detached

log = logging.getLogger(__name__)

class ControllerReporter:
    def __init__(self, controller: Any, build_report: Callable[[], Awaitable[dict[str, Any]]],
                 on_reply: Callable[[dict[str, Any]], Awaitable[None]], period_s: float):
        self._controller, self._build, self._on_reply = controller, build_report, on_reply
        self.period_s = period_s
        self.queue_depth = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), context=detached())

    def request_finished(self, ongoing_before: int, capacity: int) -> None:
        """A request ended here (`ongoing_before` requests ran before it ended, of `capacity`):
        report now when `report_on_finish` says so."""
        if report_on_finish(self.queue_depth, ongoing_before, capacity):
            self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.period_s)
            self._wake.clear()
            await self.report_once()
            await asyncio.sleep(MIN_GAP_S)

    async def report_once(self) -> None:
        """Build and send one report. A report that cannot be built is a defect of this replica:
        logged as an error (the controller, which sees no report, grants it nothing); a controller
        that cannot be reached is retried at the next period."""
        try:
            report = await self._build()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the replica's report to the cluster controller could not be built")
            return
        try:
            reply = await self._controller.report.remote(report)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("cluster controller unreachable: %s", exc)
            return
        self.queue_depth = int(reply.get("queue_depth", 0))
        await self._on_reply(reply)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

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
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from lora_cluster.cluster.reports import MAX_REPORTED_ADAPTERS
from lora_cluster.serve.logs import detached

log = logging.getLogger(__name__)

MIN_GAP_S = 0.02  # reports triggered by finishing requests are at least this far apart
MAX_TRACKED_ADAPTERS = 4 * MAX_REPORTED_ADAPTERS


def report_on_finish(queue_depth: int, ongoing_before: int, capacity: int) -> bool:
    """Whether a replica reports at once when one of its requests finishes: the controller's last
    reply said tickets were queued (`queue_depth`), or the replica was full before it finished
    (`ongoing_before` >= `capacity`), so that a ticket parked since that reply is granted the freed
    slot now rather than a report period later. A replica with room reports on its period only."""
    return queue_depth > 0 or ongoing_before >= capacity


class AdapterDemand:
    """Requests per adapter since the last report, bounded (ids beyond the bound are not counted)."""

    def __init__(self, max_adapters: int = MAX_TRACKED_ADAPTERS):
        self.max_adapters = max_adapters
        self._counts: Counter[str] = Counter()

    def record(self, adapter_id: str | None) -> None:
        if adapter_id is not None and (adapter_id in self._counts or len(self._counts) < self.max_adapters):
            self._counts[adapter_id] += 1

    def take(self) -> dict[str, int]:
        """The busiest adapters since the last call; resets the counts."""
        counts, self._counts = self._counts, Counter()
        return dict(counts.most_common(MAX_REPORTED_ADAPTERS))


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
        try:
            reply = await self._controller.report.remote(await self._build())
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

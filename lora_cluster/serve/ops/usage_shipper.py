"""Sends a process's usage records to the usage store in one call per interval, and at shutdown.

The owner (a LoRA replica, the ingress for the requests it refuses) adds each request's record to the
shipper's `UsageBuffer` as the request ends; never a call per request. Every `interval_s` a
background task takes the whole buffer and sends it with `send` (the `UsageSink` deployment's
`record` through its handle, wired by the caller); a batch that fails or does not answer within
`timeout_s` is put back and sent with the next one (the store merges by request id, so a batch that
did land before its reply was lost counts once more only in device- and queue-seconds of the parts
sent twice: see `docs/metering.md`). `close` sends what is left, once, within `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from lora_cluster.serve.ops.background import within
from lora_cluster.tenancy.usage_buffer import UsageBuffer
from lora_cluster.tenancy.usage_record import UsageRecord

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 10.0

Send = Callable[[list[UsageRecord]], Awaitable[object]]


class UsageShipper:
    """A bounded buffer of records and the task that flushes it (see the module docstring). With
    `background=False` nothing runs in the background: the owner calls `flush` (tests)."""

    def __init__(self, send: Send, interval_s: float = 5.0, *, buffer: UsageBuffer | None = None,
                 timeout_s: float = SEND_TIMEOUT_S, background: bool = True):
        self._send, self.interval_s, self.timeout_s = send, interval_s, timeout_s
        self.buffer = buffer if buffer is not None else UsageBuffer()
        self.background = background
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self._dropped_logged = 0

    def add(self, record: UsageRecord) -> None:
        """Keep `record` for the next flush (starts the flushing task on the running loop if needed)."""
        self.buffer.add(record)
        if self.background and (self._task is None or self._task.done()):
            try:
                self._task = asyncio.get_running_loop().create_task(self._flush_forever())
            except RuntimeError:  # no loop here (a generator finalized late): the next add starts it
                self._task = None

    async def flush(self) -> bool:
        """Send the buffer in one call; False (and the batch put back) if the call failed."""
        batch = self.buffer.take()
        if self.buffer.dropped > self._dropped_logged:
            log.warning("usage: %d records dropped, the buffer was full",
                        self.buffer.dropped - self._dropped_logged)
            self._dropped_logged = self.buffer.dropped
        if not batch:
            return True
        try:
            await within(self._send(batch), self.timeout_s)
        except Exception as exc:
            self.buffer.put_back(batch)
            log.warning("usage: sending %d records failed (%s); the next flush sends them again",
                        len(batch), type(exc).__name__)
            return False
        self.sent += len(batch)
        return True

    async def close(self) -> None:
        """Stop the task and send what is left (once)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.flush()

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()


__all__ = ["SEND_TIMEOUT_S", "UsageShipper"]

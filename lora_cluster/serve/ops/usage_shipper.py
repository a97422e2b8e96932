"""Sends a process's usage records to the usage store in one call per interval, and at shutdown.

The owner (a LoRA replica, the ingress for the requests it refuses) adds each request's record to the
shipper's `UsageBuffer` as the request ends; never a call per request. Every `interval_s` a
background task takes the whole buffer as one `UsageBatch` and sends it with `send` (the `UsageSink`
deployment's `record` through its handle, wired by the caller).

Exactly once: each batch carries this shipper's `source` (the owner's id plus a random suffix, so a
restarted process never reuses a predecessor's numbers) and the next `seq`. A batch that fails or does
not answer within `timeout_s` stays pending and is sent again, unchanged and under the same id, before
any new batch is made; records that arrive meanwhile wait in the buffer. A batch that landed but whose
reply was lost is therefore a repeat of an id the store has taken, and the store writes nothing for it
(`UsageStore.record_batch`). `close` sends the pending batch and what is left, within `timeout_s` each.

With a spool (`tenancy.usage_spool.UsageSpool`, node-local files), every record the buffer accepts is
written to it as it is added, a batch's file is cut with the batch and deleted when the store
acknowledges it: a process killed without a graceful stop loses nothing it had accepted. After each
flush the store acknowledged, the shipper adopts one dead sender's spool on its node (if any) and
sends its batches under the dead sender's id and seqs, so they too are taken exactly once; a send
that fails keeps the adopted spool (and its lock) for the next flush. `close` deletes its own spool
once nothing is unacknowledged, and otherwise leaves it for another process on the node to adopt.

Residency: with `take` (a replica's: `take_meter` through `AsyncEngine.call`, so the engine's meter
is read on its own thread), each new batch also carries the slot-seconds and load seconds per adapter
that `take` hands over (`StepMeter.take_residency`, `take_loads`), keyed by the Unix minute they were
taken in and the owner as replica (`usage_record.Residency`); a batch with residency and no records
is sent too. A pending batch keeps its residency when it is sent again, so the store takes it once.
The spool holds records only: the residency of a batch not yet acknowledged when the process is
killed (at most the last interval's) is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from lora_cluster.serve.ops.background import within
from lora_cluster.tenancy.usage_buffer import UsageBuffer
from lora_cluster.tenancy.usage_record import MAX_FIELD_CHARS, Residency, UsageBatch, UsageRecord
from lora_cluster.tenancy.usage_spool import DeadSpool, UsageSpool

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 10.0

Send = Callable[[UsageBatch], Awaitable[object]]
Take = Callable[[], Awaitable[Any]]  # -> (slot-seconds, load seconds) per adapter id since the last take


def take_meter(engine: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The engine's slot-seconds and load seconds per adapter since the last take (on its thread)."""
    return engine.meter.take_residency(), engine.meter.take_loads()


def residency_parts(minute: int, replica: str, slot_s: dict[str, float],
                    load_s: dict[str, float]) -> tuple[Residency, ...]:
    """One `Residency` per adapter with slot or load time, the adapter id bounded like a record's."""
    return tuple(Residency(minute, adapter[:MAX_FIELD_CHARS], replica[:MAX_FIELD_CHARS],
                           max(0.0, slot_s.get(adapter, 0.0)), max(0.0, load_s.get(adapter, 0.0)))
                 for adapter in sorted({**slot_s, **load_s}))


def open_spool(folder: str, source: str) -> UsageSpool | None:
    """The sender's spool under `folder`, or None (logged) when the folder cannot be written: the
    records then live only in memory until they are sent."""
    try:
        return UsageSpool.open(folder, source)
    except OSError as exc:
        log.warning("usage: no spool in %s (%s); records wait in memory only", folder, exc)
        return None


class UsageShipper:
    """A bounded buffer of records and the task that flushes it (see the module docstring). With
    `background=False` nothing runs in the background: the owner calls `flush` (tests)."""

    def __init__(self, send: Send, interval_s: float = 5.0, *, owner: str = "",
                 buffer: UsageBuffer | None = None, timeout_s: float = SEND_TIMEOUT_S,
                 background: bool = True, spool_dir: str | None = None, take: Take | None = None,
                 clock: Callable[[], float] = time.time):
        self._send, self.interval_s, self.timeout_s = send, interval_s, timeout_s
        self.owner, self._take, self._clock = owner, take, clock
        self.source = f"{owner[:MAX_FIELD_CHARS - 13]}-{uuid.uuid4().hex[:12]}"
        self.spool = None if not spool_dir else open_spool(spool_dir, self.source)
        self._adopted: DeadSpool | None = None  # a dead sender's spool being sent (its lock held)
        self.adopted = 0  # records of dead senders' spools this shipper sent
        self._seq = 0
        self._pending: UsageBatch | None = None  # sent, not acknowledged: sent again as it is
        self.buffer = buffer if buffer is not None else UsageBuffer()
        self.background = background
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self._dropped_logged = 0

    def add(self, record: UsageRecord) -> None:
        """Keep `record` for the next flush (starts the flushing task on the running loop if needed)."""
        if self.buffer.add(record) and self.spool is not None:
            self.spool.append(record)
        self.start()

    def start(self) -> None:
        """Start the flushing task on the running loop unless it runs (the owner calls it early, so
        that dead senders' spools are adopted before its first request ends)."""
        if self.background and (self._task is None or self._task.done()):
            try:
                self._task = asyncio.get_running_loop().create_task(self._flush_forever())
            except RuntimeError:  # no loop here (a generator finalized late): the next add starts it
                self._task = None

    @property
    def pending(self) -> int:
        """Records sent but not acknowledged yet (0 or the pending batch's size)."""
        return 0 if self._pending is None else len(self._pending.records)

    async def flush(self) -> bool:
        """Send one batch: the pending one if a send of it failed, else the buffer's records; False
        (the batch kept pending) if the call failed."""
        if self.buffer.dropped > self._dropped_logged:
            log.warning("usage: %d records dropped, the buffer was full",
                        self.buffer.dropped - self._dropped_logged)
            self._dropped_logged = self.buffer.dropped
        if self._pending is None:
            residency = await self._take_residency()
            records = self.buffer.take()
            if not records and not residency:
                return True
            self._seq += 1
            self._pending = UsageBatch(self.source, self._seq, tuple(records), residency)
            if self.spool is not None:
                self.spool.cut(self._seq)  # in the same step as the take: the file is the batch
        batch = self._pending
        if not await self._deliver(batch):
            return False
        self._pending = None
        self.sent += len(batch.records)
        if self.spool is not None:
            self.spool.acked(batch.seq)
        return True

    async def _take_residency(self) -> tuple[Residency, ...]:
        """What `take` hands over, as `Residency` parts of this minute; () without `take` or if it fails
        (the engine stopped: its meter is gone)."""
        if self._take is None:
            return ()
        try:
            slot_s, load_s = await self._take()
        except Exception as exc:
            log.warning("usage: taking the adapter residency failed (%s)", type(exc).__name__)
            return ()
        return residency_parts(int(self._clock() // 60), self.owner, slot_s, load_s)

    async def _deliver(self, batch: UsageBatch) -> bool:
        try:
            await within(self._send(batch), self.timeout_s)
        except Exception as exc:
            log.warning("usage: sending batch %d of %s (%d records) failed (%s); the next flush sends it "
                        "again", batch.seq, batch.source, len(batch.records), type(exc).__name__)
            return False
        return True

    async def adopt(self) -> bool:
        """Send one dead sender's spool on this node, if there is one (see the module docstring);
        False if a send failed (the rest is kept, locked, for the next call)."""
        if self.spool is None:
            return True
        if self._adopted is None:
            self._adopted = await asyncio.to_thread(self.spool.adopt_one)
            if self._adopted is None:
                return True
            log.info("usage: sending the spool of %s, a sender that died on this node", self._adopted.source)
        dead = self._adopted
        for seq, records in await asyncio.to_thread(dead.batches):
            if not await self._deliver(UsageBatch(dead.source, seq, records)):
                return False
            await asyncio.to_thread(dead.acked, seq)
            self.adopted += len(records)
        self._adopted = None
        await asyncio.to_thread(dead.release, remove=True)
        return True

    async def close(self) -> None:
        """Stop the task; send the pending batch, then what is left (each once)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        done = await self.flush() and (not len(self.buffer) or await self.flush())
        if self._adopted is not None:
            self._adopted.release(remove=False)  # another process adopts the rest
            self._adopted = None
        if self.spool is not None:
            self.spool.close(remove=done and self._pending is None and not len(self.buffer))
            self.spool = None

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if await self.flush():
                await self.adopt()


__all__ = ["SEND_TIMEOUT_S", "Take", "UsageShipper", "open_spool", "residency_parts", "take_meter"]

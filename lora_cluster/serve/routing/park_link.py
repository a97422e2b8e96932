"""One ingress's parks at one controller shard, coalesced (`cluster.park_batch.ParkBatcher`), and their
outcomes: each waiting request holds a future that its grant, its refusal, or the shard's
unreachability settles.

Calls: at most one `admit_many` in flight (the parks that arrive meanwhile go together in the next);
its reply settles what the shard decided at once (and carries outcomes decided since the last poll);
the tickets left waiting there are `PARKED`, and while any is, one `grants` long poll runs, whose
answers settle them. Each reply names the shard's actor (`epoch`): when it changes (the shard was
restarted and knows none of them), the `PARKED` tickets are parked again in the next batch.

Faults: a failed call (the shard died or is restarting) parks its tickets again (every `PARKED` one,
for a failed poll) after `retry_pause_s`; a ticket that has failed to reach the shard for
`repark_window_s` is settled `{"unreachable": reason}` (the caller routes it the direct way).

Leaving (`withdraw`: the client went away, or the wait ran out): a ticket still in the batcher never
reaches the shard; one in the call in flight is released (`cancel_ticket`) when the call answers;
one parked, or retrying, is released at once. An outcome that arrives for a ticket nobody waits for
any more releases its grant. Every reservation of this ingress at the shard thus ends by a release
or, failing that (the shard unreachable), by the shard's own expiry of the ticket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lora_cluster.cluster.park_batch import CallState, ParkBatcher

log = logging.getLogger(__name__)

POLL_S = 10.0  # a grants poll is held open at most this long at the shard


class ParkState(Enum):
    BATCHED = "batched"  # in the batcher, for the next park call
    SENT = "sent"  # in the park call in flight
    PARKED = "parked"  # waiting at the shard: the grants poll brings its outcome
    RETRYING = "retrying"  # its call failed: parked again after the retry pause


@dataclass
class _Park:
    ticket: dict[str, Any]
    arrived_at: float
    future: asyncio.Future[dict[str, Any]]
    state: ParkState = ParkState.BATCHED
    give_up_at: float | None = None  # first failure to reach the shard + the re-park window
    abandoned: bool = False  # its waiter left while its park call was in flight


class ShardLink:
    """The coalesced parks of one ingress at one shard (see the module docstring). `handle`: the
    shard's deployment handle; `claims()`: the ingress's claims for a park call; `on_reply(reply)`:
    every reply (its `edge` state); `timeout_s`: the ingress's queue timeout (each ticket's TTL)."""

    def __init__(self, handle: Any, ingress_id: str, *, max_batch: int, timeout_s: float,
                 claims: Callable[[], dict[str, Any]], on_reply: Callable[[Mapping[str, Any]], None],
                 clock: Callable[[], float], retry_pause_s: float, repark_window_s: float):
        self._handle, self.ingress_id = handle, ingress_id
        self._batcher: ParkBatcher[str] = ParkBatcher(max_batch)
        self.timeout_s, self._claims, self._on_reply, self._clock = timeout_s, claims, on_reply, clock
        self.retry_pause_s, self.repark_window_s = retry_pause_s, repark_window_s
        self._parks: dict[str, _Park] = {}  # this ingress's waiting tickets at the shard
        self._epoch: str | None = None  # the shard actor the PARKED tickets are parked at
        self._tasks: set[asyncio.Task[None]] = set()  # the park call and the poll (at most one each)
        self._polling = False
        self.calls: dict[str, int] = {"admit_many": 0, "grants": 0}

    @property
    def park_call_in_flight(self) -> bool:
        return self._batcher.state is CallState.IN_FLIGHT

    @property
    def waiting(self) -> int:
        """This ingress's tickets waiting for an outcome from the shard (batched, sent or parked)."""
        return len(self._parks)

    def park(self, ticket: dict[str, Any], arrived_at: float) -> asyncio.Future[dict[str, Any]]:
        """Send `ticket` (`ticket_id`, `sla_class`, `adapter_id`, `prefix`); the future is settled
        with its outcome: `replica_id` (granted), `overloaded` (refused) or `unreachable`."""
        ticket_id = str(ticket["ticket_id"])
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._parks[ticket_id] = _Park(ticket, arrived_at, future)
        self._send(self._batcher.add(ticket_id, ticket_id))
        return future

    def withdraw(self, ticket_id: str) -> None:
        """The ticket's waiter left (see the module docstring)."""
        park = self._parks.get(ticket_id)
        if park is None:
            return
        if self._batcher.withdraw(ticket_id):
            del self._parks[ticket_id]
        elif park.state is ParkState.SENT:
            park.abandoned = True
        else:
            del self._parks[ticket_id]
            self.release(ticket_id)

    def release(self, ticket_id: str, replica_id: str | None = None) -> None:
        """Tell the shard (not waiting for its answer) to drop the ticket and the room its grant took
        (`cancel_ticket`); a failure to send is logged: the shard's expiry ends the reservation."""
        try:
            self._handle.cancel_ticket.remote(ticket_id, replica_id)
        except Exception as exc:
            log.debug("ticket %s not released: %s", ticket_id, exc)

    def _start(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, batch: list[str]) -> None:
        if batch:
            self._start(self._call(batch))

    async def _call(self, batch: list[str]) -> None:
        """One park call of `batch`; then the next batch, if parks arrived meanwhile."""
        now, tickets = self._clock(), []
        for ticket_id in batch:
            park = self._parks[ticket_id]
            park.state = ParkState.SENT
            waited = now - park.arrived_at
            tickets.append({**park.ticket, "waited_s": waited, "ttl_s": max(0.0, self.timeout_s - waited)})
        self.calls["admit_many"] += 1
        try:
            reply = await self._handle.admit_many.remote(self.ingress_id, tickets, self._claims())
        except Exception as exc:  # the shard died or is restarting: park them again there
            self._failed(batch, exc)
        else:
            self._answered(batch, reply)
        self._send(self._batcher.replied())

    def _answered(self, batch: list[str], reply: Mapping[str, Any]) -> None:
        self._on_reply(reply)
        self._new_epoch(reply.get("epoch"), sent=batch)
        for ticket_id in batch:
            park = self._parks.get(ticket_id)
            if park is not None:
                park.state, park.give_up_at = ParkState.PARKED, None
        self._settle(reply.get("outcomes") or {})
        for ticket_id in batch:  # left while its call was in flight, and still waiting there
            park = self._parks.get(ticket_id)
            if park is not None and park.abandoned:
                del self._parks[ticket_id]
                self.release(ticket_id)
        self._poll_if_parked()

    def _new_epoch(self, epoch: Any, sent: Sequence[str] = ()) -> None:
        """A reply from the shard actor `epoch`: if it is not the one the PARKED tickets are parked at
        (a restarted shard), they are parked again (but those of the call `sent`, parked there now)."""
        if epoch is None or epoch == self._epoch:
            return
        stale = self._epoch is not None
        self._epoch = str(epoch)
        if not stale:
            return
        for ticket_id, park in self._parks.items():
            if park.state is ParkState.PARKED and ticket_id not in sent:
                park.state = ParkState.BATCHED
                self._send(self._batcher.add(ticket_id, ticket_id))

    def _settle(self, outcomes: Mapping[str, Mapping[str, Any]]) -> None:
        for ticket_id, outcome in outcomes.items():
            park = self._parks.pop(ticket_id, None)
            if park is None or park.abandoned or park.future.done():  # nobody waits for it
                if "replica_id" in outcome:
                    self.release(ticket_id, str(outcome["replica_id"]))
                continue
            park.future.set_result(dict(outcome))

    def _failed(self, batch: list[str], exc: BaseException) -> None:
        now = self._clock()
        for ticket_id in batch:
            park = self._parks.get(ticket_id)
            if park is None:
                continue
            if park.abandoned:
                del self._parks[ticket_id]
                continue
            park.give_up_at = park.give_up_at or now + self.repark_window_s
            if now >= park.give_up_at:
                del self._parks[ticket_id]
                if not park.future.done():
                    park.future.set_result({"unreachable": str(exc)})
                continue
            park.state = ParkState.RETRYING
            asyncio.get_running_loop().call_later(self.retry_pause_s, self._retry, ticket_id)

    def _retry(self, ticket_id: str) -> None:
        park = self._parks.get(ticket_id)
        if park is not None and park.state is ParkState.RETRYING:
            park.state = ParkState.BATCHED
            self._send(self._batcher.add(ticket_id, ticket_id))

    def _parked(self) -> list[str]:
        return [t for t, park in self._parks.items() if park.state is ParkState.PARKED]

    def _poll_if_parked(self) -> None:
        if not self._polling and self._parked():
            self._polling = True
            self._start(self._poll())

    async def _poll(self) -> None:
        """The grants poll: while tickets are parked at the shard, one call in flight."""
        try:
            while self._parked():
                self.calls["grants"] += 1
                try:
                    reply = await self._handle.grants.remote(self.ingress_id, POLL_S, self._epoch)
                except Exception as exc:  # the shard died: its parked tickets park again
                    self._failed(self._parked(), exc)
                    continue
                self._on_reply(reply)
                self._new_epoch(reply.get("epoch"))
                self._settle(reply.get("outcomes") or {})
        finally:
            self._polling = False

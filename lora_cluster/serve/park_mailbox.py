"""The controller actor's parked tickets of each ingress and the outcomes decided for them later, which
the ingress's grants poll takes (`ClusterController.grants`) or a park call's reply carries
(`ClusterController.admit_many`).

A ticket is registered (`register`) before it is parked, so that a grant decided at any later moment
has its ingress; an outcome decided later goes to that ingress's mailbox (`decided`) and wakes its
poll; `take` hands over (and forgets) every outcome in it. A ticket answered in its park call's reply
(`settled`), or withdrawn by its ingress (`withdraw`), is forgotten. Bounds: a ticket is known for
`ttl_s` (the ingress's remaining wait, plus a grace) at most; `expired` returns the tickets past it
(still queued, or decided and never taken, as when the ingress stopped polling) for the actor to cancel
at the controller, so that their reservations are given back; the known tickets are at most
`max_tickets` (beyond, the oldest to expire is expired at once). Runs on the actor's one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_TICKETS = 65_536  # tickets known to one actor at once (queued or decided and not taken)


@dataclass
class _Known:
    ingress_id: str
    expires_at: float
    replica_id: str | None = None  # its grant's replica once one is decided (its reservation)
    decided: bool = False


@dataclass
class _Box:
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # ticket -> outcome, decided order
    event: asyncio.Event = field(default_factory=asyncio.Event)


class ParkMailboxes:
    """Every ingress's parked tickets and decided outcomes at one actor (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], max_tickets: int = MAX_TICKETS):
        self._clock, self.max_tickets = clock, max_tickets
        self._known: dict[str, _Known] = {}
        self._boxes: dict[str, _Box] = {}
        self._expiry: list[tuple[float, str]] = []  # (expires_at, ticket), lazily cleaned
        self._waiting: Counter[str] = Counter()  # ingress -> its tickets parked and not decided

    def register(self, ticket_id: str, ingress_id: str, ttl_s: float) -> list[tuple[str, str | None]]:
        """Know `ticket_id` as parked by `ingress_id` for `ttl_s`. Returns the tickets expired to make
        room (to cancel at the controller). Raises KeyError if it is known already (a re-park)."""
        if ticket_id in self._known:
            raise KeyError(ticket_id)
        expires_at = self._clock() + max(0.0, ttl_s)
        self._known[ticket_id] = _Known(ingress_id, expires_at)
        self._waiting[ingress_id] += 1
        heapq.heappush(self._expiry, (expires_at, ticket_id))
        over: list[tuple[str, str | None]] = []
        while len(self._known) > self.max_tickets:
            over.extend(self._expire_first())
        return over

    def knows(self, ticket_id: str) -> bool:
        return ticket_id in self._known

    def decided(self, ticket_id: str, outcome: dict[str, Any]) -> bool:
        """A later outcome (a grant or a refusal) for a known ticket: into its ingress's mailbox, and
        its poll woken. False: the ticket is not known (nobody waits for it)."""
        known = self._known.get(ticket_id)
        if known is None or known.decided:
            return False
        known.decided, known.replica_id = True, outcome.get("replica_id")
        self._not_waiting(known.ingress_id)
        box = self._boxes.setdefault(known.ingress_id, _Box())
        box.outcomes[ticket_id] = outcome
        box.event.set()
        return True

    def settled(self, ticket_id: str) -> None:
        """Its outcome goes in its park call's reply: forgotten."""
        self._forget(ticket_id)

    def withdraw(self, ticket_id: str) -> str | None:
        """The ingress gave the ticket up: forgotten; its grant's replica if one was decided."""
        known = self._known.get(ticket_id)
        self._forget(ticket_id)
        return None if known is None else known.replica_id

    def take(self, ingress_id: str) -> dict[str, dict[str, Any]]:
        """Every outcome in `ingress_id`'s mailbox (ticket -> outcome), handed over and forgotten."""
        box = self._boxes.get(ingress_id)
        if box is None or not box.outcomes:
            return {}
        outcomes, box.outcomes = box.outcomes, {}
        box.event.clear()
        for ticket_id in outcomes:
            self._known.pop(ticket_id, None)
        return outcomes

    async def wait(self, ingress_id: str, timeout_s: float) -> dict[str, dict[str, Any]]:
        """`take`, as soon as the mailbox holds an outcome, or after `timeout_s` (then possibly {})."""
        box = self._boxes.setdefault(ingress_id, _Box())
        if not box.outcomes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.event.wait(), timeout_s)
        outcomes = self.take(ingress_id)
        self._drop_idle(ingress_id)
        return outcomes

    def waiting(self, ingress_id: str | None = None) -> int:
        """Tickets parked and not decided: `ingress_id`'s, or every ingress's."""
        return self._waiting.get(ingress_id, 0) if ingress_id is not None else sum(self._waiting.values())

    def expired(self) -> list[tuple[str, str | None]]:
        """The tickets past their TTL, forgotten: (ticket, its grant's replica or None), to cancel."""
        now, gone = self._clock(), []
        while self._expiry and self._expiry[0][0] <= now:
            gone.extend(self._expire_first())
        return gone

    def _expire_first(self) -> list[tuple[str, str | None]]:
        expires_at, ticket_id = heapq.heappop(self._expiry)
        known = self._known.get(ticket_id)
        if known is None or known.expires_at != expires_at:  # forgotten (or re-registered) since
            return []
        self._forget(ticket_id)
        self._drop_idle(known.ingress_id)
        return [(ticket_id, known.replica_id)]

    def _forget(self, ticket_id: str) -> None:
        known = self._known.pop(ticket_id, None)
        if known is None:
            return
        if known.decided:
            box = self._boxes.get(known.ingress_id)
            if box is not None:
                box.outcomes.pop(ticket_id, None)
        else:
            self._not_waiting(known.ingress_id)

    def _drop_idle(self, ingress_id: str) -> None:
        box = self._boxes.get(ingress_id)
        if box is not None and not box.outcomes and not self._waiting.get(ingress_id):
            del self._boxes[ingress_id]

    def _not_waiting(self, ingress_id: str) -> None:
        self._waiting[ingress_id] -= 1
        if self._waiting[ingress_id] <= 0:
            del self._waiting[ingress_id]

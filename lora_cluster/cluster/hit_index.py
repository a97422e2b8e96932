"""Where a queued ticket would hit: per class priority and replica, the most urgent queued ticket of
that priority whose adapter the replica holds, kept between looks.

The controller asks "the most urgent ticket of priority p that arrived by `latest` and whose adapter
one of these replicas holds" (`scheduling.affinity_hit`) when the head of its queue would miss, and
its preemption asks the same of the replicas that reported. Answered by a walk, that costs a
`ClusterQueue.best_for` per adapter each replica holds with a ticket queued, every time. This index
keeps each replica's answer (`_Best`: the ticket, its queue key, and the adapter set it was found
for), so that a look costs a few checks per replica, and the walk is done again for a replica only
when its answer may have changed:

- its adapters changed (a new `ClusterView.held` set, by a report or a grant: the entry was found
  for another);
- its ticket left the queue (granted, cancelled or bumped: found by `in`);
- a ticket parked for one of its adapters ranks before its ticket (`parked` updates the entries of
  the adapter's holders: O(holders), where a miss of the walk would cost a walk).

Within one priority the queue's order is by arrival (`ClusterQueue.key`: the rank, priority +
enqueued / aging, rounds monotonically in the arrival time, and ties fall to the deadline, which is
the arrival plus the class's one target), so a replica's most urgent ticket is also its earliest:
when it arrived after `latest`, every other ticket it could take did too. The answer is therefore
`affinity_hit`'s; ties go to the first replica in the order given, as the walk's.

Bounded: an entry per (priority, replica); those of replicas the view forgot are dropped once a
priority's entries are more than twice the live replicas (plus 64). Pure: no clock, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Set
from typing import Any

from lora_cluster.cluster.cluster_queue import ClusterQueue, Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.scheduling import QUEUED_PER_ROOM, affinity_hit, affinity_hit_in


class _Best:
    """A replica's most urgent ticket of one priority (None: none), for the adapter set `held`."""

    __slots__ = ("held", "key", "ticket")

    def __init__(self, held: frozenset[str], key: Any, ticket: Ticket | None):
        self.held, self.key, self.ticket = held, key, ticket


class HitIndex:
    """Each replica's most urgent hit per priority, kept between looks (see the module docstring)."""

    def __init__(self, queue: ClusterQueue, view: ClusterView):
        self.queue, self.view = queue, view
        self._best: dict[int, dict[str, _Best]] = {}  # priority -> replica -> its entry
        self._empty: dict[int, set[str]] = {}  # priority -> the replicas whose entry has no ticket
        self._last: dict[int, Any] = {}  # priority -> a key ranked after (or as) every entry's key

    def parked(self, ticket: Ticket) -> None:
        """A ticket joined the queue: it becomes the kept answer of each holder of its adapter whose
        kept ticket ranks after it, or that kept none. Mostly it ranks after every kept ticket (a
        class's order is its arrival order): then only the holders that kept none are looked at
        (a set intersection), else O(the adapter's holders)."""
        priority = ticket.priority
        entries = self._best.get(priority)
        if not entries or ticket.adapter_id is None:
            return
        key = self.queue.sort_key(ticket.ticket_id)
        if key is None:
            return
        holders, empty = self.view.holders(ticket.adapter_id), self._empty[priority]
        last = self._last.get(priority)
        if last is None or key > last:
            self._last[priority] = key
            for rid in empty & holders:  # over the smaller set
                entry = entries[rid]
                entry.key, entry.ticket = key, ticket
            empty.difference_update(holders)
            return
        for rid in holders:
            best = entries.get(rid)
            if best is not None and (best.ticket is None or key < best.key):
                best.key, best.ticket = key, ticket
                empty.discard(rid)

    def hit(self, priority: int, room: Set[str], latest: float) -> tuple[Ticket, str] | None:
        """`scheduling.affinity_hit_in`'s answer: the most urgent queued ticket of `priority` that
        arrived at `latest` or before and whose adapter a replica of `room` holds, and the first such
        replica by id (None: none). From the queued adapters' side when they are the fewer, as
        `affinity_hit_in` does; else from the kept entries."""
        queue = self.queue
        queued = queue.queued_adapters(priority)
        if len(queued) < QUEUED_PER_ROOM * len(room):
            return affinity_hit_in(priority, queue.best_for, queue.sort_key, self.view, room, latest, queued)
        return self._look(priority, room, latest, True)

    def best_of(self, priority: int, replica_ids: Iterable[str]) -> tuple[Ticket, str] | None:
        """`best_in` over `replica_ids` walked in id order, in any order (of equal answers, the
        lowest replica id is kept)."""
        return self._look(priority, replica_ids, math.inf, True)

    def best_in(self, priority: int, replica_ids: Iterable[str], latest: float = math.inf
                ) -> tuple[Ticket, str] | None:
        """`scheduling.affinity_hit` over `replica_ids` (walked in the order given, the first of equal
        answers kept): from each replica's kept entry, walked again where it may have changed."""
        return self._look(priority, replica_ids, latest, False)

    def _look(self, priority: int, replica_ids: Iterable[str], latest: float, by_id: bool
              ) -> tuple[Ticket, str] | None:
        """`best_in`; with `by_id`, of equal answers (one ticket that several replicas could take)
        the lowest replica id is kept, as walking `replica_ids` sorted would keep, without the sort."""
        entries = self._best.get(priority)
        if entries is None:
            entries = self._best[priority] = {}
            self._empty[priority] = set()
        empty = self._empty[priority]
        if len(entries) > 2 * len(self.view) + 64:  # bounded: the forgotten replicas' entries go
            for rid in [rid for rid in entries if self.view.get(rid) is None]:
                del entries[rid]
                empty.discard(rid)
        queue, view = self.queue, self.view
        best_key: Any = None
        found: tuple[Ticket, str] | None = None
        for rid in replica_ids:
            if view.get(rid) is None:
                continue
            held = view.held(rid)
            entry = entries.get(rid)
            if (entry is None or entry.held is not held
                    or (entry.ticket is not None and entry.ticket.ticket_id not in queue)):
                entry = entries[rid] = self._walk(priority, rid, held)
                if entry.ticket is None:
                    empty.add(rid)
                else:
                    empty.discard(rid)
                    last = self._last.get(priority)
                    if last is None or entry.key > last:
                        self._last[priority] = entry.key
            ticket = entry.ticket
            if ticket is None:
                continue
            if ticket.enqueued_at > latest:  # its earliest ticket: every other one arrived later still
                continue
            key = entry.key
            if found is None or key < best_key:
                best_key, found = key, (ticket, rid)
            elif by_id and ticket is found[0] and rid < found[1]:  # the same ticket (keys are unique)
                found = (ticket, rid)
        return found

    def _walk(self, priority: int, replica_id: str, held: frozenset[str]) -> _Best:
        """The replica's most urgent ticket of `priority` among the adapters of `held`."""
        hit = affinity_hit(priority, self.queue.best_for, self.queue.sort_key, self.view, (replica_id,),
                           queued=self.queue.queued_adapters(priority))
        if hit is None:
            return _Best(held, None, None)
        return _Best(held, self.queue.sort_key(hit[0].ticket_id), hit[0])


__all__ = ["HitIndex"]

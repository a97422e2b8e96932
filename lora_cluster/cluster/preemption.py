"""Cross-replica preemption: when urgent tickets may go, over capacity, to replicas running less
urgent work, and where (the controller's half of preemption; a replica's engine then preempts its
least urgent sequences: `engine.schedule.scheduler`).

A ticket with a TTFT target is watched from its park (`watch`): it becomes *due* once it has waited
`preempt_after_fraction` of its target (`ControllerSettings.preempt_wait_s`), or at once when a
holder of its adapter runs less urgent work (a hit by preemption beats a miss later). Each `run`,
most urgent class first, within a class:

1. hits: every queued ticket of the class, due or not, whose adapter a replica that reported since
   the last run (`reported`) holds while running less urgent work there (found through the queue's
   per-adapter index; a new ticket's hit is found at park);
2. the due misses, in queue order, wherever less urgent work runs (`scheduling.preemption_target`),
   unless another replica holds the adapter and the ticket may still wait for it
   (`scheduling.holder_wait_until`: it is watched again until then).

Only the tickets due are looked at (a heap by due time, then a heap per class in queue order), and
once no replica has work less urgent than priority p, the tickets of p and of the classes less
urgent are skipped: O((grants + 1) x replicas + reported replicas x their adapters) per run, not
O(queue). Both heaps are bounded by the queue (entries that left it dropped). Grants go through the
caller's `grant(ticket, replica_id)`, which takes the ticket out of the queue. Pure: injected clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from lora_cluster.cluster.cluster_queue import ClusterQueue, Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller_settings import ControllerSettings
from lora_cluster.cluster.hit_index import HitIndex
from lora_cluster.cluster.scheduling import (
    can_preempt,
    holder_can_preempt,
    holder_wait_until,
    preemption_target,
)


class Preemption:
    """The urgent tickets watched for preemption, and the runs that grant them (see the module
    docstring)."""

    def __init__(self, queue: ClusterQueue, view: ClusterView, settings: ControllerSettings,
                 urgent: frozenset[int], clock: Callable[[], float],
                 grant: Callable[[Ticket, str], None], hits: HitIndex):
        """`urgent`: the priorities of the classes with a TTFT target; `grant(ticket, replica_id)`
        sends a ticket over capacity (the controller's preempting grant); `hits`: where queued
        tickets would hit (the controller's `HitIndex`)."""
        self.queue, self.view, self.settings, self._clock, self._grant = queue, view, settings, clock, grant
        self.hits = hits
        self._urgent_set = urgent
        self._urgent = sorted(urgent)  # most urgent first
        self._at: list[tuple[float, int, Ticket]] = []  # watched tickets by when they are due
        self._due: dict[int, list[tuple[Any, Ticket]]] = {}  # priority -> heap of (queue order, ticket)
        self._reported: set[str] = set()  # replicas that reported since the last look for hits
        self._seq = itertools.count()

    def watch(self, ticket: Ticket) -> None:
        """A parked ticket with a TTFT target: due after its preemption wait, or at once when a
        holder of its adapter runs less urgent work."""
        at = ticket.enqueued_at + self.settings.preempt_wait_s(ticket, self.queue.top_priority)
        if holder_can_preempt(ticket, self.view):
            at = ticket.enqueued_at  # a hit by preemption now beats a miss later
        heapq.heappush(self._at, (at, next(self._seq), ticket))

    def reported(self, replica_id: str) -> None:
        """The replica reported: the next run looks for hits among its adapters."""
        self._reported.add(replica_id)

    def run(self) -> None:
        """Grant what may preempt now (see the module docstring)."""
        now = self._clock()
        queue, view = self.queue, self.view
        while self._at and self._at[0][0] <= now:
            _, _, ticket = heapq.heappop(self._at)
            key = queue.sort_key(ticket.ticket_id)
            if key is not None:
                heapq.heappush(self._due.setdefault(ticket.priority, []), (key, ticket))
        if len(self._at) > 2 * len(queue) + 64:
            self._at = [e for e in self._at if e[2].ticket_id in queue]
            heapq.heapify(self._at)
        # hits can only have appeared where a replica reported (a new ticket's hit is found at park)
        reported = [rid for rid in self._reported if view.get(rid) is not None]
        self._reported.clear()
        urgent = self._urgent
        if not self._due.keys() <= self._urgent_set:
            urgent = sorted(self._urgent_set | self._due.keys())
        for priority in urgent:
            while reported and (hit := self._hit(priority, reported)) is not None:  # hits first
                self._grant(*hit)
            due = self._due.get(priority)
            while due and due[0][1].ticket_id not in queue:  # granted or gone since
                heapq.heappop(due)
            if not due:
                continue
            if len(due) > 2 * len(queue) + 64:  # bounded: drop what left the queue
                due[:] = [e for e in due if e[1].ticket_id in queue]
                heapq.heapify(due)
            if not view.preemptible_ids(priority):
                return  # no work less urgent than this anywhere, so none less urgent than the next
            while due:  # then the due misses, in queue order
                ticket = due[0][1]
                if ticket.ticket_id in queue:
                    top = ticket.priority == queue.top_priority
                    wait = self.settings.holder_wait(ticket, queue.top_priority)
                    until = holder_wait_until(ticket, view, wait)
                    # a target exists (else all are taken: none is left for this or a less urgent class);
                    # unless a holder is one, it would not hold the adapter: then wait for a holder until
                    # `until` (a hit later), known without choosing the target
                    if until > now and not holder_can_preempt(ticket, view):
                        if not can_preempt(ticket, view, top):
                            return
                        heapq.heappush(self._at, (until, next(self._seq), ticket))
                    elif (replica_id := preemption_target(ticket, view, free_slot_first=top)) is None:
                        return
                    else:
                        self._grant(ticket, replica_id)
                heapq.heappop(due)

    def _hit(self, priority: int, replica_ids: list[str]) -> tuple[Ticket, str] | None:
        """The most urgent queued ticket of `priority`, due or not, whose adapter one of
        `replica_ids` holds while running less urgent work there, and that replica (the lowest id of
        those that could take it; None: none)."""
        preemptible = self.view.preemptible_ids(priority)
        return self.hits.best_of(priority, [r for r in replica_ids if r in preemptible])


__all__ = ["Preemption"]

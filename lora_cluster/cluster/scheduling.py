"""Where the controller sends queued requests: grants by affinity, and cross-replica preemption.

Grant: a ticket goes to a replica with room (`ClusterView.free > 0`), preferring, in order, one
that holds its adapter (resident or loading), one the placement table names for it, and then the
one with the most room (ties by id, so that decisions are deterministic). The base model (no
adapter) goes by room alone. When the most urgent ticket would miss its adapter wherever it goes,
the controller first looks a bounded number of tickets further (`affinity_pick`, within the same
class) for one whose adapter a replica with room holds: a hit now instead of a miss that waits
for an adapter slot, at the price of at most `lookahead` tickets of reordering within a class.

Preemption: when no replica has room, an urgent ticket that has waited at least
`preempt_after_fraction` of its class's TTFT target is sent, over capacity, to a replica with
running work strictly less urgent than it (the replica's engine then preempts its least urgent
sequences; see `engine.scheduler`): one that holds its adapter if any has such work, else the one
with the most of it. A hit by preemption beats a miss: an urgent ticket whose adapter a replica
with less urgent running work holds preempts there at once (`holder_preemption_target`), rather
than waiting for room or going where its adapter must first be loaded, which on a loaded cluster
costs a load plus a wait for an adapter slot. Tickets without a TTFT target never preempt. Pure
functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.reports import ClusterView


def choose_replica(ticket: Ticket, view: ClusterView, placement: Mapping[str, tuple[str, ...]]) -> str | None:
    """The replica with room that should take `ticket` now, or None when none has room."""
    candidates = [rid for rid in view.ids() if view.free(rid) > 0]
    if not candidates:
        return None
    aid = ticket.adapter_id
    placed = set(placement.get(aid, ())) if aid is not None else set()

    def key(rid: str) -> tuple[bool, bool, int, str]:
        report = view.get(rid)
        holds = aid is not None and report is not None and (aid in report.resident or aid in report.loading)
        return (not holds, rid not in placed, -view.free(rid), rid)

    return min(candidates, key=key)


def holds(view: ClusterView, replica_id: str, adapter_id: str | None) -> bool:
    """The replica has the adapter on its device or loading it (the base model: always)."""
    if adapter_id is None:
        return True
    report = view.get(replica_id)
    return report is not None and (adapter_id in report.resident or adapter_id in report.loading)


def affinity_pick(tickets: Iterable[Ticket], view: ClusterView, lookahead: int) -> tuple[Ticket, str] | None:
    """Among the first `lookahead` tickets of the most urgent one's class, the first whose adapter
    a replica with room holds, and that replica (None: no such hit)."""
    room = [rid for rid in sorted(view.ids()) if view.free(rid) > 0]
    first_priority = None
    for i, ticket in enumerate(tickets):
        if i >= lookahead:
            break
        if first_priority is None:
            first_priority = ticket.priority
        if ticket.priority != first_priority:
            break
        holder = next((rid for rid in room if holds(view, rid, ticket.adapter_id)), None)
        if holder is not None:
            return ticket, holder
    return None


def should_preempt(ticket: Ticket, now: float, preempt_after_fraction: float) -> bool:
    """Whether `ticket` has waited long enough, against its TTFT target, to preempt other work."""
    if ticket.ttft_s is None:
        return False
    return now - ticket.enqueued_at >= preempt_after_fraction * ticket.ttft_s


def holder_preemption_target(ticket: Ticket, view: ClusterView) -> str | None:
    """A holder of the ticket's adapter with running work strictly less urgent than it (None: no
    such holder, or the base model, which every replica holds)."""
    if ticket.adapter_id is None:
        return None
    holders = [rid for rid in view.ids() if holds(view, rid, ticket.adapter_id)]
    return preemption_target(ticket, view, holders) if holders else None


def preemption_target(ticket: Ticket, view: ClusterView,
                      replica_ids: Iterable[str] | None = None) -> str | None:
    """A replica with running work strictly less urgent than `ticket`: a holder of its adapter with
    the most such work, else any replica with the most (None: nowhere)."""
    best, most = None, (False, 0)
    for rid in sorted(view.ids() if replica_ids is None else replica_ids):
        n = view.preemptible(rid, ticket.priority)
        if n <= 0:
            continue
        score = (holds(view, rid, ticket.adapter_id), n)
        if score > most:
            best, most = rid, score
    return best

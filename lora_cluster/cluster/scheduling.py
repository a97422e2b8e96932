"""Where the controller sends queued requests: grants by affinity, and cross-replica preemption.

Grant: a ticket goes to a replica with room (`ClusterView.free > 0`), preferring, in order, one
that holds its adapter (resident or loading), one the placement table names for it, and then the
one with the most room (ties by id, so that decisions are deterministic). The base model (no
adapter) goes by room alone.

Preemption: when no replica has room, an urgent ticket that has waited at least
`preempt_after_fraction` of its class's TTFT target is sent, over capacity, to the replica with the
most running work strictly less urgent than it (the replica's engine then preempts its least urgent
sequences; see `engine.scheduler`). Tickets without a TTFT target never preempt. Pure functions.
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


def should_preempt(ticket: Ticket, now: float, preempt_after_fraction: float) -> bool:
    """Whether `ticket` has waited long enough, against its TTFT target, to preempt other work."""
    if ticket.ttft_s is None:
        return False
    return now - ticket.enqueued_at >= preempt_after_fraction * ticket.ttft_s


def preemption_target(ticket: Ticket, view: ClusterView,
                      replica_ids: Iterable[str] | None = None) -> str | None:
    """The replica with the most running work strictly less urgent than `ticket` (None: nowhere)."""
    best, most = None, 0
    for rid in sorted(view.ids() if replica_ids is None else replica_ids):
        n = view.preemptible(rid, ticket.priority)
        if n > most:
            best, most = rid, n
    return best

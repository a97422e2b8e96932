"""Where a ticket waits rather than copy its adapter: a busy holder's queue, a little over its room.

When the ticket at the head of the cluster queue would copy its adapter to the replica with room (no
hit there, no hit by preemption) while a busy replica holds it, the controller grants it instead to a
holder (`holder_queue_target`), over that holder's room by at most a quarter of its batch
(`holder_queue_limit`), and the room goes to the next ticket: a hit a fraction of a second later beats
a copy, and no room idles while tickets wait. Only the adapter's primary holders
(`scheduling.primary_holder`) take such tickets, the one least past its room first. A holder's room is
judged on its report less the requests ended there since: those the ingresses said ended
(`ClusterView.ended`, already out of `ClusterView.free`), or if more, those expected to have ended
(`ended_since_report`): a large cluster's replicas report seconds apart (paced to the report budget),
and judged on the report alone a busy holder looks full for the whole period. Pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.scheduling import primary_holders

HOLDER_QUEUE_SHARE = 4  # a holder is given at most max_num_seqs / this over its room by `holder_queue_target`


def holder_queue_limit(max_num_seqs: int) -> int:
    """Requests a holder may be given over its room by `holder_queue_target`: a quarter of its batch
    (8 of 32), at least 1; well within what a replica accepts over `max_ongoing_requests` while the
    controller is on (its `max_num_seqs`)."""
    return max(1, max_num_seqs // HOLDER_QUEUE_SHARE)


def holder_queue_target(ticket: Ticket, view: ClusterView,
                        placement: Mapping[str, tuple[str, ...]]) -> str | None:
    """A primary holder of the ticket's adapter (`primary_holder`) to queue it at, over its room,
    rather than copy the adapter to a replica with room that does not hold it (None: the base model,
    no holder, or every primary holder already `holder_queue_limit` requests past its room, less
    the requests ended there since its report: those told (`ClusterView.ends`) or, if more, those
    expected (`ended_since_report`)); of them, the one
    least past its room so counted (ties by id), not the one whose report shows the most room: with
    reports seconds apart, an older report has more seats freed since. A seat frees every fraction
    of a second on a busy replica, and its engine admits by priority, so the ticket waits there about
    that long and then hits; the copy would take a slot, evict the idle adapter of lowest priority
    there (often the only copy of a warm adapter, whose next request then misses) and stay as long
    as requests keep coming. The replica with room is not left idle: its room goes to the next
    ticket. A holder that is not primary takes no ticket over its room, so that a copy the adapter's
    demand does not need drains. O(the holders)."""
    aid = ticket.adapter_id
    return None if aid is None else _least_past(view, primary_holders(view, aid, placement))


def _least_past(view: ClusterView, replica_ids: Iterable[str]) -> str | None:
    """Of `replica_ids`, the one least past its room less the requests ended there since its report
    (ties by id), if that is under its `holder_queue_limit`; else None. `free` already counts the ends
    the ingresses told; the expected ones count only beyond those (never one end twice)."""
    best: str | None = None
    best_past = 0
    for rid in replica_ids:
        report = view.get(rid)
        if report is None:
            continue
        past = -view.free(rid) - max(0, ended_since_report(view, rid) - view.ends(rid))
        if past >= holder_queue_limit(report.max_num_seqs):
            continue
        if best is None or past < best_past or (past == best_past and rid < best):
            best, best_past = rid, past
    return best


def ended_since_report(view: ClusterView, replica_id: str) -> int:
    """The requests expected to have ended at the replica since its report (the view learns of the
    granted ones the ingresses saw end, `ClusterView.ended`, and of the rest only from the next
    report): its requests in flight then over the mean time a request holds it
    (`service_time_s`, Little's law), times the report's age, at most those in flight. A report
    period of seconds (a large cluster paced to the report budget) frees most of a busy replica's
    seats unseen; judged on the report alone, a holder looks full for the whole period and its
    adapter's tickets copy it elsewhere instead (`holder_queue_target`)."""
    report = view.get(replica_id)
    if report is None or not report.service_time_s:
        return 0
    return min(report.ongoing, int(report.ongoing * view.age_s(replica_id) / report.service_time_s))

"""Seats freed between reports (issue 44): the ingresses tell the controller, with their park calls, which
granted requests ended at each replica since their previous call (`ClaimHints` `ended`,
`ClusterView.ended`), so a replica that reports seconds apart (a large cluster paced to the report
budget) does not free its seats in one lump at its next report. Hand-made reports, a fake clock."""

from __future__ import annotations

import dataclasses

from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.holder_queue import ended_since_report, holder_queue_target
from lora_cluster.cluster.park_batch import ClaimHints


def full_view() -> ClusterView:
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    view.update(report("r1", capacity=8, running=8, resident=("x",)))  # type: ignore[arg-type]
    return view


def test_a_seat_an_ingress_saw_end_is_free_until_the_next_report() -> None:
    view = full_view()
    assert view.free("r1") == 0, "the report shows the replica full"
    assert view.ended({"r1": 3}), "ends at a known replica count"
    assert view.free("r1") == 3, "three granted requests ended there: three seats free before its report"
    assert view.total_free() == 3, "the cluster's room follows"
    view.update(report("r1", capacity=8, running=7, resident=("x",)))  # type: ignore[arg-type]
    assert view.free("r1") == 1, "the next report is the truth again: its count replaces the ends told"


def test_ends_never_free_more_seats_than_the_report_and_the_grants_since_hold() -> None:
    view = full_view()
    view.granted("r1", "t1", adapter_id="x")
    view.ended({"r1": 50})
    assert view.free("r1") == 8, "at most the report's 8 requests and the one grant since: the whole replica"
    assert not view.ended({"gone": 2}), "a replica the view does not know is ignored"
    assert not view.ended({"r1": 0}), "nothing ended: nothing counted"


def test_each_park_call_carries_the_ends_since_the_previous_call_to_its_shard() -> None:
    hints = ClaimHints(2)
    hints.changed("r1", ended=True)
    hints.changed("r1", ended=True)
    hints.changed("r2")
    assert hints.stamp(0, {})["ended"] == {"r1": 2}, "the granted requests that ended, per replica"
    assert hints.stamp(0, {})["ended"] == {}, "told once to a shard"
    assert hints.stamp(1, {})["ended"] == {"r1": 2}, "and to every shard, each on its own call"


def test_a_waiting_ticket_is_granted_the_seat_a_park_call_says_ended() -> None:
    """Fails on a controller that ignores the claims' `ended`: the ticket waits for the report."""
    clock = FakeClock(100.0)
    controller = Controller(CLASSES, ControllerSettings(), clock=clock)
    controller.report(report("r1", capacity=8, running=8, resident=("x",)))
    assert controller.park(ticket("t1", "standard", clock(), "x")) is None, "the cluster is full: it waits"
    claims = {"inflight": {}, "unassigned": 0, "ended": {"r1": 1}}
    controller.park(ticket("t2", "standard", clock(), "x"), claims)
    grants = controller.take_grants()
    assert grants.get("t1") is not None and grants["t1"].replica_id == "r1", (
        f"the older ticket took the seat that ended, before any report: {grants}")
    assert "t2" not in grants, "one seat, one grant: the newer ticket waits"


def test_a_holders_bound_counts_an_end_once_whether_told_or_expected() -> None:
    """`holder_queue_target` judges a holder on its report less the requests ended since: those the
    ingresses told (already out of `free`) or, if more, those expected (`ended_since_report`)."""
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=30, clock=clock)
    full = report("r1", capacity=8, running=8, waiting=5, resident=("x",))  # 5 past its room; bound 2
    view.update(dataclasses.replace(full, service_time_s=2.0))
    view.update(report("r2"))
    t = ticket("t", "batch", 100.0, "x")
    clock.now = 100.5
    assert ended_since_report(view, "r1") == 3, "13 in flight, 2 s each: 3 expected ended in 0.5 s"
    view.ended({"r1": 1})
    assert view.ends("r1") == 1, "one told"
    assert holder_queue_target(t, view, {}) is None, (
        "5 past its room less 3 ended (the one told among the 3 expected, not on top): at its bound of 2")
    view.ended({"r1": 4})
    assert holder_queue_target(t, view, {}) == "r1", "5 told ended, more than expected: 0 past, it queues"

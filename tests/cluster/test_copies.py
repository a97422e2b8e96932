"""Copies an adapter's demand does not need (issue 44): a ticket whose adapter a busy replica holds queues
at that holder, a little over its room, rather than copying the adapter to the replica with room
(whose room goes to the next ticket); hits go to an adapter's primary holders, so that a further copy
drains. Hand-made reports, a fake clock."""

from __future__ import annotations

import dataclasses

from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.holder_queue import ended_since_report, holder_queue_limit, holder_queue_target
from lora_cluster.cluster.scheduling import home_score, primary_holder


def view_of(*reports: object) -> ClusterView:
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    for r in reports:
        view.update(r)  # type: ignore[arg-type]
    return view


def test_an_unplaced_adapter_has_one_primary_holder_its_home_among_its_holders() -> None:
    view = view_of(report("r1", resident=("x",)), report("r2", resident=("x",)),
                   report("r3", resident=("y",)))
    home = max(("r1", "r2"), key=lambda rid: home_score("x", rid))
    other = "r1" if home == "r2" else "r2"
    assert primary_holder(view, home, "x", {}), "the holder of the highest home score is primary"
    assert not primary_holder(view, other, "x", {}), "a second holder of an unplaced adapter is not"
    assert primary_holder(view, "r3", "y", {}), "a lone holder is primary"
    assert not primary_holder(view, "r3", "x", {}), "a replica that does not hold the adapter is not"
    assert primary_holder(view, "r3", None, {}), "every replica serves the base model"


def test_a_placed_adapter_has_its_placed_holders_as_primary() -> None:
    view = view_of(*(report(rid, resident=("x",)) for rid in ("r1", "r2", "r3")))
    placement = {"x": ("r1", "r3")}
    assert primary_holder(view, "r1", "x", placement), "a placed holder is primary"
    assert primary_holder(view, "r3", "x", placement), "every placed holder is"
    assert not primary_holder(view, "r2", "x", placement), "a holder the placement left out is not"


def test_a_holder_takes_a_queued_ticket_up_to_a_quarter_of_its_batch_over_its_room() -> None:
    assert holder_queue_limit(32) == 8, "a quarter of a batch of 32"
    assert holder_queue_limit(2) == 1, "at least one"
    busy = report("r1", capacity=8, running=8, waiting=1, resident=("x",))
    view = view_of(busy, report("r2"))
    assert holder_queue_target(ticket("t", "batch", 100.0, "x"), view, {}) == "r1", (
        "a busy holder one past its room takes the ticket: its limit is 2")
    assert holder_queue_target(ticket("t", "batch", 100.0, "y"), view, {}) is None, "no holder: no target"
    full = report("r1", capacity=8, running=8, waiting=2, resident=("x",))
    assert holder_queue_target(ticket("t", "batch", 100.0, "x"), view_of(full, report("r2")), {}) is None, (
        "a holder 2 requests past its room (a quarter of its batch of 8) takes no more")


def test_a_holder_past_its_bound_by_an_old_report_takes_the_ticket_for_the_seats_freed_since() -> None:
    """A large cluster's replica reports every few seconds (paced to the report budget): by the end of
    the period most of its seats have freed unseen, so the bound counts those expected to be free."""
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=30, clock=clock)
    full = report("r1", capacity=8, running=8, waiting=2, resident=("x",))
    view.update(dataclasses.replace(full, service_time_s=2.0))
    view.update(report("r2"))
    t = ticket("t", "batch", 100.0, "x")
    assert holder_queue_target(t, view, {}) is None, "just reported 2 past its room: the bound holds"
    clock.now = 100.5
    assert ended_since_report(view, "r1") == 2, "10 in flight, 2 s each: 2.5 ended in 0.5 s (whole ones)"
    assert holder_queue_target(t, view, {}) == "r1", "half a second on, two seats have freed: it queues there"
    clock.now = 110.0
    assert ended_since_report(view, "r1") == 10, "never more than were in flight"
    view.update(dataclasses.replace(full, service_time_s=None))
    assert ended_since_report(view, "r1") == 0, "no service time measured yet: nothing assumed"


def test_the_holder_least_past_its_room_since_its_report_takes_the_ticket_not_the_most_room_shown() -> None:
    """Reports seconds apart: the holder that reported the most room (just now, past its bound) is not
    the one with the most room left; one that reported less room a second earlier has freed seats
    since. Judged on the first alone, the ticket copied its adapter (issue 44, at 1,024 replicas)."""
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=30, clock=clock)
    view.update(dataclasses.replace(report("r2", capacity=8, running=8, waiting=4, resident=("x",)),
                                    service_time_s=2.0))
    clock.now = 101.0
    view.update(dataclasses.replace(report("r1", capacity=8, running=8, waiting=2, resident=("x",)),
                                    service_time_s=2.0))
    view.update(report("r3"))
    placement = {"x": ("r1", "r2")}
    assert view.free("r1") > view.free("r2"), "r1 reported more room than r2"
    assert holder_queue_target(ticket("t", "batch", 101.0, "x"), view, placement) == "r2", (
        "r2, 4 past its room a second ago, 6 of its 12 requests ended since, takes it; r1 is at its bound")


def test_a_holder_that_is_not_primary_takes_no_ticket_over_its_room_so_that_its_copy_drains() -> None:
    home = max(("r1", "r2"), key=lambda rid: home_score("x", rid))
    other = "r1" if home == "r2" else "r2"
    view = view_of(report(home, capacity=8, running=8, waiting=2, resident=("x",)),
                   report(other, capacity=8, running=8, waiting=1, resident=("x",)), report("r3"))
    assert primary_holder(view, home, "x", {}), "the home is x's primary holder"
    assert holder_queue_target(ticket("t", "batch", 100.0, "x"), view, {}) is None, (
        "the primary holder is at its bound: the ticket takes the room, not a queue at the second copy")


def test_a_ticket_queues_at_its_busy_holder_and_the_room_goes_to_the_next_ticket() -> None:
    ctl = Controller(CLASSES, ControllerSettings(), clock=FakeClock(100.0))
    ctl.report(report("r1", capacity=1, running=1, resident=("x",)))
    ctl.report(report("r2", capacity=1, running=1, resident=("z",)))
    ctl.park(ticket("x-ticket", "batch", 100.0, "x"))
    ctl.park(ticket("y-ticket", "batch", 100.1, "y"))
    ctl.report(report("r2", capacity=1, running=0, resident=("z",)))
    grants = ctl.take_grants()
    assert grants["x-ticket"].replica_id == "r1", "x's ticket goes to r1, which holds x, not to a copy on r2"
    assert grants["y-ticket"].replica_id == "r2", "r2's room is not left idle: the next ticket takes it"


def test_a_ticket_copies_its_adapter_once_every_holder_is_past_the_bound() -> None:
    ctl = Controller(CLASSES, ControllerSettings(), clock=FakeClock(100.0))
    ctl.report(report("r1", capacity=1, running=1, waiting=1, resident=("x",)))
    ctl.report(report("r2", capacity=1, running=1, resident=("z",)))
    ctl.park(ticket("x-ticket", "batch", 100.0, "x"))
    ctl.report(report("r2", capacity=1, running=0, resident=("z",)))
    assert ctl.take_grants()["x-ticket"].replica_id == "r2", (
        "with its holder one past its room (its limit), the ticket takes the room and x is loaded there")

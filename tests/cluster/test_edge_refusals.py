"""Refusals at the edge (`cluster.edge`), with a fake clock and no Ray: the edge refuses, from the state the
controller publishes (`Controller.edge_state`), what the controller refuses, with the same error class,
message and retry-after; it parks what the controller admits; a state older than its bound refuses nothing."""

from __future__ import annotations

import pytest
from helpers import FakeClock
from tickets import CLASSES, ticket

from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.edge import EdgeState, EdgeView, edge_refusal
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.errors import (
    ClusterOverloadedError,
    ColdAdapterShedError,
    DeadlineOutOfReachError,
    QueueFullError,
)

MAX_AGE_S = ControllerSettings().edge_max_age_s


def busy_controller(queue_size: int = 4096, running_priority: int = 1) -> tuple[FakeClock, Controller]:
    """One replica of one slot, full of work of `running_priority`, holding adapter `held`; a slow
    measured drain (0.4 requests/s)."""
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(queue_size=queue_size), clock=clock)
    ctl.report(ReplicaReport("r1", "n1", capacity=1, max_num_seqs=1, max_loras=4, running=1, waiting=0,
                             free_adapter_slots=0, resident=("held",),
                             running_by_priority={running_priority: 1}))
    ctl.queue.drain.record(1)
    return clock, ctl


def same_refusal(edge: tuple[str, ClusterOverloadedError] | None, ctl: Controller, t: object) -> str:
    """Assert the controller refuses `t` with the edge's error (class, message, retry-after); its reason."""
    assert edge is not None, "the edge refuses it"
    reason, error = edge
    with pytest.raises(ClusterOverloadedError) as info:
        ctl.park(t)
    assert type(info.value) is type(error), f"the same error class: {info.value!r} and {error!r}"
    assert str(info.value) == str(error), f"the same message: {info.value} / {error}"
    assert info.value.retry_after_s == error.retry_after_s, "the same retry-after"
    return reason


def test_a_full_queue_is_refused_at_the_edge_with_the_controllers_error():
    clock, ctl = busy_controller(queue_size=2)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    ctl.park(ticket("s1", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    t = ticket("s2", "standard", 100.0, "held")
    found = edge_refusal(state, t, clock())
    assert found is not None and isinstance(found[1], QueueFullError), f"a full queue: {found}"
    assert same_refusal(found, ctl, t) == "queue_full", "counted as queue_full"


def test_a_full_queue_refused_later_at_the_edge_gets_the_controllers_retry_after_of_that_moment():
    # the drain meter's one grant is 3 s old (over a quarter of its window): its measured rate falls as
    # time passes, and the full queue's retry-after grows with it
    clock, ctl = busy_controller(queue_size=2)
    clock.advance(3.0)
    ctl.park(ticket("s0", "batch", clock(), "held"))
    ctl.park(ticket("s1", "batch", clock(), "held"))
    state = EdgeState.from_wire(ctl.edge_state().to_wire())
    published = edge_refusal(state, ticket("s2", "batch", clock(), "held"), clock())
    clock.advance(MAX_AGE_S * 0.9)  # the state is still within its bound
    t = ticket("s3", "batch", clock(), "held")
    found = edge_refusal(state, t, clock())
    assert same_refusal(found, ctl, t) == "queue_full", "refused for the full queue"
    later, earlier = (None if f is None else f[1].retry_after_s for f in (found, published))
    assert later is not None and earlier is not None and later > earlier, (
        f"the retry-after is the controller's at the moment of refusal ({later}), "
        f"not at publication ({earlier})")


def test_a_drain_event_that_leaves_the_window_after_publication_counts_at_the_edge_as_at_the_controller():
    clock, ctl = busy_controller(queue_size=2)  # one grant at 100.0
    clock.advance(5.0)
    ctl.queue.drain.record(1)  # a second one at 105.0
    clock.advance(5.0 - MAX_AGE_S / 2)  # the first is about to leave the 10 s window
    ctl.park(ticket("s0", "batch", clock(), "held"))
    ctl.park(ticket("s1", "batch", clock(), "held"))
    state = EdgeState.from_wire(ctl.edge_state().to_wire())
    clock.advance(MAX_AGE_S * 0.9)  # the first grant has left the window; the state is within its bound
    t = ticket("s2", "batch", clock(), "held")
    assert same_refusal(edge_refusal(state, t, clock()), ctl, t) == "queue_full", (
        "the same retry-after once the oldest grant left the controller's window")


def test_a_full_queue_still_parks_a_more_urgent_ticket_that_bumps_a_less_urgent_one():
    clock, ctl = busy_controller(queue_size=2, running_priority=0)
    ctl.park(ticket("b0", "batch", 100.0, "held"))
    ctl.park(ticket("b1", "batch", 100.0, "held"))
    state = ctl.edge_state(held=True)
    urgent = ticket("s0", "standard", 100.0, "held")
    assert edge_refusal(state, urgent, clock()) is None, "the edge parks it"
    ctl.park(urgent)
    assert "s0" in ctl.queue, "the controller queues it, bumping a batch ticket"


def test_a_shedding_class_refuses_a_cold_adapter_at_the_edge_and_parks_a_held_one():
    clock, ctl = busy_controller()
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    ctl.park(ticket("s1", "standard", 100.0, "held"))
    with pytest.raises(DeadlineOutOfReachError):
        ctl.park(ticket("s2", "standard", 100.0, "held"))
    ctl.cancel("s0")
    ctl.cancel("s1")
    state = ctl.edge_state(held=True)
    cold = ticket("cold", "standard", 100.0, "rare")
    found = edge_refusal(state, cold, clock())
    assert found is not None and isinstance(found[1], ColdAdapterShedError), f"a cold adapter: {found}"
    assert same_refusal(found, ctl, cold) == "cold_shed", "counted as cold_shed"
    warm = ticket("warm", "standard", 100.0, "held")
    assert edge_refusal(state, warm, clock()) is None, "an adapter a replica holds: parked"
    ctl.park(warm)
    assert "warm" in ctl.queue, "and the controller queues it"


def test_held_adapters_older_than_their_bound_shed_nothing_cold():
    clock, ctl = busy_controller()
    ctl.shedding.record(CLASSES.get("standard").priority)
    held = ctl.edge_state(held=True)
    clock.advance(ctl.settings.edge_held_max_age_s + 0.01)
    ctl.shedding.record(CLASSES.get("standard").priority)  # the class still sheds
    state = ctl.edge_state().with_held(held.held, held.held_at)
    cold = ticket("cold", "standard", clock(), "rare")
    assert edge_refusal(state, cold, clock()) is None, "residency older than its bound: parked"
    fresh = ctl.edge_state(held=True)
    assert edge_refusal(fresh, cold, clock()) is not None, "with fresh residency the same ticket is refused"


def test_without_the_held_adapters_the_edge_sheds_nothing_cold():
    clock, ctl = busy_controller()
    ctl.shedding.record(CLASSES.get("standard").priority)
    state = ctl.edge_state(held=False)
    assert edge_refusal(state, ticket("cold", "standard", 100.0, "rare"), clock()) is None, (
        "a state without the replicas' adapters cannot tell a cold adapter: parked")


def test_a_deadline_out_of_reach_is_refused_at_the_edge_with_the_controllers_error():
    clock, ctl = busy_controller()
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    ctl.park(ticket("s1", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    t = ticket("s2", "standard", 100.0, "held")
    found = edge_refusal(state, t, clock())
    assert found is not None and isinstance(found[1], DeadlineOutOfReachError), f"out of reach: {found}"
    assert same_refusal(found, ctl, t) == "deadline", "counted as deadline"


def test_a_deadline_the_class_can_meet_by_preemption_is_parked():
    clock, ctl = busy_controller(running_priority=2)  # batch work runs: standard may preempt it
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    ctl.park(ticket("s1", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    t = ticket("s2", "standard", 100.0, "held")
    assert edge_refusal(state, t, clock()) is None, "less urgent work to preempt: parked"
    ctl.park(t)
    assert "s2" in ctl.queue, "and the controller queues it"


def test_a_state_older_than_its_bound_refuses_nothing():
    clock, ctl = busy_controller(queue_size=1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    t = ticket("s1", "standard", 100.0, "held")
    assert edge_refusal(state, t, clock() + MAX_AGE_S) is not None, "a state at its bound still refuses"
    assert edge_refusal(state, t, clock() + MAX_AGE_S + 0.01) is None, "one past its bound refuses nothing"
    off = state._replace(max_age_s=0.0)
    assert edge_refusal(off, t, clock()) is None, "edge_max_age_s 0 turns the edge off"


def test_publishing_the_state_changes_nothing_in_the_controller():
    _, ctl = busy_controller(queue_size=1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    before = dict(ctl.counts)
    ctl.edge_state(held=True)
    assert ctl.counts == before, "the controller's counts are unchanged"
    assert len(ctl.queue) == 1, "its queue is unchanged"


def test_the_state_travels_as_plain_data_unchanged():
    _, ctl = busy_controller(queue_size=1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    assert EdgeState.from_wire(state.to_wire()) == state, "to_wire / from_wire keep every field"


def test_the_ingress_maps_the_controllers_clock_onto_its_own():
    _, ctl = busy_controller(queue_size=1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    state = ctl.edge_state(held=True)
    ingress_clock = FakeClock(5.0)  # another process's monotonic clock
    view = EdgeView(ingress_clock)
    view.offer(state)
    t = view.ticket("s1", "ingress-1", "standard", "held", arrived_at=5.0)
    assert t is not None and t.priority == CLASSES.get("standard").priority, "its class as published"
    found = view.refusal(t, arrived_at=5.0)
    assert found is not None and found[0] == "queue_full", f"refused as the controller would: {found}"
    ingress_clock.advance(MAX_AGE_S + 0.01)
    assert view.refusal(t, arrived_at=ingress_clock()) is None, "aged past the bound on the ingress clock"


def test_a_state_published_earlier_than_the_one_held_is_dropped():
    clock, ctl = busy_controller(queue_size=1)
    empty = ctl.edge_state(held=True)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    clock.advance(0.1)
    full = ctl.edge_state(held=True)
    view = EdgeView(FakeClock(5.0))
    view.offer(full)
    view.offer(empty)  # a reply that was on its way
    assert view.state is full, "the later state is kept"

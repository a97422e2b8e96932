"""An ingress's parks coalesced per controller shard (`cluster.park_batch.ParkBatcher`): one call in
flight, the parks that arrive meanwhile in the next call, bounded, and withdrawn before they go."""

from __future__ import annotations

import pytest

from lora_cluster.cluster.park_batch import CallState, ParkBatcher


def test_an_idle_ingress_sends_a_park_at_once_alone() -> None:
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=8)
    assert batcher.add("t1", "p1") == ["p1"], "no call in flight: the park goes now, with no added wait"
    assert batcher.state is CallState.IN_FLIGHT, "its call is in flight until it is answered"


def test_parks_that_arrive_while_a_call_is_in_flight_go_together_in_the_next() -> None:
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=8)
    batcher.add("t1", "p1")
    assert batcher.add("t2", "p2") == [], "a call is in flight: the park waits for its reply"
    assert batcher.add("t3", "p3") == [], "so does the next one"
    assert batcher.replied() == ["p2", "p3"], "the reply sends what arrived meanwhile, in arrival order"
    assert batcher.state is CallState.IN_FLIGHT, "that batch is now the call in flight"
    assert batcher.replied() == [], "nothing waits: no call goes"
    assert batcher.state is CallState.IDLE, "and none is in flight"
    assert (batcher.calls, batcher.sent) == (2, 3), "two calls carried the three parks"


def test_a_batch_holds_at_most_max_batch_parks_the_rest_go_next() -> None:
    batcher: ParkBatcher[int] = ParkBatcher(max_batch=3)
    batcher.add("t0", 0)
    for i in range(1, 8):
        batcher.add(f"t{i}", i)
    assert batcher.replied() == [1, 2, 3], "the oldest max_batch parks go first"
    assert batcher.replied() == [4, 5, 6], "then the next ones"
    assert batcher.replied() == [7], "then the last"
    assert batcher.waiting == 0, "every park was sent once"


def test_a_park_withdrawn_before_its_call_never_goes() -> None:
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=8)
    batcher.add("t1", "p1")
    batcher.add("t2", "p2")
    batcher.add("t3", "p3")
    assert batcher.withdraw("t2") is True, "a client gone while its park waits here: it leaves the batch"
    assert batcher.replied() == ["p3"], "the next call goes without it (p1 went first, alone)"


def test_a_park_already_sent_is_the_callers_to_cancel_at_the_controller() -> None:
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=8)
    batcher.add("t1", "p1")
    assert batcher.withdraw("t1") is False, "sent: the caller cancels the ticket at the controller"
    assert batcher.withdraw("unknown") is False, "an unknown key is not waiting here either"


def test_withdrawing_every_waiting_park_leaves_no_call_to_send() -> None:
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=8)
    batcher.add("t1", "p1")
    batcher.add("t2", "p2")
    batcher.withdraw("t2")
    assert batcher.replied() == [], "the only waiting park left: no empty call goes"
    assert batcher.state is CallState.IDLE, "no call is in flight"


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ParkBatcher(max_batch=0)
    batcher: ParkBatcher[str] = ParkBatcher(max_batch=2)
    with pytest.raises(RuntimeError, match="no park call was in flight"):
        batcher.replied()
    batcher.add("t1", "p1")
    batcher.add("t2", "p2")
    with pytest.raises(ValueError, match="already waiting"):
        batcher.add("t2", "again")

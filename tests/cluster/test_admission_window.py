"""The admission window: a replica is given requests beyond its batch slots while the cluster queue
holds tickets, sized by feedback to the round trip a freed slot's grant takes, so that the batch
does not idle through that round trip; and the engine loop's step observer that feeds it."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from lora_cluster.cluster.report_rules import AdmissionWindow, window_limit
from lora_cluster.engine import AsyncEngine, SamplingParams


def occupancy(window: AdmissionWindow, *, seats: int = 8, service_steps: int = 10, round_trip_steps: int = 6,
              steps: int = 3000) -> float:
    """Mean share of busy seats of one replica behind an always-full cluster queue. A request runs
    `service_steps` steps; the controller grants while the replica's ongoing requests (running,
    waiting in the engine, granted on their way) are below seats + window, and a grant reaches the
    engine `round_trip_steps` steps after it was given (report -> grant -> send)."""
    running: list[int] = []  # steps left of each running request
    waiting = 0  # granted requests that reached the engine, not yet admitted
    on_the_way: deque[int] = deque()  # the step each grant reaches the engine
    busy = 0
    for step in range(steps):
        while on_the_way and on_the_way[0] <= step:
            on_the_way.popleft()
            waiting += 1
        while waiting and len(running) < seats:
            waiting -= 1
            running.append(service_steps)
        busy += len(running)
        window.observe(free_seats=seats - len(running), waiting=waiting, tickets_queued=True)
        running = [left - 1 for left in running if left > 1]
        while len(running) + waiting + len(on_the_way) < seats + window.extra:
            on_the_way.append(step + round_trip_steps)
    return busy / (steps * seats)


def test_without_a_window_the_batch_idles_through_the_grant_round_trip():
    assert occupancy(AdmissionWindow(limit=0)) < 0.7, (
        "with 10-step requests and a 6-step grant round trip, a replica given only its seats idles "
        "about 6 steps of every 16")


def test_the_window_keeps_the_batch_full_despite_the_round_trip():
    window = AdmissionWindow(limit=32)
    assert occupancy(window) > 0.95, "the window covers the round trip: seats stay busy"
    assert 0 < window.extra <= 16, f"about the requests that finish during one round trip, got {window.extra}"


@pytest.mark.parametrize("round_trip_steps", [0, 1])
def test_a_grant_that_arrives_within_a_step_grows_no_window(round_trip_steps: int):
    window = AdmissionWindow(limit=32)
    occupancy(window, round_trip_steps=round_trip_steps)
    assert window.extra == 0, "an immediate grant idles no seat for more than the step that freed it"


def test_the_window_shrinks_when_requests_pile_up_in_the_engine():
    window = AdmissionWindow(limit=32)
    for _ in range(10 * AdmissionWindow.IDLE_STEPS):
        window.observe(free_seats=1, waiting=0, tickets_queued=True)
    grown = window.extra
    assert grown > 0, "seats idling while tickets wait grow the window"
    for _ in range(4 * AdmissionWindow.SHRINK_EVERY):
        window.observe(free_seats=0, waiting=5, tickets_queued=True)
    assert window.extra == grown - 4, "one request less per SHRINK_EVERY steps with a surplus waiting"


def test_without_queued_tickets_the_window_stays_as_it_is():
    window = AdmissionWindow(limit=32)
    for _ in range(50):
        window.observe(free_seats=8, waiting=0, tickets_queued=False)
    assert window.extra == 0, "idle seats with an empty cluster queue are no reason to take more"


def test_the_window_never_passes_its_limit():
    window = AdmissionWindow(limit=3)
    for _ in range(100):
        window.observe(free_seats=4, waiting=0, tickets_queued=True)
    assert window.extra == 3, "bounded by its limit"


def test_the_limit_is_what_the_replica_accepts_beyond_its_capacity():
    assert window_limit(None, 64, 32) == 32, "default: max_ongoing_requests - admission capacity"
    assert window_limit(8, 64, 32) == 8, "a configured bound below that"
    assert window_limit(100, 64, 32) == 32, "never beyond what the replica accepts at once"
    assert window_limit(None, 16, 32) == 0, "none when the capacity already reaches max_ongoing_requests"
    assert window_limit(0, 64, 32) == 0, "0 turns the window off"


async def test_the_engine_loop_reports_every_step_to_its_observer(make_engine):
    seen, thread = [], []

    def observe(stats) -> None:
        seen.append(stats)
        thread.append(threading.current_thread().name)

    aengine = AsyncEngine(make_engine(), on_step=observe)
    try:
        params = SamplingParams(max_new_tokens=4)
        outputs = [out async for out in aengine.generate("hello there", None, params)]
    finally:
        aengine.shutdown()
    assert outputs[-1].finished, "the request ran to its end"
    assert len(seen) >= 4, f"one observation per step (4 tokens), got {len(seen)}"
    assert set(thread) == {"engine-loop"}, "the observer runs on the engine's thread"
    assert seen[0].num_running == 1, "it sees the step's stats"

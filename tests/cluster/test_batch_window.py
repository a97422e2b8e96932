"""The controller's inputs in batch windows: `Controller.park_many` decides as parking one by one
would (but grants in queue order at the batch's end), reports taken without a dispatch are granted by
the window's one `dispatch`, and the batch window (`cluster.batch_window`, the policy the actor and the
simulator share; `serve.batch_window`, its event-loop face) hands the parks of one window to the
controller at once, leaving out callers that went away."""

from __future__ import annotations

import asyncio

import pytest
from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster import batch_window as pure
from lora_cluster.cluster.controller import Controller, ControllerSettings, Grant, Refusal
from lora_cluster.errors import ClusterOverloadedError, QueueFullError, RequestError
from lora_cluster.serve.batch_window import BatchWindow


def _busy_controller(queue_size: int = 100) -> Controller:
    """A controller whose one replica, r1, runs two batch requests in its two slots."""
    ctl = Controller(CLASSES, ControllerSettings(queue_size=queue_size), clock=FakeClock(100.0))
    ctl.report(report("r1", capacity=2, running=2, by_priority={2: 2}))
    return ctl


def test_a_batch_decides_as_parking_one_by_one_when_no_replica_has_room():
    tickets = [ticket(f"t{i}", ("interactive", "standard", "batch")[i % 3], 100.0 - i * 0.01, f"a{i % 4}")
               for i in range(9)]

    def fates(ctl: Controller, outcomes: list[object]) -> list[object]:
        """Each ticket's outcome, or the refusal delivered later (bumped out of the full queue)."""
        later = ctl.take_grants()
        return [(type(o), str(o)) if isinstance(o, ClusterOverloadedError) else later.get(t.ticket_id, o)
                for t, o in zip(tickets, outcomes, strict=True)]

    one = _busy_controller(queue_size=6)
    singly: list[object] = []
    for t in tickets:
        try:
            singly.append(one.park(t))
        except ClusterOverloadedError as e:
            singly.append(e)
    many = _busy_controller(queue_size=6)
    batched = fates(many, many.park_many([(t, None) for t in tickets]))
    assert batched == fates(one, singly), "the same fate for every ticket"
    assert any(isinstance(f, Refusal) for f in batched), "the batch includes a ticket bumped by a later one"
    assert [t.ticket_id for t in many.queue.in_order()] == [t.ticket_id for t in one.queue.in_order()], (
        "the same tickets queued, in the same order")
    assert many.counts == one.counts, "the same counts"


def test_a_refusal_in_a_batch_is_returned_and_the_others_still_park():
    ctl = _busy_controller(queue_size=1)
    outcomes = ctl.park_many([(ticket("b1", "batch", 100.0), None), (ticket("b2", "batch", 100.0), None),
                              (ticket("b1", "batch", 100.0), None)])
    assert outcomes[0] is None, "the first batch ticket waits"
    assert isinstance(outcomes[1], QueueFullError), "the second finds the queue full: a QueueFullError"
    assert "cluster_queue_size" in str(outcomes[1]), "the refusal names the limit"
    assert isinstance(outcomes[2], RequestError), "a ticket id already queued is a RequestError"
    assert "b1" in ctl.queue, "the refusals did not undo the first park"


def _one_slot_free(queue_size: int = 100) -> Controller:
    ctl = _busy_controller(queue_size)
    ctl.report(report("r1", capacity=2, running=1, by_priority={2: 1}))
    return ctl


def test_a_batch_grants_its_most_urgent_ticket_first_when_room_is_short():
    ctl = _one_slot_free()
    outcomes = ctl.park_many([(ticket("b", "batch", 100.0), None), (ticket("i", "interactive", 100.0), None)])
    assert outcomes[1] == Grant("r1"), "the interactive ticket, parked second, gets the one free slot"
    assert outcomes[0] is None, "the batch ticket, parked first, waits"


def test_a_full_queue_does_not_refuse_a_ticket_while_a_replica_has_room():
    ctl = _one_slot_free(queue_size=1)
    outcomes = ctl.park_many([(ticket("b1", "batch", 100.0), None), (ticket("b2", "batch", 100.1), None)])
    assert outcomes[0] == Grant("r1"), "the first ticket gets the free slot before the second is admitted"
    assert outcomes[1] is None, "the second waits in the place the first left, rather than being refused"


def test_a_ticket_bumped_by_a_later_one_of_its_batch_gets_its_refusal_in_the_batch():
    ctl = _busy_controller(queue_size=1)
    outcomes = ctl.park_many([(ticket("b", "batch", 100.0), None), (ticket("i", "interactive", 100.0), None)])
    assert isinstance(outcomes[0], Refusal), "the batch ticket is bumped out of the full queue"
    assert outcomes[1] is None, "the interactive ticket takes its place"
    assert ctl.take_grants() == {}, "the refusal is not delivered twice"


def test_each_ingress_s_latest_claims_count_once_per_batch():
    ctl = _busy_controller()
    ctl.report(report("r1", capacity=4, running=0))
    first = {"inflight": {"r1": 1}, "unassigned": 0}
    latest = {"inflight": {"r1": 3}, "unassigned": 0}
    t1, t2 = ticket("s1", "standard", 100.0), ticket("s2", "standard", 100.0)
    outcomes = ctl.park_many([(t1, first), (t2, latest)])
    assert outcomes == [Grant("r1"), None], "the latest claim (3 of 4 taken) leaves room for one grant"


def _standard(n: int) -> list[tuple]:
    return [(ticket(f"s{i}", "standard", 100.0), None) for i in range(n)]


def _batcher(window_s: float) -> tuple[BatchWindow, list[list[str]], Controller]:
    ctl = _busy_controller()
    calls: list[list[str]] = []

    def park_many(parks):
        calls.append([t.ticket_id for t, _ in parks])
        return ctl.park_many(parks)

    return BatchWindow(park_many, ctl.dispatch, window_s), calls, ctl


def test_parks_within_one_window_reach_the_controller_as_one_batch():
    async def scenario() -> tuple[list[object], list[list[str]]]:
        batcher, calls, _ = _batcher(0.01)
        first = await asyncio.gather(*(batcher.park(*p) for p in _standard(5)))
        second = await batcher.park(ticket("late", "standard", 100.0), None)
        return [*first, second], calls

    outcomes, calls = asyncio.run(scenario())
    assert calls == [["s0", "s1", "s2", "s3", "s4"], ["late"]], "one call per window, in arrival order"
    assert outcomes == [None] * 6, "each caller gets its own ticket's outcome"


def test_a_window_of_zero_batches_the_parks_of_one_event_loop_turn():
    async def scenario() -> list[list[str]]:
        batcher, calls, _ = _batcher(0.0)
        await asyncio.gather(*(batcher.park(*p) for p in _standard(3)))
        return calls

    assert asyncio.run(scenario()) == [["s0", "s1", "s2"]], "the parks of one turn go together"


def test_a_caller_that_went_away_before_its_batch_is_left_out_of_it():
    async def scenario() -> tuple[list[list[str]], Controller]:
        batcher, calls, ctl = _batcher(0.05)
        gone = asyncio.ensure_future(batcher.park(ticket("gone", "standard", 100.0), None))
        stays = asyncio.ensure_future(batcher.park(ticket("stays", "standard", 100.0), None))
        await asyncio.sleep(0.01)
        gone.cancel()
        await stays
        return calls, ctl

    calls, ctl = asyncio.run(scenario())
    assert calls == [["stays"]], "the cancelled park is not sent"
    assert "gone" not in ctl.queue, "so it never reaches the queue"


def test_a_failing_batch_gives_every_caller_its_error_and_the_next_batch_still_runs():
    async def scenario() -> tuple[list[BaseException | None], object]:
        failing = [True]

        def park_many(parks):
            if failing[0]:
                failing[0] = False
                raise RuntimeError("controller bug")
            return [None] * len(parks)

        batcher = BatchWindow(park_many, lambda: None, 0.0)
        got = await asyncio.gather(*(batcher.park(*p) for p in _standard(2)), return_exceptions=True)
        return got, await batcher.park(ticket("next", "standard", 100.0), None)

    got, after = asyncio.run(scenario())
    assert all(isinstance(e, RuntimeError) for e in got), f"every caller of the batch hears of it: {got}"
    assert after is None, "the next batch is sent as usual"


@pytest.mark.parametrize("window_s", [0.0, 0.002])
def test_the_window_runs_its_after_hook_once_per_window(window_s: float):
    async def scenario() -> int:
        ran = []
        batcher = BatchWindow(lambda parks: [None] * len(parks), lambda: None, window_s,
                              after=lambda: ran.append(1))
        await asyncio.gather(*(batcher.park(*p) for p in _standard(4)))
        return len(ran)

    assert asyncio.run(scenario()) == 1, "grants decided for earlier tickets are delivered after each window"


def test_a_report_taken_without_a_dispatch_grants_its_room_at_the_window_s_dispatch():
    ctl = _busy_controller()
    assert ctl.park(ticket("s", "standard", 100.0)) is None, "no room: the ticket waits"
    reply = ctl.report(report("r1", capacity=2, running=1, by_priority={2: 1}), dispatch=False)
    assert reply["queue_depth"] == 1, "the reply counts the ticket the window's dispatch may grant"
    assert ctl.take_grants() == {}, "nothing is granted before the dispatch"
    ctl.dispatch()
    assert ctl.take_grants() == {"s": Grant("r1")}, "the window's dispatch grants the freed slot"


def test_reports_and_parks_of_one_window_share_one_dispatch():
    async def scenario() -> tuple[list[str], object]:
        calls: list[str] = []
        ctl = _busy_controller()

        def park_many(parks):
            calls.append("park_many")
            return ctl.park_many(parks)

        def dispatch():
            calls.append("dispatch")
            ctl.dispatch()

        window = BatchWindow(park_many, dispatch, 0.01)
        for _ in range(3):
            ctl.report(report("r1", capacity=2, running=2, by_priority={2: 2}), dispatch=False)
            window.dispatch_soon()
        parked = await window.park(ticket("s", "standard", 100.0), None)
        for _ in range(2):  # a window of reports alone
            ctl.report(report("r1", capacity=2, running=2, by_priority={2: 2}), dispatch=False)
            window.dispatch_soon()
        await asyncio.sleep(0.05)
        return calls, parked

    calls, parked = asyncio.run(scenario())
    assert calls == ["park_many", "dispatch"], "one call per window: park_many (it dispatches), then dispatch"
    assert parked is None, "no room was reported: the ticket waits"


def test_the_served_configuration_batches_the_controller_s_inputs_of_one_loop_turn_without_a_wait(
        monkeypatch: pytest.MonkeyPatch):
    from lora_cluster.config import ServeConfig, load_config

    window_s = ServeConfig().controller.controller_batch_window_s
    assert window_s == 0.0, "no added wait by default (docs/scale.md)"
    monkeypatch.setenv("LORA_CLUSTER_CONTROLLER_BATCH_WINDOW_S", "0.002")
    window_s = load_config({}).controller.controller_batch_window_s
    assert window_s == 0.002, "the window is set by its environment variable"


def test_a_report_s_reply_waits_for_its_window_s_dispatch_even_a_failed_one():
    async def scenario() -> list[str]:
        events: list[str] = []

        def dispatch():
            events.append("dispatch")
            raise RuntimeError("controller bug")

        window = BatchWindow(lambda parks: [None] * len(parks), dispatch, 0.01)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: events.append("logged"))
        await asyncio.gather(window.dispatched(), window.dispatched())
        events.append("replied")
        return events

    assert asyncio.run(scenario()) == ["dispatch", "logged", "replied"], (
        "both replies wait for the one dispatch, and still go out when it fails (the error logged)")


def test_a_batch_of_refused_parks_still_dispatches_the_room_of_its_window_s_reports():
    ctl = _busy_controller()
    assert ctl.park(ticket("s", "standard", 100.0)) is None, "no room: the ticket waits"
    ctl.report(report("r1", capacity=2, running=1, by_priority={2: 1}), dispatch=False)  # a slot frees
    outcomes = ctl.park_many([(ticket("s", "standard", 100.0), None)])
    assert isinstance(outcomes[0], RequestError), "the batch's one park is refused (its id is queued)"
    assert ctl.take_grants() == {"s": Grant("r1")}, "the report's room is granted with the batch anyway"


class ManualTimer:
    """The window's timer on a clock the test moves: `run_due(now)` runs what is due."""

    def __init__(self) -> None:
        self.now, self.due = 0.0, []

    def __call__(self, delay_s: float, fn) -> None:
        self.due.append((self.now + delay_s, fn))

    def run_due(self, now: float) -> None:
        self.now = now
        ready, self.due = [f for t, f in self.due if t <= now], [(t, f) for t, f in self.due if t > now]
        for fn in ready:
            fn()


def _pure_window(window_s: float, park_many=None, dispatch=None):
    events: list[object] = []
    timer = ManualTimer()
    window = pure.BatchWindow(park_many or (lambda parks: [f"out-{t.ticket_id}" for t, _ in parks]),
                        dispatch or (lambda: events.append("dispatch")), window_s, timer,
                        after=lambda: events.append("after"))
    return window, timer, events


def test_the_pure_window_sends_its_parks_together_once_its_timer_fires():
    window, timer, events = _pure_window(0.01)
    for name in ("p1", "p2"):
        window.park(ticket(name, "standard", 100.0), None, deliver=events.append, fail=events.append)
    window.on_sent(lambda: events.append("replied"))
    timer.run_due(0.005)
    assert events == [], "nothing is sent before the window ends"
    timer.run_due(0.01)
    assert events == ["out-p1", "out-p2", "after", "replied"], (
        "each park's outcome in order, then the after hook, then the reports' replies")


def test_the_pure_window_leaves_out_a_park_no_longer_wanted_and_dispatches_for_reports_alone():
    window, timer, events = _pure_window(0.01)
    window.park(ticket("gone", "standard", 100.0), None, deliver=events.append, fail=events.append,
                wanted=lambda: False)
    timer.run_due(0.01)
    assert events == ["dispatch", "after"], "a window without wanted parks dispatches for its reports"


def test_the_pure_window_gives_a_failed_batch_s_error_to_every_park():
    def park_many(parks):
        raise RuntimeError("controller bug")

    window, timer, events = _pure_window(0.0, park_many=park_many)
    for name in ("p1", "p2"):
        window.park(ticket(name, "standard", 100.0), None, deliver=events.append,
                    fail=lambda e: events.append(type(e).__name__))
    window.on_sent(lambda: events.append("replied"))
    timer.run_due(0.0)
    assert events == ["RuntimeError", "RuntimeError", "replied"], "every park hears of it; replies still go"

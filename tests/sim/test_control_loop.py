"""The controller actor's loop on the simulated clock (`sim.control_loop`): inputs that arrive while it
is busy go together in its next turn, and outputs leave when their turn ends."""

from __future__ import annotations

import pytest

from lora_cluster.sim.control_loop import KINDS, ControlCost, ControlLoop
from lora_cluster.sim.events import EventLoop

COST = ControlCost(call_s=0.001, work_s={**dict.fromkeys(KINDS, 0.0), "report": 0.002}, dispatch_s=0.004)


class Recorder:
    """Runs a ControlLoop on an EventLoop and records what happens when."""

    def __init__(self, cost: ControlCost = COST):
        self.events = EventLoop()
        self.log: list[tuple[float, str]] = []
        self.loop = ControlLoop(cost, self.events.clock, self.events.at, self.end_turn)

    def end_turn(self) -> None:
        self.log.append((self.events.now, "end"))

    def submit_at(self, when: float, kind: str, name: str) -> None:
        def act():
            self.log.append((self.events.now, f"act {name}"))
            return lambda: self.log.append((self.events.now, f"out {name}"))
        self.events.at(when, self.loop.submit, kind, act)


def test_an_idle_loop_takes_an_input_at_once_and_answers_after_its_cost() -> None:
    r = Recorder()
    r.submit_at(1.0, "report", "a")
    r.events.run(10.0)
    assert r.log[0] == (1.0, "act a"), f"the input acts when it arrives: {r.log}"
    assert r.log[-1] == (pytest.approx(1.0 + 0.003 + 0.004), "out a"), (
        f"answered after call + work + dispatch: {r.log}")


def test_inputs_arriving_while_busy_go_together_in_the_next_turn() -> None:
    r = Recorder()
    r.submit_at(1.0, "report", "a")
    r.submit_at(1.001, "park", "b")
    r.submit_at(1.002, "park", "c")
    r.events.run(10.0)
    turn_two = 1.0 + 0.007
    acts = [(t, e) for t, e in r.log if e.startswith("act")]
    assert acts[1:] == [(pytest.approx(turn_two), "act b"), (pytest.approx(turn_two), "act c")], (
        f"both waited for the first turn's end and acted in one turn, in arrival order: {r.log}")
    assert [e for _, e in r.log].count("end") == 2, f"two turns, so two dispatches: {r.log}"
    assert r.loop.turns == 2, "the loop counts two turns"


def test_an_output_never_leaves_before_its_turn_ends() -> None:
    r = Recorder()
    for i in range(5):
        r.submit_at(0.5 + i * 0.0001, "park", str(i))
    r.events.run(10.0)
    acted = {e.split()[1]: t for t, e in r.log if e.startswith("act")}
    answered = {e.split()[1]: t for t, e in r.log if e.startswith("out")}
    for name, t in answered.items():
        assert t > acted[name], f"input {name} answered at {t}, after it acted at {acted[name]}"


def test_busy_time_is_the_sum_of_the_turns_costs() -> None:
    r = Recorder()
    r.submit_at(0.0, "tick", "t")
    r.submit_at(0.0, "cancel", "c")
    r.submit_at(0.1, "report", "r")
    r.events.run(10.0)
    expected = (2 * 0.001 + 0.004) + (0.003 + 0.004)
    assert r.loop.busy_s == pytest.approx(expected), (
        "two turns: two calls and a dispatch, then a report and a dispatch")


def test_a_zero_cost_loop_answers_at_the_instant_of_the_input() -> None:
    r = Recorder(cost=ControlCost.zero())
    r.submit_at(2.0, "placement", "p")
    r.events.run(10.0)
    assert r.log[-1] == (2.0, "out p"), f"no cost, no delay: {r.log}"


def test_an_unknown_input_kind_is_refused() -> None:
    r = Recorder()
    with pytest.raises(ValueError, match="unknown controller input 'bogus'"):
        r.loop.submit("bogus", lambda: None)


def test_a_cost_missing_a_kind_or_negative_is_refused() -> None:
    with pytest.raises(ValueError, match="a cost >= 0 for each"):
        ControlCost(0.001, {"park": 0.0}, 0.0)
    with pytest.raises(ValueError, match="a cost >= 0 for each"):
        ControlCost(-0.001, dict.fromkeys(KINDS, 0.0), 0.0)


def test_an_input_submitted_during_a_turn_waits_for_its_end_in_one_next_turn() -> None:
    r = Recorder()

    def act():
        r.log.append((r.events.now, "act first"))
        r.loop.submit("tick", lambda: r.log.append((r.events.now, "act inner")))
        return None

    r.events.at(1.0, r.loop.submit, "report", act)
    r.events.run(10.0)
    inner = [t for t, e in r.log if e == "act inner"]
    assert inner == [pytest.approx(1.0 + 0.007)], f"it acts once, when the first turn ends: {r.log}"
    assert r.loop.turns == 2, "two turns, not three"


def test_a_batch_of_items_is_one_call_and_each_items_work() -> None:
    cost = ControlCost(call_s=0.001, work_s={**dict.fromkeys(KINDS, 0.0), "park": 0.0001}, dispatch_s=0.0)
    r = Recorder(cost)
    r.events.at(1.0, r.loop.submit, "park", lambda: None, 10)
    r.events.run(10.0)
    assert r.loop.busy_s == pytest.approx(0.001 + 10 * 0.0001), "one call's overhead for ten parks' work"
    assert (r.loop.by_kind["park"], r.loop.items["park"]) == (1, 10), "one park input carrying ten parks"


def test_a_model_without_a_poll_cost_reads_as_a_call_alone() -> None:
    data = {"call_s": 0.001, "work_s": {k: 0.0 for k in KINDS if k != "poll"}, "dispatch_s": 0.0}
    assert ControlCost.load_dict(data).input_s("poll") == 0.001, "a grants poll costs the call, no work"

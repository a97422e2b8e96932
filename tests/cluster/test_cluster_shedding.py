"""Load shedding by adapter residency (`cluster.shedding`), through the controller's `park`, with a fake
clock and no Ray: while a class refuses requests for its TTFT target, its requests whose adapter no
replica holds are refused first."""

from __future__ import annotations

import pytest
from helpers import FakeClock
from tickets import CLASSES, ticket

from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.shedding import ColdShedding
from lora_cluster.config import ServeConfig
from lora_cluster.errors import (
    ClusterOverloadedError,
    ColdAdapterShedError,
    DeadlineOutOfReachError,
    WaitBoundError,
)


def shedding_controller(window_s: float = 1.0) -> tuple[FakeClock, Controller]:
    """One replica, full of `standard` work, holding `held` and loading `warming`; a slow measured
    drain (0.4 requests/s), so that the third queued `standard` ticket is refused for its 5 s target.
    Returned after that refusal, with the two queued tickets cancelled again (the queue is empty)."""
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(cold_shed_window_s=window_s), clock=clock)
    ctl.report(ReplicaReport("r1", "n1", capacity=1, max_num_seqs=1, max_loras=4, running=1, waiting=0,
                             free_adapter_slots=0, resident=("held",), loading=("warming",),
                             running_by_priority={1: 1}))
    ctl.queue.drain.record(1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    ctl.park(ticket("s1", "standard", 100.0, "held"))
    with pytest.raises(DeadlineOutOfReachError):
        ctl.park(ticket("s2", "standard", 100.0, "held"))
    ctl.cancel("s0")
    ctl.cancel("s1")
    return clock, ctl


def test_a_shedding_class_refuses_a_request_whose_adapter_no_replica_holds():
    _, ctl = shedding_controller()
    with pytest.raises(ColdAdapterShedError) as info:
        ctl.park(ticket("cold", "standard", 100.0, "rare"))
    assert "'rare'" in str(info.value), f"the refusal names the adapter: {info.value}"
    assert "standard" in str(info.value), f"the refusal names the class: {info.value}"
    assert "cold_shed_window_s" in str(info.value), f"the refusal names the setting: {info.value}"
    assert info.value.retry_after_s >= 1.0, "the refusal says when to retry"
    assert isinstance(info.value, ClusterOverloadedError), "it is an overload refusal (429 with Retry-After)"
    assert ctl.counts["shed_cold"] == 1, f"the controller counts it: {ctl.counts}"


def test_a_shedding_class_still_queues_requests_whose_adapter_a_replica_holds_or_loads():
    _, ctl = shedding_controller()
    ctl.park(ticket("hit", "standard", 100.0, "held"))
    ctl.park(ticket("loading", "standard", 100.0, "warming"))
    assert "hit" in ctl.queue, "an adapter resident on a replica: queued"
    assert "loading" in ctl.queue, "an adapter a replica is loading: queued"


def test_the_most_urgent_class_and_the_base_model_are_never_shed():
    _, ctl = shedding_controller()
    ctl.shedding.record(CLASSES.get("interactive").priority)  # as if the top class shed too
    ctl.park(ticket("urgent", "interactive", 100.0, "rare"))
    ctl.park(ticket("patient", "batch", 100.0, "rare"))
    ctl.park(ticket("base", "standard", 100.0, None))
    assert "urgent" in ctl.queue, "the most urgent class preempts instead: queued"
    assert "patient" in ctl.queue, "batch, which is not over its own bound: queued"
    assert "base" in ctl.queue, "the base model, which every replica holds: queued"


def test_a_batch_class_over_its_wait_bound_sheds_its_cold_requests_first():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(wait_bound_s=60.0), clock=clock)
    ctl.report(ReplicaReport("r1", "n1", capacity=1, max_num_seqs=1, max_loras=4, running=1, waiting=0,
                             free_adapter_slots=0, resident=("held",), running_by_priority={2: 1}))
    ctl.park(ticket("b0", "batch", 100.0, "held"))
    clock.now = 131.0
    with pytest.raises(WaitBoundError):
        ctl.park(ticket("b1", "batch", 131.0, "held"))
    ctl.cancel("b0")
    with pytest.raises(ColdAdapterShedError, match="'rare'"):
        ctl.park(ticket("cold", "batch", 131.0, "rare"))
    ctl.park(ticket("warm", "batch", 131.0, "held"))
    assert "warm" in ctl.queue, "a batch request whose adapter a replica holds is queued (backlog drained)"


def test_shedding_ends_with_its_window():
    clock, ctl = shedding_controller(window_s=1.0)
    clock.now += 1.0
    ctl.park(ticket("cold", "standard", clock.now, "rare"))
    assert "cold" in ctl.queue, "a second after the last refusal for a deadline, a cold request is queued"


def test_a_window_of_zero_turns_shedding_off():
    _, ctl = shedding_controller(window_s=0.0)
    ctl.park(ticket("cold", "standard", 100.0, "rare"))
    assert "cold" in ctl.queue, "with cold_shed_window_s 0 a cold request is queued as any other"


def test_one_class_shedding_does_not_shed_another():
    clock = FakeClock(100.0)
    shedding = ColdShedding(1.0, clock)
    shedding.record(CLASSES.get("standard").priority)
    assert shedding.shedding(1), "the class that refused for its deadline sheds"
    assert not shedding.shedding(2), "another class does not"


def test_the_served_configuration_sheds_for_one_second(monkeypatch):
    assert ControllerSettings.from_config(ServeConfig().controller).cold_shed_window_s == 1.0, "default: 1 s"
    monkeypatch.setenv("LORA_CLUSTER_COLD_SHED_WINDOW_S", "0")
    assert ControllerSettings.from_config(ServeConfig().controller).cold_shed_window_s == 0.0, (
        "LORA_CLUSTER_COLD_SHED_WINDOW_S overrides it")


def pressured_controller(pressure: float) -> Controller:
    """One replica full of `standard` work holding `held`; a slow drain (0.4 requests/s) and one
    `standard` ticket queued, so that the next one would wait 5 s: within its 5 s target (no refusal,
    and the refusal window is off), but more than 0.75 of it."""
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(cold_shed_window_s=0.0, cold_shed_pressure=pressure),
                     clock=clock)
    ctl.report(ReplicaReport("r1", "n1", capacity=1, max_num_seqs=1, max_loras=4, running=1, waiting=0,
                             free_adapter_slots=0, resident=("held",), running_by_priority={1: 1}))
    ctl.queue.drain.record(1)
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    return ctl


def test_a_class_under_pressure_sheds_its_cold_requests_before_any_refusal():
    ctl = pressured_controller(0.75)
    with pytest.raises(ColdAdapterShedError) as info:
        ctl.park(ticket("cold", "standard", 100.0, "rare"))
    assert "cold_shed_pressure" in str(info.value), f"the refusal names the setting: {info.value}"
    ctl.park(ticket("warm", "standard", 100.0, "held"))
    assert "warm" in ctl.queue, "a request whose adapter a replica holds is still queued"


def test_a_class_below_the_pressure_share_queues_its_cold_requests():
    ctl = pressured_controller(1.0)
    ctl.park(ticket("cold", "standard", 100.0, "rare"))
    assert "cold" in ctl.queue, "a predicted wait of 5 s is not above 1.0 of the 5 s target: queued"


def test_a_pressure_of_zero_turns_the_queue_state_rule_off():
    ctl = pressured_controller(0.0)
    ctl.park(ticket("cold", "standard", 100.0, "rare"))
    assert "cold" in ctl.queue, "with cold_shed_pressure 0 (and no window) a cold request is queued"


def test_a_class_without_a_target_is_under_pressure_against_half_its_wait_bound():
    clock = FakeClock(100.0)
    shedding = ColdShedding(0.0, clock, pressure=0.75, no_target_bound_s=30.0)
    batch = ticket("b", "batch", 100.0, "rare")
    assert shedding.under_pressure(batch, 23.0), "23 s predicted is above 0.75 of a 30 s bound"
    assert not shedding.under_pressure(batch, 22.0), "22 s predicted is not"
    assert not shedding.under_pressure(batch, None), "no prediction yet: no pressure"


def test_the_served_configuration_sheds_under_three_quarters_of_the_target(monkeypatch):
    pressure = ControllerSettings.from_config(ServeConfig().controller).cold_shed_pressure
    assert pressure == 0.75, "default: 0.75"
    monkeypatch.setenv("LORA_CLUSTER_COLD_SHED_PRESSURE", "0")
    assert ControllerSettings.from_config(ServeConfig().controller).cold_shed_pressure == 0.0, (
        "LORA_CLUSTER_COLD_SHED_PRESSURE overrides it")

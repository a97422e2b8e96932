"""The simulator's controller actor loop, end to end (`sim.control_inbox`): a controller that costs time
delays the grants, batches its inputs when busy, and the committed cost model loads."""

from __future__ import annotations

from sim_profiles import SYNTHETIC

from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.control_loop import KINDS, ControlCost

CELL = SimConfig(nodes=6, adapters=60, zipf=1.0, load=1.6, duration=20, warmup=5, seed=4, max_loras=4)
SLOW = ControlCost(call_s=0.004, work_s=dict.fromkeys(KINDS, 0.0), dispatch_s=0.002)


def test_the_committed_cost_model_is_the_default_and_is_modelled() -> None:
    plane = Simulation(CELL, SYNTHETIC).finish().to_json()["control_plane"]
    assert plane["controller_loop_modelled"] is True, "one controller at window 0: the loop is modelled"
    assert 0 < plane["controller_busy_share"] < 1, f"busy part of the time: {plane}"
    assert ControlCost.named("none") is None, "`none` models no loop"


def test_a_slow_controller_delays_its_grants_where_tickets_park_without_overload() -> None:
    """At 1.2x the cell carries its load and parks a share of its requests: a controller busy 10 ms a
    call answers each input (a park, a report, a poll) a turn later. Measured at the loop, from an
    input reaching the actor to the end of the turn that took it: the queue's depth and the classes'
    first-token medians are the policy's choices (which requests park, which copies it makes), and
    moved either way with policy changes that left the loop alone."""
    carried = SimConfig(**{**CELL.__dict__, "load": 1.2})
    slower = ControlCost(call_s=0.01, work_s=dict.fromkeys(KINDS, 0.0), dispatch_s=0.002)
    free = Simulation(carried, SYNTHETIC, control_cost=ControlCost.zero()).finish().to_json()["control_plane"]
    result = Simulation(carried, SYNTHETIC, control_cost=slower).finish()
    slow, details = result.to_json()["control_plane"], result.details
    assert details["parked"] > 0.2 * (details["parked"] + details["fast_path"]), (
        f"tickets park: {details['parked']}")
    assert free["input_latency_s_mean"] == 0, f"a controller that costs nothing answers at once: {free}"
    assert slow["input_latency_s_mean"] >= 0.01, (
        f"each input waits at least its own call's 10 ms: {slow['input_latency_s_mean']}")


def test_a_slow_controller_batches_its_inputs() -> None:
    free = Simulation(CELL, SYNTHETIC, control_cost=ControlCost.zero()).finish().to_json()
    slow = Simulation(CELL, SYNTHETIC, control_cost=SLOW).finish().to_json()
    assert slow["control_plane"]["inputs_per_turn"] > free["control_plane"]["inputs_per_turn"], (
        "inputs that arrive while it is busy wait for its next turn, together")
    assert slow["control_plane"]["controller_busy_share"] > free["control_plane"]["controller_busy_share"], (
        "a costlier input keeps the loop busier")


def test_without_a_model_nothing_is_modelled() -> None:
    plane = Simulation(CELL, SYNTHETIC, control_cost=None).finish().to_json()["control_plane"]
    assert plane["controller_loop_modelled"] is True, "no override: the config's measured model"
    none = Simulation(SimConfig(**{**CELL.__dict__, "control_cost": "none"}), SYNTHETIC).finish().to_json()
    assert none["control_plane"]["controller_loop_modelled"] is False, "--control-cost none: no loop"


def test_each_shard_runs_its_own_loop_and_the_busiest_one_is_reported() -> None:
    config = SimConfig(**{**CELL.__dict__, "serve": ServeSections().with_fields(controller_shards=2)})
    plane = Simulation(config, SYNTHETIC, control_cost=SLOW).finish().to_json()["control_plane"]
    one = Simulation(CELL, SYNTHETIC, control_cost=SLOW).finish().to_json()["control_plane"]
    assert plane["controller_loop_modelled"] is True, f"each shard's loop is modelled: {plane}"
    assert 0 < plane["quietest_shard_busy_share"] <= plane["controller_busy_share"] < 1, (
        f"the busiest shard's busy share is reported, beside the quietest's: {plane}")
    assert plane["report_inputs_per_s"] < 1.5 * one["report_inputs_per_s"], (
        f"a round goes only to the shards it concerns, not one report per shard: {plane} {one}")
    assert plane["parks_per_s"] > 0, f"the parks reach their adapters' shards: {plane}"


def test_a_busy_controller_takes_the_ingress_parks_in_batches_one_call_at_a_time() -> None:
    busy = ControlCost(call_s=0.02, work_s=dict.fromkeys(KINDS, 0.0), dispatch_s=0.002)  # ~90% busy
    overloaded = SimConfig(**{**CELL.__dict__, "load": 3.0})
    plane = Simulation(overloaded, SYNTHETIC, control_cost=busy).finish().to_json()["control_plane"]
    assert plane["parks_per_s"] > 0, f"the cell parks: {plane}"
    assert plane["parks_per_s"] > 1.2 * plane["park_calls_per_s"], (
        f"parks that arrive while a park call is in flight go together in the next one: {plane}")


def test_free_calls_send_each_park_alone_with_no_added_wait() -> None:
    plane = Simulation(CELL, SYNTHETIC, control_cost=ControlCost.zero()).finish().to_json()["control_plane"]
    assert plane["parks_per_s"] == plane["park_calls_per_s"], (
        f"a call answered at once is never in flight when the next park arrives: {plane}")


def test_the_report_budget_bounds_the_reports_a_controller_takes() -> None:
    config = SimConfig(**{**CELL.__dict__, "serve": ServeSections().with_fields(
        controller_report_budget_per_s=6.0)})
    free = Simulation(CELL, SYNTHETIC).finish().to_json()["control_plane"]
    paced = Simulation(config, SYNTHETIC).finish().to_json()["control_plane"]
    assert free["report_inputs_per_s"] > 6.0, f"at the shipped budget this cell reports more often: {free}"
    assert paced["report_inputs_per_s"] <= 6.0 * 1.05, (
        f"6 replicas within 6 reports a second report about once a second each: {paced}")

"""Metering in the engine: the step-cost rule (`replica_policy.step_cost`) on hand-computed cases, the
engine's meter (`engine.schedule.step_meter`) with a fake clock (step time, queue time, residency),
and conservation on a mixed run of the demo engine (every second of measured step time is charged to
exactly one request)."""

from __future__ import annotations

import random

import pytest
from helpers import FakeClock, greedy

from lora_cluster.engine import Engine
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.engine.schedule.step_meter import MAX_TRACKED_ADAPTERS, OVERFLOW, StepMeter
from lora_cluster.replica_policy.step_cost import RANK_UNIT, SeqWork, split_step, work_units
from lora_cluster.request.output import RequestOutput
from lora_cluster.request.sampling_params import SamplingParams

# ----- the rule (unit) ---------------------------------------------------------------------------


def test_a_base_model_token_is_one_unit_and_rank_adds_in_proportion():
    assert work_units(SeqWork("a", decode_tokens=1)) == 1.0, "a base-model decode token is one unit"
    assert work_units(SeqWork("a", prefill_tokens=10, rank=64)) == 10 * (1 + 64 / RANK_UNIT), (
        "a prefill token of a rank-r adapter counts 1 + r / RANK_UNIT units"
    )


def test_a_step_is_split_by_tokens_and_rank():
    # 12 prefill tokens at rank 0 (12 units), 1 decode at rank 256 (2 units), 1 decode at rank 0 (1 unit)
    works = [SeqWork("p", prefill_tokens=12), SeqWork("d1", decode_tokens=1, rank=RANK_UNIT),
             SeqWork("d0", decode_tokens=1)]
    shares = split_step(0.030, works)
    assert shares["p"] == pytest.approx(0.024), "12 of 15 units: 24 ms of a 30 ms step"
    assert shares["d1"] == pytest.approx(0.004), "2 of 15 units: a decode of a rank-RANK_UNIT adapter"
    assert shares["d0"] == pytest.approx(0.002), "1 of 15 units: a base-model decode"


def test_the_shares_of_a_step_sum_to_its_time():
    rng = random.Random(7)
    for _ in range(200):
        works = [SeqWork(f"r{i}", prefill_tokens=rng.choice([0, rng.randint(1, 512)]),
                         decode_tokens=rng.randint(0, 1), rank=rng.choice([0, 8, 16, 64]))
                 for i in range(rng.randint(1, 32))]
        elapsed = rng.uniform(1e-4, 1.0)
        assert sum(split_step(elapsed, works).values()) == pytest.approx(elapsed, rel=1e-12), (
            "a step's shares sum to its measured time, whatever its mix"
        )


def test_a_step_without_work_units_is_split_evenly():
    shares = split_step(0.01, [SeqWork("a"), SeqWork("b")])
    assert shares == {"a": pytest.approx(0.005), "b": pytest.approx(0.005)}, (
        "sequences that computed no tokens share the step's time evenly, so none of it is lost"
    )


def test_the_meter_counts_slot_seconds_per_resident_adapter():
    clock = FakeClock()
    meter = StepMeter(clock)
    meter.resided(["a1"])
    clock.advance(2.0)
    meter.resided(["a1", "a2"])
    clock.advance(0.5)
    meter.resided(["a2"])
    assert meter.take_residency() == {"a1": 2.0, "a2": 2.5}, (
        "each interval's time goes to every adapter resident at its end"
    )
    assert meter.take_residency() == {}, "taking the residency clears it"


def waiting_seq(rid: str, arrival: float) -> Sequence:
    return Sequence(rid, None, [1, 2, 3], SamplingParams(), IncrementalDetokenizer(None), None,
                    arrival=arrival)


def test_the_meter_charges_each_wait_until_the_step_that_runs_the_sequence():
    clock = FakeClock()
    meter = StepMeter(clock, wait_clock=clock)
    seq = waiting_seq("r1", arrival=clock())
    clock.advance(3.0)  # it waits 3 s, then a step of 0.5 s runs it
    clock.advance(0.5)
    meter.charge(0.5, [], [(seq, 3)], lambda slot: 0)
    assert seq.queue_s == pytest.approx(3.0), "the wait from arrival to the step's start is its queue time"
    clock.advance(1.0)
    meter.charge(1.0, [seq], [], lambda slot: 0)
    assert seq.queue_s == pytest.approx(3.0), "a step that continues it is no wait"
    seq.waiting_since = clock()  # preempted (the scheduler stamps it), waits 2 s, runs again
    clock.advance(2.0)
    clock.advance(0.25)
    meter.charge(0.25, [], [(seq, 4)], lambda slot: 0)
    assert seq.queue_s == pytest.approx(5.0), "a wait after a preemption adds to the same total"


def test_residency_is_bounded_by_the_number_of_tracked_adapters():
    clock = FakeClock()
    meter = StepMeter(clock)
    meter.resided([])
    clock.advance(1.0)
    meter.resided([f"a{i}" for i in range(MAX_TRACKED_ADAPTERS + 10)])
    taken = meter.take_residency()
    assert len(taken) == MAX_TRACKED_ADAPTERS + 1, "adapters past the bound share one overflow entry"
    assert taken[OVERFLOW] == pytest.approx(10.0), "the overflow entry keeps their slot-seconds"


# ----- the engine (engine tier) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    """Two KV slots, two adapter slots, a 16-token step budget and the prefix cache: prompts are
    chunked, adapters rotate, and urgent requests preempt."""
    return make_engine(max_loras=2, max_num_seqs=2, max_num_batched_tokens=16, enable_prefix_caching=True)


def mixed_run(engine: Engine, seed: int) -> dict[str, RequestOutput]:
    """Requests on the base model and three adapters; urgent ones arrive while less urgent ones run
    (they preempt), two are aborted midway, some share a prompt (prefix-cache hits). Returns every
    request's final output."""
    rng = random.Random(seed)
    prompts = ["the river runs to the sea and back again " * 2, "a short one", "the river runs"]
    adapters = [None, "a0", "a1", "a2"]
    final: dict[str, RequestOutput] = {}
    for i in range(10):
        engine.add_request(f"m{i}", rng.choice(prompts), rng.choice(adapters), greedy(rng.randint(4, 12)),
                           priority=2)
    steps = 0
    while engine.has_unfinished() and steps < 2000:
        steps += 1
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if steps in (8, 20):
            for j in range(2):
                engine.add_request(f"u{steps}-{j}", rng.choice(prompts), rng.choice(adapters), greedy(3))
        if steps in (5, 14):
            running = [rid for rid in (f"m{i}" for i in range(10)) if rid not in final]
            aborted = engine.abort(running[0])
            if aborted is not None:
                final[aborted.request_id] = aborted
    assert not engine.has_unfinished(), "precondition: the run ended within its step bound"
    return final


def test_every_second_of_step_time_is_charged_to_a_request(engine: Engine):
    busy_before = engine.meter.busy_s
    final = mixed_run(engine, seed=3)
    busy = engine.meter.busy_s - busy_before
    assert busy > 0, "precondition: the run took measurable step time"
    assert any(out.finish_reason == "abort" for out in final.values()), "precondition: some were aborted"
    assert any(out.num_preemptions for out in final.values()), "precondition: some were preempted"
    attributed = sum(out.device_s for out in final.values())
    assert attributed == pytest.approx(busy, rel=0.01), (
        "device-seconds charged to requests (aborted and preempted ones included) equal the engine's "
        "measured busy time within 1%"
    )
    assert all(out.device_s > 0 for out in final.values() if out.token_ids), (
        "every request that got a token was charged for it"
    )


def test_a_request_that_waits_for_a_slot_reports_its_queue_time(make_engine):
    engine = make_engine(max_num_seqs=1)
    try:
        first, second = engine.generate(["the river", "the sea"], sampling=greedy(6))
    finally:
        engine.close()
    assert second.queue_s >= first.device_s * 0.5, (
        f"the second request waited while the first ran in the one slot: {second.queue_s} s queued, "
        f"the first ran {first.device_s} s"
    )
    assert first.queue_s < second.queue_s, "the first request waited less than the second"


def test_a_cached_prompt_costs_less_than_a_computed_one_in_the_same_step(make_engine):
    # both requests run in the same steps, so the comparison depends on the rule, not on timing (the
    # machine's load moves a step's measured time, never how the step is split)
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=512, enable_prefix_caching=True)
    cached_prompt = "the river runs to the sea and back again and again " * 6
    computed_prompt = "our river runs to the sea and back again and again " * 6
    try:
        engine.generate([cached_prompt], sampling=greedy(1))  # computes the prompt: now in the prefix cache
        cached, computed = engine.generate([cached_prompt, computed_prompt], sampling=greedy(1))
    finally:
        engine.close()
    assert cached.num_cached_tokens > 0, "precondition: the repeated prompt was found in the prefix cache"
    assert computed.num_cached_tokens == 0, "precondition: the other prompt was computed"
    assert cached.device_s < computed.device_s, (
        f"a prompt served from the prefix cache is charged less of the shared step than one computed in it: "
        f"cached {cached.device_s}, computed {computed.device_s}"
    )


def test_the_meter_charges_load_time_to_the_adapter_that_needed_it():
    meter = StepMeter(FakeClock())
    meter.loaded("a1", 0.25)
    meter.loaded("a1", 0.5)
    assert meter.take_loads() == {"a1": 0.75}, "each load of an adapter adds to its load seconds"
    assert meter.take_loads() == {}, "taking the loads clears them"


def test_an_engine_charges_adapter_loads_and_slot_time_to_their_adapters(make_engine):
    engine = make_engine(max_loras=1, max_num_seqs=1)
    try:
        engine.meter.take_loads()
        engine.meter.take_residency()
        for adapter_id in ("a3", "a4", "a3"):
            engine.generate(["the river"], adapter_ids=[adapter_id], sampling=greedy(4))
        loads, residency = engine.meter.take_loads(), engine.meter.take_residency()
    finally:
        engine.close()
    assert set(loads) == {"a3", "a4"}, "each adapter placed into the one slot is charged its loads"
    assert all(s > 0 for s in loads.values()), "a load takes measurable time"
    assert set(residency) == {"a3", "a4"}, "slot-seconds go to the adapters that held the slot"
    assert all(s > 0 for s in residency.values()), "each held it for some time"

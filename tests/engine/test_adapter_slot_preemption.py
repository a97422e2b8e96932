"""Urgency and adapters: fetches wait for a loader worker most urgent first (prefetches last), and a
strictly more urgent request takes an adapter slot from less urgent ones (an idle slot they want is
evicted, or their running sequences are preempted by recompute) with every output unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from lora_cluster.engine import Engine, RequestOutput, SamplingParams
from lora_cluster.engine.adapters.fetch_queue import PREFETCH, FetchQueue
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.scheduler import Gate, Scheduler
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.errors import EngineOverloadedError
from lora_cluster.replica_policy.slot_urgency import SlotHolder, busy_victim, idle_victim

LOW, URGENT = 5, 0
MAX_STEPS = 2000  # bound of every stepping loop here


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, seed=seed, top_p=0.9, ignore_eos=True)


# low-priority requests holding both adapter slots with long outputs (a0 and a1, two each)
LOWS = (
    ("low-0", "the cat sat on the mat and looked at the river", "a0", greedy(40)),
    ("low-1", "once upon a time there was a small village", "a0", seeded(40, 11)),
    ("low-2", "the quick brown fox jumps over the lazy dog", "a1", greedy(40)),
    ("low-3", "a long road winds through the hills past farms", "a1", seeded(40, 12)),
)


# ----- rule 1: the fetch queue ------------------------------------------------------------------


def blocking_loader() -> tuple[threading.Event, threading.Event, list[str], Callable[[str], str]]:
    """A fetch function that records what ran; the fetch "busy" holds its worker until `gate` is set
    (`started` says it got there)."""
    gate, started, ran = threading.Event(), threading.Event(), []

    def load(key: str) -> str:
        if key == "busy":
            started.set()
            gate.wait(10)
        ran.append(key)
        return key

    return gate, started, ran, load


def test_fetches_run_most_urgent_first_then_in_submission_order_prefetches_last():
    queue = FetchQueue(1, max_prefetches=4)
    gate, started, ran, load = blocking_loader()

    try:
        busy = queue.submit(load, "busy", 0)  # holds the only worker while the others queue
        assert started.wait(10), "precondition: the worker runs the first fetch"
        futures: dict[str, Future] = {"busy": busy}
        for key, priority in (("placement", PREFETCH), ("low-a", LOW), ("urgent", URGENT), ("low-b", LOW),
                              ("later-urgent", LOW)):
            futures[key] = queue.submit(load, key, priority)
        queue.raise_priority(futures["later-urgent"], URGENT)  # a more urgent request wants it now
        queue.raise_priority(futures["low-a"], PREFETCH)  # never moves down
        expected = ["urgent", "later-urgent", "low-a", "low-b", "placement"]
        assert queue.queued() == expected, "queued by most urgent request, then submission, prefetch last"
        gate.set()
        for key, future in futures.items():
            assert future.result(10) == key, f"fetch {key} delivered its result"
        assert ran == ["busy", *expected], "workers took the fetches in that order"
    finally:
        gate.set()
        queue.close()


def test_prefetches_are_bounded_and_a_cancelled_fetch_never_runs():
    queue = FetchQueue(1, max_prefetches=1)
    gate, started, ran, load = blocking_loader()

    try:
        queue.submit(load, "busy", 0)
        assert started.wait(10), "precondition: the worker runs the first fetch"
        queue.submit(load, "p1", PREFETCH)
        with pytest.raises(EngineOverloadedError, match="p2"):
            queue.submit(load, "p2", PREFETCH)
        dropped = queue.submit(load, "dropped", URGENT)
        assert queue.cancel(dropped), "a queued fetch can be cancelled"
        last = queue.submit(load, "last", LOW)
        gate.set()
        assert last.result(10) == "last", "the queue goes on after a cancellation"
        assert "dropped" not in ran, "a cancelled fetch never runs"
    finally:
        gate.set()
        queue.close()


# ----- rule 2: the policy and the scheduler, without a model ---------------------------------------


def test_only_adapters_all_of_whose_requests_are_strictly_less_urgent_are_taken():
    holders = [SlotHolder("peer", running=0, most_urgent=2), SlotHolder("low", running=0, most_urgent=5),
               SlotHolder("lower", running=0, most_urgent=7), SlotHolder("busy", running=1, most_urgent=9)]
    assert idle_victim(holders, 2) == "lower", "the least urgent idle adapter goes first"
    assert idle_victim(holders, 7) is None, "an equal or more urgent request wanting it protects it"
    busy = [SlotHolder("b3", running=3, most_urgent=5), SlotHolder("b1", running=1, most_urgent=5),
            SlotHolder("mixed", running=1, most_urgent=0), SlotHolder("idle", running=0, most_urgent=9)]
    assert busy_victim(busy, 0) == "b1", "the busy slot with the fewest running sequences, never 'mixed'"
    assert busy_victim(busy, 5) is None, "equal priorities never preempt each other"


def _seq(rid: str, adapter_id: str, priority: int) -> Sequence:
    return Sequence(rid, adapter_id, [1, 2, 3], SamplingParams(), IncrementalDetokenizer(None), None,
                    priority=priority)


def test_scheduler_preempts_the_named_slots_sequences_and_asks_the_gate_again():
    slots: dict[str, int] = {"a0": 0, "a1": 1}
    freed: list[int] = []

    def acquire(seq: Sequence, may_claim: bool) -> Gate:
        if seq.adapter_id in slots and slots[seq.adapter_id] not in freed:
            seq.lora_slot = slots[seq.adapter_id]
            return Gate.READY
        if may_claim and freed:
            seq.lora_slot = freed.pop()
            return Gate.READY
        return Gate.BLOCKED

    def release(seq: Sequence) -> None:
        if seq.lora_slot in slots.values() and not any(
                r.lora_slot == seq.lora_slot for r in s.running if r is not seq):
            freed.append(seq.lora_slot)
        seq.lora_slot = -1

    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_waiting=8, acquire=acquire, release=release,
                  slot_to_preempt=lambda priority: 1 if priority < LOW else None)
    lows = [_seq(f"l{i}", f"a{i % 2}", LOW) for i in range(4)]
    for seq in lows:
        s.add(seq)
    s.schedule()
    peer = _seq("peer", "a2", LOW)
    s.add(peer)
    assert not s.schedule().preempted, "an equal priority request preempts nobody"
    urgent = _seq("u", "a2", URGENT)
    s.add(urgent)
    out = s.schedule()
    assert sorted(q.request_id for q in out.preempted) == ["l1", "l3"], "slot 1's running sequences go"
    assert urgent in s.running and urgent.lora_slot == 1, "the urgent sequence runs in the freed slot"
    assert s.num_adapter_preemptions == 2, "both count as adapter-slot preemptions"
    assert all(q.num_computed == 0 and q in s.waiting for q in out.preempted), "they wait to recompute"


# ----- rule 2: adapter-slot preemption in the engine ----------------------------------------------


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    """Two adapter slots, room for five sequences (KV never forces a preemption here), no rotation
    drain within a test (its fairness bound is far away)."""
    e = make_engine(max_loras=2, max_num_seqs=5, breakers=False, adapter_max_wait_s=1e6)
    yield e
    e.close()


def run_to_completion(engine: Engine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished(), "every request finished within the step bound"
    return final


def alone(engine: Engine, requests: tuple, suffix: str) -> dict[str, list[int]]:
    """Token ids of `requests` run by themselves (the reference for 'output unchanged')."""
    for rid, prompt, aid, params in requests:
        engine.add_request(rid + suffix, prompt, aid, params, priority=LOW)
    final = run_to_completion(engine)
    return {rid: final[rid + suffix].token_ids for rid, *_ in requests}


def step_until(engine: Engine, done, what: str) -> int:
    """Step until `done()`; returns the steps taken."""
    for steps in range(1, MAX_STEPS):
        engine.step()
        if done():
            return steps
    raise AssertionError(f"precondition: {what} within {MAX_STEPS} steps")


def assert_nothing_leaks(engine: Engine) -> None:
    engine.step()  # lets go of fetches nobody waits for
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0, "no request left in the queues"
    assert engine.scheduler.num_free_slots == engine.config.max_num_seqs, "every KV slot is free"
    blocks = engine.scheduler.kv_blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "every KV block is free"
    assert all(engine.pool.refs(a) == 0 for a in engine.pool.resident()), "no adapter slot is referenced"
    assert engine.pool.num_free == engine.pool.num_slots, "every adapter slot is free or idle"
    assert stats.held_fetches == 0, "no adapter fetch is held"


def test_urgent_request_takes_a_slot_from_less_urgent_running_ones_outputs_unchanged(engine):
    reference = alone(engine, LOWS, "-alone")
    before = engine.stats()
    taken_before = engine.counters_snapshot()["slots_taken"]
    for rid, prompt, aid, params in LOWS:
        engine.add_request(rid, prompt, aid, params, priority=LOW)
    step_until(engine, lambda: engine.stats().num_running == len(LOWS), "every low request runs")
    assert set(engine.stats().resident_adapters) == {"a0", "a1"}, "precondition: a0 and a1 hold both slots"

    engine.add_request("urgent", "ring the bell", "a2", greedy(4), priority=URGENT)
    engine.adapters.fetch("a2", URGENT).result(30)  # its host fetch is done: count steps from here
    first_token_at: int | None = None
    final: dict[str, RequestOutput] = {}
    for steps in range(1, MAX_STEPS):
        for out in engine.step():
            if out.request_id == "urgent" and out.token_ids and first_token_at is None:
                first_token_at = steps
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert first_token_at is not None and first_token_at <= 3, (
        f"the urgent request got its first token {first_token_at} steps after its fetch, not after 40")
    stats = engine.stats()
    preempted = {rid for rid, *_ in LOWS if final[rid].num_preemptions}
    assert preempted == {"low-0", "low-1"}, "one adapter.s running requests (a0: ties by id) were preempted"
    assert stats.num_adapter_preemptions - before.num_adapter_preemptions == 2, "both count as adapter-slot"
    assert stats.num_preemptions - before.num_preemptions == 2, "and as preemptions"
    assert engine.counters_snapshot()["slots_taken"] > taken_before, "a0's idle slot was taken for a2"
    assert final["urgent"].num_preemptions == 0, "the urgent request itself was never preempted"
    for rid, *_ in LOWS:
        assert final[rid].token_ids == reference[rid], f"{rid}'s output is unchanged by the preemption"
    assert_nothing_leaks(engine)


def test_idle_slot_wanted_only_by_less_urgent_waiting_requests_is_evicted(make_engine):
    """One KV slot: a1's waiting request has its adapter prefetched into the idle slot; an urgent a2
    request evicts it (and preempts the running a0 request for the KV slot); a1 comes back."""
    e = make_engine(max_loras=2, max_num_seqs=1, breakers=False, adapter_max_wait_s=1e6)
    try:
        reference = alone(e, LOWS[:3:2], "-alone")  # low-0 (a0) and low-2 (a1)
        for rid, prompt, aid, params in LOWS[:3:2]:
            e.add_request(rid, prompt, aid, params, priority=LOW)
        step_until(e, lambda: set(e.stats().resident_adapters) == {"a0", "a1"},
                   "rotation prefetched a1 into the idle slot")
        taken = e.counters_snapshot()["slots_taken"]
        e.add_request("urgent", "ring the bell", "a2", greedy(4), priority=URGENT)
        final = run_to_completion(e)
        assert e.counters_snapshot()["slots_taken"] == taken + 1, "a1's idle slot was taken for a2"
        assert final["urgent"].num_preemptions == 0, "the urgent request ran through"
        for rid, *_ in LOWS[:3:2]:
            assert final[rid].token_ids == reference[rid], f"{rid} finished with its output unchanged"
        assert_nothing_leaks(e)
    finally:
        e.close()


def test_equal_priorities_do_not_take_each_others_slots(engine):
    before = engine.stats()
    for rid, prompt, aid, params in LOWS:
        engine.add_request(rid + "-eq", prompt, aid, params, priority=LOW)
    step_until(engine, lambda: engine.stats().num_running == len(LOWS), "every low request runs")
    engine.add_request("peer", "ring the bell", "a2", greedy(4), priority=LOW)
    engine.adapters.fetch("a2", LOW).result(30)
    got_token = False
    for _ in range(10):
        got_token = got_token or any(o.request_id == "peer" and o.token_ids for o in engine.step())
    stats = engine.stats()
    assert not got_token, "a request of equal priority waits for a slot (rotation's job, by draining)"
    assert stats.num_adapter_preemptions == before.num_adapter_preemptions, "no adapter-slot preemption"
    assert stats.num_preemptions == before.num_preemptions, "no preemption at all"
    final = run_to_completion(engine)
    assert final["peer"].finished, "the peer runs once a slot frees up"
    assert_nothing_leaks(engine)


def test_pinned_adapters_are_never_taken(make_engine):
    """a0 (pinned) runs low-priority requests, a1 an urgent one: an urgent a2 request takes neither."""
    e = make_engine(max_loras=2, max_num_seqs=5, breakers=False, adapter_max_wait_s=1e6, pinned=["a0"])
    try:
        running = (*LOWS[:2], ("urgent-a1", *LOWS[2][1:]))
        for rid, prompt, aid, params in running:
            e.add_request(rid, prompt, aid, params, priority=URGENT if aid == "a1" else LOW)
        step_until(e, lambda: e.stats().num_running == len(running), "every request runs")
        e.add_request("urgent", "ring the bell", "a2", greedy(4), priority=URGENT)
        e.adapters.fetch("a2", URGENT).result(30)
        got_token = False
        for _ in range(5):
            got_token = got_token or any(o.request_id == "urgent" and o.token_ids for o in e.step())
        assert not got_token, "the urgent a2 request waits: no slot may be taken"
        assert e.stats().num_adapter_preemptions == 0, "no running request of a pinned adapter is preempted"
        assert set(e.stats().resident_adapters) == {"a0", "a1"}, "the pinned adapter keeps its slot"
        final = run_to_completion(e)
        assert final["urgent"].finished, "the urgent request runs once a1's slot frees up"
        assert_nothing_leaks(e)
    finally:
        e.close()

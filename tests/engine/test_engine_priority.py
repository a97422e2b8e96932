"""Request priorities: admission in (priority, arrival) order, recompute preemption that leaves every
output unchanged, no slot leaks, and the counters a cluster controller reads."""

from __future__ import annotations

import pytest

from lora_cluster.engine import AsyncEngine, Engine, RequestOutput, SamplingParams
from lora_cluster.errors import RequestError

LOW, URGENT = 5, 0
ADAPTERS = ("a0", "a1", "a2")
PROMPTS = (
    "the cat sat on the mat and looked at the quiet river for a long while",
    "once upon a time there was a small village by the sea where fishermen lived",
    "the quick brown fox jumps over the lazy dog near the old barn at dusk",
    "a long road winds through the hills past farms and forests toward the distant city",
    "in the morning the market fills with voices, bread, fruit and the smell of coffee",
)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int, seed: int, **cut: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, seed=seed, ignore_eos=True, **cut)


# (request id, prompt, adapter, sampling): low-priority requests that run long enough to be preempted
LOWS = (
    ("low-0", PROMPTS[0], "a0", greedy(24)),
    ("low-1", PROMPTS[1], "a1", seeded(24, 11, top_p=0.9)),
    ("low-2", PROMPTS[2], None, seeded(24, 12, top_k=20)),
    ("low-3", PROMPTS[3], "a2", greedy(24)),
    ("low-4", PROMPTS[4], "a1", seeded(24, 13)),
)
# waves of urgent requests, each arriving while three low-priority requests decode
WAVES = (
    (("urgent-0", "stop the press", "a2", greedy(4)), ("urgent-1", "ring the bell", None, seeded(4, 21)),
     ("urgent-2", "open the door", "a0", seeded(4, 22, top_k=30, top_p=0.8))),
    (("urgent-3", "call the doctor", "a1", greedy(4)), ("urgent-4", "wake up now", "a2", seeded(4, 23))),
    (("urgent-5", "the house is on fire", None, greedy(4)),),
)


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    """Three KV slots and a 16-token step budget: every prompt here is prefilled in chunks."""
    return make_engine(max_loras=4, max_num_seqs=3, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def single(make_engine) -> Engine:
    """One KV slot: requests run one at a time, in the order the engine admits them."""
    return make_engine(max_loras=2, max_num_seqs=1, max_num_batched_tokens=16)


@pytest.fixture
def fresh_single(make_engine) -> Engine:
    """One KV slot, for a test whose AsyncEngine closes the engine when it shuts down."""
    return make_engine(adapter_source=None, max_num_seqs=1, max_num_batched_tokens=16)


def run_to_completion(engine: Engine) -> tuple[list[str], dict[str, RequestOutput]]:
    """Step until nothing is left; (request ids in the order of their first token, final outputs)."""
    first: list[str] = []
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first.append(out.request_id)
            if out.finished:
                final[out.request_id] = out
    return first, final


def run_with_urgent_waves(engine: Engine) -> dict[str, RequestOutput]:
    """Queue LOWS; add each wave of WAVES once three low-priority requests have decoded together for
    two steps in a row. Returns every request's final output."""
    for rid, prompt, aid, params in LOWS:
        engine.add_request(rid, prompt, aid, params, priority=LOW)
    lows = {rid for rid, *_ in LOWS}
    waves = list(WAVES)
    final: dict[str, RequestOutput] = {}
    calm = 0
    while engine.has_unfinished():
        outs = engine.step()
        final.update((o.request_id, o) for o in outs if o.finished)
        decoding = [o for o in outs if o.request_id in lows and o.delta_token_ids and not o.finished]
        calm = calm + 1 if len(decoding) == 3 else 0
        if waves and calm >= 2:
            for rid, prompt, aid, params in waves.pop(0):
                engine.add_request(rid, prompt, aid, params, priority=URGENT)
            calm = 0
    assert not waves, "precondition: every urgent wave arrived while low-priority requests were decoding"
    return final


def test_waiting_requests_are_admitted_by_priority_then_arrival(single: Engine):
    for rid, priority in (("p2", 2), ("p0", 0), ("p1", 1), ("p0-later", 0)):
        single.add_request(rid, "hello there", sampling=greedy(3), priority=priority)
    first, final = run_to_completion(single)
    assert first == ["p0", "p0-later", "p1", "p2"], (
        "with one slot, queued requests run most urgent first, and in arrival order within a priority"
    )
    assert all(out.num_preemptions == 0 for out in final.values()), (
        "requests that were all queued before the first step need no preemption"
    )


def test_preempted_requests_produce_exactly_their_unpreempted_tokens(engine: Engine):
    requests = [*LOWS, *(r for wave in WAVES for r in wave)]
    alone = {
        rid: engine.generate([prompt], adapter_ids=[aid], sampling=params)[0]
        for rid, prompt, aid, params in requests
    }
    before = engine.stats().num_preemptions

    final = run_with_urgent_waves(engine)

    preemptions = {rid: final[rid].num_preemptions for rid, *_ in LOWS}
    assert sum(preemptions.values()) == sum(len(wave) for wave in WAVES), (
        "each urgent request, arriving while low-priority requests held every KV slot, preempted one"
    )
    assert max(preemptions.values()) >= 2, "precondition: some request was preempted more than once"
    assert all(final[rid].num_preemptions == 0 for rid, *_ in requests if rid.startswith("urgent")), (
        "urgent requests are never preempted by low-priority ones"
    )
    for rid, *_ in requests:
        assert final[rid].token_ids == alone[rid].token_ids, (
            f"{rid}: a request's tokens (greedy or seeded) are the same with preemptions as alone"
        )
        assert final[rid].text == alone[rid].text, f"{rid}: so is its text (the detokenizer state is kept)"
    stats = engine.stats()
    assert stats.num_preemptions - before == sum(preemptions.values()), (
        "the engine counts every preemption of its requests"
    )
    assert stats.free_seq_slots == 3, "every KV slot is free once all requests finished"
    assert stats.running_by_priority == {}, "nothing runs once all requests finished"
    assert stats.waiting_by_priority == {}, "nothing waits once all requests finished"
    for aid in ADAPTERS:
        assert engine.pool.refs(aid) == 0, f"no reference on adapter {aid} is left after preemptions"


def test_a_request_is_never_preempted_for_an_equally_or_less_urgent_one(single: Engine):
    single.add_request("running", "hello there", sampling=greedy(6), priority=2)
    while not single.stats().running_by_priority:
        single.step()
    single.add_request("equal", "hello there", sampling=greedy(3), priority=2)
    single.add_request("lower", "hello there", sampling=greedy(3), priority=7)
    stats = single.stats()
    assert stats.running_by_priority == {2: 1}, "the first request runs"
    assert stats.waiting_by_priority == {2: 1, 7: 1}, "the stats count waiting requests per priority"
    before = stats.num_preemptions
    first, final = run_to_completion(single)
    assert final["running"].num_preemptions == 0, (
        "a running request is preempted neither by an equally urgent nor by a less urgent one"
    )
    assert single.stats().num_preemptions == before, "no preemption happened"
    assert first == ["running", "equal", "lower"], "the queued requests run after it, most urgent first"


def test_generate_passes_priorities_to_the_scheduler(single: Engine, monkeypatch: pytest.MonkeyPatch):
    first: list[str] = []
    step = single.step

    def recording_step() -> list[RequestOutput]:
        outs = step()
        first.extend(o.request_id for o in outs if o.token_ids and o.request_id not in first)
        return outs

    monkeypatch.setattr(single, "step", recording_step)
    outs = single.generate(["hello there"] * 3, sampling=greedy(3), priorities=[2, 0, 1])
    assert first == [outs[1].request_id, outs[2].request_id, outs[0].request_id], (
        "generate's priorities order admission: priority 0 first, then 1, then 2"
    )
    assert [len(o.token_ids) for o in outs] == [3, 3, 3], "outputs come back in prompt order, complete"


async def test_async_generate_passes_priority_and_preempts(fresh_single: Engine):
    aengine = AsyncEngine(fresh_single)
    try:
        background = aengine.generate("hello there", sampling=greedy(10_000), priority=LOW)
        first = await anext(background)
        assert first.num_preemptions == 0, "precondition: the low-priority request runs, not preempted yet"
        urgent = [out async for out in aengine.generate("ring the bell", sampling=greedy(4), priority=1)]
        assert urgent[-1].finished, "the urgent request finishes while the low-priority one is unfinished"
        preempted = None
        async for out in background:
            if out.num_preemptions:
                preempted = out
                break
        assert preempted is not None, "the urgent request preempted the running low-priority one"
        assert not preempted.finished, "a preempted request resumes and streams on"
        await background.aclose()
        stats = await aengine.call(lambda e: e.stats())
        assert stats.free_seq_slots == 1, "the KV slot is free once both requests are done"
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("priority", ["1", 1.5, True, None])
def test_bad_priorities_are_request_errors(single: Engine, priority: object):
    with pytest.raises(RequestError, match="priority must be an integer"):
        single.add_request("bad", "hello there", priority=priority)
    with pytest.raises(RequestError, match="priority must be an integer"):
        single.generate(["hello there", "hi"], priorities=[0, priority])
    assert not single.has_unfinished(), "a refused priority queues nothing"


def test_priorities_must_match_the_prompts(single: Engine):
    with pytest.raises(RequestError, match="2 prompts but 1 priorities"):
        single.generate(["hello there", "hi"], priorities=[0])


async def test_async_bad_priority_is_a_request_error(fresh_single: Engine):
    aengine = AsyncEngine(fresh_single)
    try:
        with pytest.raises(RequestError, match="priority must be an integer"):
            async for _ in aengine.generate("hello there", priority="high"):
                pass
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("patience", [-0.5, float("inf"), float("nan")])
def test_a_bad_patience_is_a_request_error(single: Engine, patience: float):
    with pytest.raises(RequestError, match="preempt_after_s must be a finite number of seconds >= 0"):
        single.add_request("bad", "hello there", priority=0, preempt_after_s=patience)
    assert not single.has_unfinished(), "a refused patience queues nothing"

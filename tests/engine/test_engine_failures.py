"""A failing engine step ends its requests with an error and the replica reports itself unhealthy;
a stopped engine loop answers its callers with an error instead of leaving them waiting.

Regression tests: before the fix, a step that failed outside the forward pass (sampling on NaN
logits, detokenization, scheduling) was logged and retried forever while `generate` waited, and
`AsyncEngine.call` hung once the loop thread was gone.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from helpers import greedy

from lora_cluster.engine import AsyncEngine, Engine, SamplingParams
from lora_cluster.errors import EngineStepError, EngineUnavailableError

BOUND_S = 20.0  # a hang fails the test after this long instead of blocking the suite
GREEDY = greedy(4)
SAMPLED = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, ignore_eos=True)


@pytest.fixture
def engine(make_engine) -> Iterator[Engine]:
    engine = make_engine(max_loras=2, max_num_seqs=4, max_consecutive_step_failures=3)
    yield engine
    engine.close()


async def _run(aengine: AsyncEngine, prompt: str, sampling: SamplingParams) -> list[int]:
    async def consume() -> list[int]:
        tokens: list[int] = []
        async for out in aengine.generate(prompt, "a1", sampling):
            tokens = out.token_ids
        return tokens

    return await asyncio.wait_for(consume(), BOUND_S)


def _inject(kind: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """Make the next steps fail at `kind`; returns sampling parameters that reach that stage."""
    if kind == "forward":
        def broken_forward(batch):
            raise RuntimeError("device error")

        monkeypatch.setattr(engine.runner, "forward", broken_forward)
        return GREEDY
    if kind == "sampling":
        real_forward = engine.runner.forward
        monkeypatch.setattr(engine.runner, "forward", lambda batch: real_forward(batch) * float("nan"))
        return SAMPLED  # torch.multinomial refuses NaN probabilities
    if kind == "detokenization":
        def broken_decode(*args, **kwargs):
            raise ValueError("tokenizer broke")

        monkeypatch.setattr(engine.tokenizer, "decode", broken_decode)
        return GREEDY
    if kind == "scheduling":
        def broken_schedule():
            raise RuntimeError("scheduler broke")

        monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
        return GREEDY
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["forward", "sampling", "detokenization", "scheduling"])
async def test_a_failed_step_ends_its_requests_with_an_error(engine, monkeypatch, kind):
    aengine = AsyncEngine(engine)
    try:
        with monkeypatch.context() as patch:
            sampling = _inject(kind, engine, patch)
            with pytest.raises(EngineStepError, match=r"engine \w+ failed"):
                await _run(aengine, "the river", sampling)
        tokens = await _run(aengine, "the river", GREEDY)
        assert len(tokens) == 4, f"after a {kind} failure the engine serves the next request"
        aengine.check_health()  # a clean step resets the failure count
    finally:
        aengine.shutdown()


async def test_repeated_step_failures_make_the_engine_unhealthy(engine, monkeypatch):
    aengine = AsyncEngine(engine)
    try:
        _inject("sampling", engine, monkeypatch)
        for _ in range(3):
            with pytest.raises(EngineStepError):
                await _run(aengine, "the river", SAMPLED)
        with pytest.raises(EngineUnavailableError, match="max_consecutive_step_failures=3"):
            aengine.check_health()
    finally:
        aengine.shutdown()


async def test_callers_of_a_stopped_loop_get_an_error(engine):
    aengine = AsyncEngine(engine)
    aengine.shutdown()
    with pytest.raises(EngineUnavailableError):
        await asyncio.wait_for(aengine.call(lambda e: e.stats()), BOUND_S)
    with pytest.raises(EngineUnavailableError):
        await _run(aengine, "the river", GREEDY)
    with pytest.raises(EngineUnavailableError):
        aengine.check_health()


async def test_a_loop_that_dies_fails_its_waiting_callers(engine, monkeypatch):
    aengine = AsyncEngine(engine)
    try:
        def fatal_step():
            raise SystemExit("the loop thread dies")

        monkeypatch.setattr(engine, "step", fatal_step)
        with pytest.raises(EngineUnavailableError):
            await _run(aengine, "the river", GREEDY)
        with pytest.raises(EngineUnavailableError):
            await asyncio.wait_for(aengine.call(lambda e: e.stats()), BOUND_S)
        with pytest.raises(EngineUnavailableError):
            aengine.check_health()
    finally:
        aengine.shutdown()


async def test_shutdown_stops_the_loop_before_closing_the_engine(engine, monkeypatch):
    aengine = AsyncEngine(engine)
    in_step, release = threading.Event(), threading.Event()
    real_forward = engine.runner.forward
    closed: list[bool] = []

    def slow_forward(batch):
        in_step.set()
        release.wait(BOUND_S)
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", slow_forward)
    monkeypatch.setattr(engine, "close", lambda: closed.append(True))
    request = asyncio.create_task(_run(aengine, "the river", GREEDY))
    assert await asyncio.to_thread(in_step.wait, BOUND_S), "the step started"
    await asyncio.to_thread(aengine.shutdown, 0.2)
    assert not closed, "the engine is not closed while its loop is inside a step"
    with pytest.raises(EngineUnavailableError):
        await request
    with pytest.raises(EngineUnavailableError):
        await asyncio.wait_for(aengine.call(lambda e: e.stats()), BOUND_S)
    release.set()

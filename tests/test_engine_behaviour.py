"""Engine behaviour: slot reuse, sampling, stop conditions, cancellation, async streaming."""

from __future__ import annotations

import asyncio

import pytest

from lora_cluster.engine import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_model_dir, demo_adapters_dir) -> Engine:
    return Engine(
        model=str(demo_model_dir), adapter_source=str(demo_adapters_dir), max_loras=3, max_num_seqs=6
    )


def test_more_adapters_than_slots_complete(engine: Engine):
    adapters = [f"a{i}" for i in range(12)] + [None]
    outs = engine.generate(["the cat sat"] * len(adapters), adapter_ids=adapters, sampling=GREEDY)
    assert [len(o.token_ids) for o in outs] == [12] * len(adapters)
    # the same adapter alone gives the same tokens as inside the crowded batch
    alone = engine.generate(["the cat sat"], adapter_ids=["a7"], sampling=GREEDY)[0]
    assert alone.token_ids == outs[7].token_ids
    assert engine.stats().num_running == 0 and engine.stats().free_seq_slots == 6


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: Engine):
    params = SamplingParams(
        max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = engine.generate(["once upon a time"], adapter_ids=["a1"], sampling=params)[0]
    crowd = engine.generate(
        ["once upon a time", "other", "prompts here"],
        adapter_ids=["a1", "a2", None],
        sampling=[params, SamplingParams(max_new_tokens=5, temperature=1.0), GREEDY],
    )[0]
    assert alone.token_ids == crowd.token_ids
    other_seed = engine.generate(
        ["once upon a time"],
        adapter_ids=["a1"],
        sampling=SamplingParams(max_new_tokens=16, temperature=0.9, seed=99, ignore_eos=True),
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(engine: Engine):
    greedy = engine.generate(["hello there"], sampling=GREEDY)[0]
    top1 = engine.generate(
        ["hello there"], sampling=SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)
    )[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_string_and_stop_token(engine: Engine):
    full = engine.generate(["the river"], adapter_ids=["a3"], sampling=GREEDY)[0]
    stop = full.text[3:6]
    assert stop.strip(), "need a visible stop string"
    cut = engine.generate(
        ["the river"],
        adapter_ids=["a3"],
        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    token = full.token_ids[4]
    by_id = engine.generate(
        ["the river"],
        adapter_ids=["a3"],
        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
    )[0]
    first = full.token_ids.index(token)
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: first + 1]


def test_eos_finishes(engine: Engine):
    eos = engine.tokenizer.eos_token_id
    engine.add_request(
        "eos", "hi", None, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    )
    seq = engine._seqs["eos"]
    engine.step()  # prefill
    seq.sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine._append(seq, eos)
    assert seq.finish_reason.value == "eos" and not engine.has_unfinished()


def test_abort_frees_slot(engine: Engine):
    engine.add_request(
        "x", "a long prompt to cancel", "a4", SamplingParams(max_new_tokens=50, temperature=0.0)
    )
    for _ in range(100):  # the adapter loads off the step loop; the request waits meanwhile
        engine.step()
        if engine.stats().num_running:
            break
    assert engine.stats().num_running == 1 and engine.pool.refs("a4") == 1
    out = engine.abort("x")
    assert out.finished and out.finish_reason == "abort"
    assert engine.stats().num_running == 0 and engine.stats().free_seq_slots == 6
    assert engine.pool.refs("a4") == 0


async def test_async_stream_and_cancel(engine: Engine):
    aengine = AsyncEngine(engine)
    try:
        expected = engine_text = None
        deltas = []
        async for out in aengine.generate("the quick brown fox", "a5", GREEDY):
            deltas.append(out.delta_text)
            expected, engine_text = out.token_ids, out.text
        assert "".join(deltas) == engine_text and len(expected) == 12

        stream = aengine.generate(
            "cancel me please", "a6", SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        )
        async for _ in stream:
            break  # a client that goes away
        await stream.aclose()
        for _ in range(100):
            if aengine.stats.num_running == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_unfinished()
        assert await aengine.call(lambda e: e.stats().free_seq_slots) == 6

        with pytest.raises(Exception, match="'nope'"):
            async for _ in aengine.generate("hi", "nope", GREEDY):
                pass
    finally:
        aengine.shutdown()


def test_hub_id_resolves_from_local_cache_offline(demo_model_dir, monkeypatch, tmp_path):
    """No hub is reachable here: a hub id is served from huggingface_hub's local cache."""
    import shutil

    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "models--demo-org--tiny-llama"
    shutil.copytree(demo_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    engine = Engine(model="demo-org/tiny-llama")
    local = Engine(model=str(demo_model_dir))
    prompt = ["the quick brown fox"]
    assert (
        engine.generate(prompt, sampling=GREEDY)[0].token_ids
        == local.generate(prompt, sampling=GREEDY)[0].token_ids
    )

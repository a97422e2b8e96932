"""Engine behaviour: slot reuse, sampling, stop conditions, cancellation, async streaming."""

from __future__ import annotations

import asyncio

import pytest
from helpers import greedy

from lora_cluster.engine import AsyncEngine, Engine, SamplingParams, build_engine

GREEDY = greedy(12)


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine(max_loras=3, max_num_seqs=6)


def test_more_adapters_than_slots_complete(engine: Engine):
    adapters = [f"a{i}" for i in range(12)] + [None]
    outs = engine.generate(["the cat sat"] * len(adapters), adapter_ids=adapters, sampling=GREEDY)
    assert [len(o.token_ids) for o in outs] == [12] * len(adapters), (
        "every request completes its 12 tokens although there are more adapters than adapter slots"
    )
    alone = engine.generate(["the cat sat"], adapter_ids=["a7"], sampling=GREEDY)[0]
    assert alone.token_ids == outs[7].token_ids, (
        "an adapter run alone gives the same greedy tokens as inside the crowded batch"
    )
    stats = engine.stats()
    assert stats.num_running == 0, "nothing is left running once generate returns"
    assert stats.free_seq_slots == 6, "every sequence slot is free again once generate returns"


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
    assert alone.token_ids == crowd.token_ids, (
        "a seeded request samples the same tokens alone and in a batch with other requests"
    )
    other_seed = engine.generate(
        ["once upon a time"],
        adapter_ids=["a1"],
        sampling=SamplingParams(max_new_tokens=16, temperature=0.9, seed=99, ignore_eos=True),
    )[0]
    assert other_seed.token_ids != alone.token_ids, "another seed samples other tokens"


def test_top_k_one_is_greedy(engine: Engine):
    greedy = engine.generate(["hello there"], sampling=GREEDY)[0]
    top1 = engine.generate(
        ["hello there"], sampling=SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, ignore_eos=True)
    )[0]
    assert top1.token_ids == greedy.token_ids, "top_k=1 picks the argmax whatever the temperature"


def test_stop_string_and_stop_token(engine: Engine):
    full = engine.generate(["the river"], adapter_ids=["a3"], sampling=GREEDY)[0]
    stop = full.text[3:6]
    assert stop.strip(), "precondition: the greedy text holds a visible stop string"
    cut = engine.generate(
        ["the river"],
        adapter_ids=["a3"],
        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    assert cut.finish_reason == "stop", "a stop string ends the request with finish reason 'stop'"
    assert stop not in cut.text, "the stop string is not part of the returned text"
    assert full.text.startswith(cut.text), "the text before the stop string is what greedy decoding gives"
    token = full.token_ids[4]
    by_id = engine.generate(
        ["the river"],
        adapter_ids=["a3"],
        sampling=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
    )[0]
    first = full.token_ids.index(token)
    assert by_id.finish_reason == "stop", "a stop token ends the request with finish reason 'stop'"
    assert by_id.token_ids == full.token_ids[: first + 1], (
        "the output ends at the first occurrence of the stop token, which is kept in the ids"
    )


def test_eos_token_finishes_unless_ignored(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    ignoring = greedy(8)
    full = engine.generate(["hi"], sampling=ignoring)[0].token_ids
    eos = full[2]
    assert eos not in full[:2], "precondition: the 3rd greedy token is not one of the first two"
    monkeypatch.setattr(engine, "eos_token_ids", {eos})

    out = engine.generate(["hi"], sampling=SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert out.finish_reason == "eos", "generating an end-of-sequence token ends the request with 'eos'"
    assert out.token_ids == full[:3], "the output stops at the end-of-sequence token, which is kept"
    assert not engine.has_unfinished(), "a request ended by eos leaves nothing unfinished"

    ignored = engine.generate(["hi"], sampling=ignoring)[0]
    assert ignored.finish_reason == "length", "with ignore_eos an eos token does not end the request"
    assert ignored.token_ids == full, "with ignore_eos the request runs on to max_new_tokens"


def test_abort_frees_slot(engine: Engine):
    engine.add_request(
        "x", "a long prompt to cancel", "a4", SamplingParams(max_new_tokens=50, temperature=0.0)
    )
    for _ in range(100):  # the adapter loads off the step loop; the request waits meanwhile
        engine.step()
        if engine.stats().num_running:
            break
    assert engine.stats().num_running == 1, "precondition: the request is running"
    assert engine.pool.refs("a4") == 1, "a running request holds a reference to its adapter"
    out = engine.abort("x")
    assert out is not None, "aborting a known request returns its final output"
    assert out.finished, "the output of an aborted request is final"
    assert out.finish_reason == "abort", "an aborted request ends with finish reason 'abort'"
    stats = engine.stats()
    assert stats.num_running == 0, "an aborted request stops running at once"
    assert stats.free_seq_slots == 6, "an aborted request frees its sequence slot at once"
    assert engine.pool.refs("a4") == 0, "an aborted request releases its adapter reference"


async def test_async_stream_and_cancel(engine: Engine):
    aengine = AsyncEngine(engine)
    try:
        expected = engine_text = None
        deltas = []
        async for out in aengine.generate("the quick brown fox", "a5", GREEDY):
            deltas.append(out.delta_text)
            expected, engine_text = out.token_ids, out.text
        assert "".join(deltas) == engine_text, "the streamed deltas add up to the final text"
        assert len(expected) == 12, "the stream runs to max_new_tokens"

        stream = aengine.generate(
            "cancel me please", "a6", greedy(200)
        )
        async for _ in stream:
            break  # a client that goes away
        await stream.aclose()
        for _ in range(100):
            if aengine.stats.num_running == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_unfinished(), "a stream closed by its client cancels its request"
        assert await aengine.call(lambda e: e.stats().free_seq_slots) == 6, (
            "a cancelled stream frees its sequence slot"
        )

        with pytest.raises(Exception, match="'nope'"):
            async for _ in aengine.generate("hi", "nope", GREEDY):
                pass
    finally:
        aengine.shutdown()


def test_hub_id_resolves_from_local_cache_offline(make_engine, demo_model_dir, monkeypatch, tmp_path):
    """No hub is reachable here: a hub id is served from huggingface_hub's local cache."""
    import shutil

    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "models--demo-org--tiny-llama"
    shutil.copytree(demo_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    engine = build_engine(model="demo-org/tiny-llama")
    local = make_engine(adapter_source=None)
    prompt = ["the quick brown fox"]
    assert (
        engine.generate(prompt, sampling=GREEDY)[0].token_ids
        == local.generate(prompt, sampling=GREEDY)[0].token_ids
    ), "a hub id served from the local cache runs the same model as its local folder"

"""Parity with Hugging Face PEFT: mixed-adapter continuous batches equal one-adapter-at-a-time PEFT.

The engine runs 9 adapters (ranks 8-32, different target modules, one rslora) and base-only rows
in shared steps, with chunked prefills and requests that join while others decode. For every
request, PEFT (`PeftModel`, one adapter active at a time) is run teacher-forced on the engine's
prompt + output: each engine token must be PEFT's argmax and each step's logits must agree with
PEFT's within 1e-4 (float32).
"""

from __future__ import annotations

from helpers import assert_matches_peft, capture_logits, greedy, run_joining

from lora_cluster.engine import SamplingParams

ADAPTERS = ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7", "a8"]
PROMPTS = [
    "the quick brown fox",
    "a long story begins when the morning light falls over the quiet river and the town",
    "hello",
    "one two three four five six seven",
    "what is the weather like today in the mountains",
    "we",
]
NEW_TOKENS = 32


def test_mixed_batch_with_joins_matches_peft(make_engine, peft_model):
    engine = make_engine(
        max_loras=6,  # fewer slots than adapters: slots are reused as sequences finish
        max_lora_rank=32,
        max_num_seqs=8,
        max_num_batched_tokens=24,  # forces chunked prefills that share steps with decodes
    )
    captured = capture_logits(engine)
    sampling = greedy(NEW_TOKENS)
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], aid) for i, aid in enumerate([*ADAPTERS, None, None])]
    finals = run_joining(engine, requests, sampling, first=5, steps_before=6)

    mixed_steps = 0
    for rid, _prompt, aid in requests:
        out = finals[rid]
        assert out.finish_reason == "length", f"{rid} ({aid}) runs to max_new_tokens with ignore_eos"
        assert_matches_peft(peft_model, aid, out, captured[rid], NEW_TOKENS, 1e-4, f"{rid} ({aid})")
        mixed_steps += len(captured[rid])
    assert mixed_steps == len(requests) * NEW_TOKENS, "every sampled token's logits were compared with PEFT"


def test_adapters_change_outputs(make_engine):
    """Guard against a parity test that passes because LoRA does nothing."""
    engine = make_engine(max_loras=4)
    outs = engine.generate(["the quick brown fox"] * 4, adapter_ids=[None, "a0", "a2", "a7"],
                           sampling=greedy(16))
    assert len({tuple(o.token_ids) for o in outs}) == 4, "the base model and each adapter give other tokens"


def test_readme_offline_example_outputs_follow_prompts_and_adapters(make_engine):
    """The README's offline example: one output per prompt, in order, each decoded from its own ids,
    16 tokens unless it stopped early, the adapter row as if run alone and unlike the base model."""
    engine = make_engine(max_loras=8, max_lora_rank=64)
    prompts, adapters = ["prompt a", "prompt b"], ["a0", None]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    outs = engine.generate(prompts, adapter_ids=adapters, sampling=greedy)

    assert len(outs) == len(prompts), "generate returns one output per prompt"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == engine.tokenize(prompt), f"outputs come in prompt order ({prompt!r})"
        assert out.finished, f"the output for {prompt!r} is final"
        assert out.token_ids, f"{prompt!r} generates at least one token"
        assert out.finish_reason in {"length", "eos", "stop"}, f"{prompt!r} ends for a documented reason"
        assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True), (
            f"the text for {prompt!r} is its token ids decoded"
        )
        if out.finish_reason not in {"eos", "stop"}:
            assert len(out.token_ids) == 16, f"{prompt!r} runs to max_new_tokens unless it stops early"
        else:
            assert len(out.token_ids) <= 16, f"{prompt!r} stops early, within max_new_tokens"

    alone = engine.generate([prompts[0]], adapter_ids=["a0"], sampling=greedy)[0]
    assert outs[0].token_ids == alone.token_ids, "greedy a0 gives the same tokens in the batch as alone"
    assert outs[0].text == alone.text, "greedy a0 gives the same text in the batch as alone"
    base = engine.generate([prompts[0]], adapter_ids=[None], sampling=greedy)[0]
    assert outs[0].token_ids != base.token_ids, "the a0 row is generated with the adapter, not the base model"

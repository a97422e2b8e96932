"""Parity with Hugging Face PEFT: mixed-adapter continuous batches equal one-adapter-at-a-time PEFT.

The engine runs 9 adapters (ranks 8-32, different target modules, one rslora) and base-only rows
in shared steps, with chunked prefills and requests that join while others decode. For every
request, PEFT (`PeftModel`, one adapter active at a time) is run teacher-forced on the engine's
prompt + output: each engine token must be PEFT's argmax and each step's logits must agree with
PEFT's within 1e-4 (float32).
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_cluster.engine import Engine, SamplingParams

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


@pytest.fixture(scope="module")
def peft_model(demo_model_dir, demo_adapters_dir):
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, demo_adapters_dir / ADAPTERS[0], adapter_name=ADAPTERS[0])
    for aid in ADAPTERS[1:]:
        model.load_adapter(demo_adapters_dir / aid, adapter_name=aid)
    return model.eval()


def _peft_logits(model: PeftModel, adapter_id: str | None, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        if adapter_id is None:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0]
        model.set_adapter(adapter_id)
        return model(torch.tensor([ids])).logits[0]


def test_mixed_batch_with_joins_matches_peft(demo_model_dir, demo_adapters_dir, peft_model):
    engine = Engine(
        model=str(demo_model_dir),
        adapter_source=str(demo_adapters_dir),
        max_loras=6,  # fewer slots than adapters: slots are reused as sequences finish
        max_lora_rank=32,
        max_num_seqs=8,
        max_num_batched_tokens=24,  # forces chunked prefills that share steps with decodes
    )
    captured: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def spy(batch):
        logits = forward(batch)
        for seq, row in zip(batch.sampled, logits, strict=True):
            captured.setdefault(seq.request_id, []).append(row.clone())
        return logits

    engine.runner.forward = spy
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], aid) for i, aid in enumerate([*ADAPTERS, None, None])]
    for rid, prompt, aid in requests[:5]:
        engine.add_request(rid, prompt, aid, greedy)
    finals = {}
    for _ in range(6):  # the first requests prefill and start decoding ...
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt, aid in requests[5:]:  # ... then the rest join the running batch
        engine.add_request(rid, prompt, aid, greedy)
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})

    mixed_steps = 0
    for rid, _prompt, aid in requests:
        out = finals[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS
        ref = _peft_logits(peft_model, aid, out.prompt_token_ids + out.token_ids)
        ref = ref[out.prompt_tokens - 1 : out.prompt_tokens - 1 + NEW_TOKENS]
        ours = torch.stack(captured[rid])
        assert ref.argmax(-1).tolist() == out.token_ids, f"{rid} ({aid}) diverges from PEFT"
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        mixed_steps += len(captured[rid])
    assert mixed_steps == len(requests) * NEW_TOKENS


def test_adapters_change_outputs(demo_model_dir, demo_adapters_dir):
    """Guard against a parity test that passes because LoRA does nothing."""
    engine = Engine(model=str(demo_model_dir), adapter_source=str(demo_adapters_dir), max_loras=4)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = engine.generate(["the quick brown fox"] * 4, adapter_ids=[None, "a0", "a2", "a7"], sampling=greedy)
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_issue_example_call(demo_model_dir, demo_adapters_dir):
    engine = Engine(
        model=str(demo_model_dir), adapter_source=str(demo_adapters_dir), max_loras=8, max_lora_rank=64
    )
    outs = engine.generate(
        ["prompt a", "prompt b"],
        adapter_ids=["a0", None],
        sampling=SamplingParams(max_new_tokens=16, temperature=0.0),
    )
    assert all(isinstance(o.text, str) and o.token_ids for o in outs)
    assert {o.finish_reason for o in outs} <= {"length", "eos", "stop"}

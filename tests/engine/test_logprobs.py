"""Log-probabilities from the engine equal PEFT's log-softmax (float32, within 1e-4), with adapters.

Requests of several adapters and the base model share continuous batches with chunked prefills; each
asks for the chosen token's logprob with alternatives, and for prompt logprobs. The oracle is PEFT
(`PeftModel`, one adapter at a time) run on prompt + output: `log_softmax` of its logits at the
position before each token. Sampled requests (temperature, top-k, top-p) report the raw model
distribution too (see `lora_cluster.engine.sample.logprobs`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import peft_logits
from peft import PeftModel

from lora_cluster.engine import SamplingParams
from lora_cluster.errors import RequestError

ADAPTERS = ["a0", "a1", "a2", "a7"]  # ranks 8/16/32, a7 is rsLoRA
PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello", "one two three four five six seven eight"]
K = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(make_engine):
    engine = make_engine(max_loras=4, max_lora_rank=32, max_num_seqs=8,
                         max_num_batched_tokens=16)  # chunked prefills
    yield engine
    engine.close()


def _peft_logprobs(model: PeftModel, adapter_id: str | None, ids: list[int]) -> torch.Tensor:
    """log_softmax of PEFT's logits [len(ids), V]: row j is the distribution of token j + 1."""
    return torch.log_softmax(peft_logits(model, adapter_id, ids).float(), dim=-1)


def _check_token(lp, ref_row: torch.Tensor, k: int, what: str) -> None:
    chosen = ref_row[lp.token_id].item()
    assert abs(lp.logprob - chosen) <= TOL, f"{what}: the chosen token's logprob is PEFT's"
    values, ids = torch.topk(ref_row, k)
    assert [t for t, _ in lp.top] == ids.tolist(), f"{what}: the {k} alternatives are PEFT's likeliest tokens"
    got = torch.tensor([v for _, v in lp.top])
    assert torch.allclose(got, values, atol=TOL, rtol=0), f"{what}: the alternatives' logprobs are PEFT's"


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=K),
    SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=3, ignore_eos=True,
                   logprobs=K, prompt_logprobs=K),
], ids=["greedy", "sampled"])
def test_logprobs_equal_peft_log_softmax(engine, peft_model, sampling):
    requests = [(PROMPTS[i % len(PROMPTS)], aid) for i, aid in enumerate([*ADAPTERS, None])]
    outs = engine.generate([p for p, _ in requests], adapter_ids=[a for _, a in requests], sampling=sampling)
    for (_, aid), out in zip(requests, outs, strict=True):
        ids = out.prompt_token_ids + out.token_ids
        ref = _peft_logprobs(peft_model, aid, ids)
        assert len(out.logprobs) == len(out.token_ids), f"{aid}: one logprob per generated token"
        assert [lp.token_id for lp in out.logprobs] == out.token_ids, f"{aid}: the logprobs follow the tokens"
        for i, lp in enumerate(out.logprobs):
            _check_token(lp, ref[out.prompt_tokens - 1 + i], K, f"{aid} output token {i}")
        assert len(out.prompt_logprobs) == out.prompt_tokens, f"{aid}: one prompt logprob per prompt token"
        assert out.prompt_logprobs[0] is None, f"{aid}: the first prompt token has no logprob"
        for j, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == out.prompt_token_ids[j], f"{aid}: prompt logprob {j} is of prompt token {j}"
            _check_token(lp, ref[j - 1], K, f"{aid} prompt token {j}")


def test_sampled_logprob_is_of_the_raw_distribution_not_the_tempered_one(engine, peft_model):
    sampling = SamplingParams(max_new_tokens=4, temperature=0.5, seed=11, ignore_eos=True, logprobs=0)
    out = engine.generate([PROMPTS[0]], adapter_ids=["a1"], sampling=sampling)[0]
    ref = _peft_logprobs(peft_model, "a1", out.prompt_token_ids + out.token_ids)
    first = out.logprobs[0]
    raw = ref[out.prompt_tokens - 1, first.token_id].item()
    logits = torch.log_softmax(ref[out.prompt_tokens - 1] / 0.5, dim=-1)
    tempered = logits[first.token_id].item()
    assert abs(first.logprob - raw) <= TOL, "the logprob is PEFT's log_softmax of the raw logits"
    assert abs(first.logprob - tempered) > 10 * TOL, "and not of the temperature-scaled logits"
    assert first.top == (), "logprobs=0 gives the chosen token only"


def test_requests_without_logprobs_get_none(engine):
    out = engine.generate([PROMPTS[1]], sampling=SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert out.logprobs is None, "no logprobs unless asked"
    assert out.prompt_logprobs is None, "no prompt logprobs unless asked"


def test_streamed_outputs_carry_each_new_tokens_logprob(engine):
    engine.add_request("stream-1", PROMPTS[0], "a2", SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                  ignore_eos=True, logprobs=2))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.extend(out.delta_logprobs or [])
            final = out if out.finished else final
    assert [lp.token_id for lp in deltas] == final.token_ids, "the deltas' logprobs: one per token, in order"
    assert deltas == final.logprobs, "the deltas add up to the final output's logprobs"


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_are_bounded_by_max_logprobs(engine, field):
    too_many = SamplingParams(max_new_tokens=2, **{field: engine.config.max_logprobs + 1})
    with pytest.raises(RequestError, match="max_logprobs"):
        engine.add_request(f"big-{field}", PROMPTS[1], None, too_many)
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: -1})


def test_prompt_logprobs_survive_preemption_unduplicated(make_engine, peft_model):
    """A sequence preempted mid-generation recomputes its prompt; its prompt logprobs are not repeated."""
    engine = make_engine(max_loras=2, max_lora_rank=32, max_num_seqs=1, max_num_batched_tokens=16)
    try:
        low = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1,
                             prompt_logprobs=1)
        engine.add_request("low", PROMPTS[0], "a1", low, priority=5)
        for _ in range(4):
            engine.step()
        engine.add_request("urgent", PROMPTS[1], None, SamplingParams(max_new_tokens=2, temperature=0.0),
                           priority=0)
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        out = finals["low"]
        assert out.num_preemptions == 1, "the low-priority request was preempted once"
        assert len(out.prompt_logprobs) == out.prompt_tokens, "its prompt logprobs are not duplicated"
        ref = _peft_logprobs(peft_model, "a1", out.prompt_token_ids + out.token_ids)
        for j, lp in enumerate(out.prompt_logprobs[1:], start=1):
            _check_token(lp, ref[j - 1], 1, f"preempted prompt token {j}")
        for i, lp in enumerate(out.logprobs):
            _check_token(lp, ref[out.prompt_tokens - 1 + i], 1, f"preempted output token {i}")
    finally:
        engine.close()

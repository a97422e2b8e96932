"""Logit controls (presence/frequency/repetition penalties, logit_bias, min_tokens) against transformers.

One mixed continuous batch (adapters and base rows, each row with its own controls, chunked prefills
sharing steps with decodes) is run greedily by the engine; every row must equal, token for token,
transformers' `generate` (greedy) on the PEFT model with that row's adapter and the matching logits
processors: MinNewTokensLengthLogitsProcessor (min_tokens), SequenceBiasLogitsProcessor with one-token
sequences (logit_bias), RepetitionPenaltyLogitsProcessor (repetition_penalty over prompt + output),
then OpenAI's presence/frequency penalty, which transformers does not ship and which `OpenAIPenalties`
below writes from OpenAI's definition (over generated tokens only).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import greedy as greedy_of
from peft import PeftModel
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from lora_cluster.engine import SamplingParams
from lora_cluster.errors import RequestError

ADAPTERS = ["a0", "a1", "a2", "a3"]
NEW_TOKENS = 24
EOS = 2  # the demo model's end-of-sequence id (config, tokenizer and generation config)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, with
    count[j] the occurrences of token j among the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len :]
        ones = torch.ones_like(generated, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, generated, ones)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference_processors(p: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """transformers' logits processors equal to `p`'s controls, in the engine's (vLLM's) order."""
    procs: list[LogitsProcessor] = []
    if p.min_tokens:
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}))
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stops))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    return LogitsProcessorList(procs)


@pytest.fixture(scope="module")
def engine(make_engine):
    engine = make_engine(max_loras=4, max_lora_rank=32, max_num_seqs=8,
                         max_num_batched_tokens=24)  # chunked prefills share steps with decodes
    yield engine
    engine.close()


def hf_generate(
    model: PeftModel, adapter_id: str | None, prompt_ids: list[int], p: SamplingParams
) -> list[int]:
    """transformers' greedy `generate` with `p`'s controls; stops at EOS unless `ignore_eos`."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=p.max_new_tokens, do_sample=False,
        logits_processor=reference_processors(p, len(prompt_ids)), pad_token_id=3,
        eos_token_id=None if p.ignore_eos else EOS,
    )  # fmt: skip
    with torch.no_grad():
        if adapter_id is None:
            with model.disable_adapter():
                out = model.generate(**kwargs)
        else:
            model.set_adapter(adapter_id)
            out = model.generate(**kwargs)
    return out[0, len(prompt_ids) :].tolist()


greedy = partial(greedy_of, NEW_TOKENS)  # every request here decodes NEW_TOKENS greedy tokens


ROWS: list[tuple[str, str | None, SamplingParams]] = [
    ("the quick brown fox", "a0", greedy(repetition_penalty=1.8)),
    ("hello", "a1", greedy(presence_penalty=1.5, frequency_penalty=0.7)),
    ("one two three four five six seven", None, greedy(frequency_penalty=1.2)),
    ("we", "a2", greedy(logit_bias={40: 6.0, 41: -100.0, 100: 3.5}, repetition_penalty=1.3)),
    ("a long story begins when the morning light falls", "a3",
     greedy(min_tokens=6, logit_bias={EOS: 100.0}, ignore_eos=False)),
    ("what is the weather like today", None, greedy()),
    ("the quick brown fox", "a0",
     greedy(presence_penalty=0.3, frequency_penalty=-0.4, repetition_penalty=1.2, logit_bias={7: 2.0})),
    ("hello", None, greedy(repetition_penalty=0.7, min_tokens=3, stop_token_ids=[9])),
]  # fmt: skip


def test_mixed_batch_controls_equal_transformers_generate(engine, peft_model):
    outs = engine.generate(
        [r[0] for r in ROWS], adapter_ids=[r[1] for r in ROWS], sampling=[r[2] for r in ROWS]
    )
    for i, ((_, aid, p), out) in enumerate(zip(ROWS, outs, strict=True)):
        ref = hf_generate(peft_model, aid, out.prompt_token_ids, p)
        assert out.token_ids == ref, f"row {i} ({aid}, {p}) equals transformers' generate token for token"


def test_controls_change_the_greedy_output(engine):
    """Guard against a parity test that passes because the controls do nothing."""
    plain = engine.generate([r[0] for r in ROWS], adapter_ids=[r[1] for r in ROWS], sampling=greedy())
    controlled = engine.generate(
        [r[0] for r in ROWS], adapter_ids=[r[1] for r in ROWS], sampling=[r[2] for r in ROWS]
    )
    for i, ((_, aid, p), a, b) in enumerate(zip(ROWS, plain, controlled, strict=True)):
        if p.has_logit_controls:
            assert a.token_ids != b.token_ids, f"row {i} ({aid}, {p}) differs from plain greedy"
        else:
            assert a.token_ids == b.token_ids, f"row {i} ({aid}) without controls is plain greedy"


def test_min_tokens_holds_back_eos_then_releases_it(engine):
    p = greedy(min_tokens=6, logit_bias={EOS: 100.0}, ignore_eos=False)
    out = engine.generate(["hello"], adapter_ids=["a1"], sampling=p)[0]
    assert EOS not in out.token_ids[:6], "EOS is not sampled before min_tokens output tokens"
    assert out.token_ids[6:] == [EOS], "EOS, favoured by logit_bias, comes right after min_tokens"
    assert out.finish_reason == "eos", "the request then ends on EOS"


def test_logprobs_are_the_raw_model_distribution(engine, peft_model):
    """logit_bias forces a token; its reported logprob is the model's own (vLLM's raw_logprobs)."""
    forced = 77
    out = engine.generate(
        ["the quick brown fox"], adapter_ids=["a2"], sampling=greedy(logit_bias={forced: 100.0}, logprobs=0)
    )[0]
    assert out.token_ids[0] == forced, "a +100 bias makes the token the greedy choice"
    peft_model.set_adapter("a2")
    with torch.no_grad():
        logits = peft_model(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    raw = torch.log_softmax(logits, -1)[forced].item()
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-4), "the logprob is taken before the bias"


@pytest.mark.parametrize(
    ("controls", "names"),
    [
        ({"presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]"]),
        ({"frequency_penalty": -3}, ["frequency_penalty", "[-2, 2]"]),
        ({"frequency_penalty": float("nan")}, ["frequency_penalty", "[-2, 2]"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty", "[0.01, 100]"]),
        ({"repetition_penalty": 1e-30}, ["repetition_penalty", "[0.01, 100]"]),
        ({"repetition_penalty": True}, ["repetition_penalty", "[0.01, 100]"]),
        ({"logit_bias": {5: 101.0}}, ["logit_bias[5]", "[-100, 100]"]),
        ({"logit_bias": {-1: 1.0}}, ["logit_bias", "token ids"]),
        ({"logit_bias": {"5": 1.0}}, ["logit_bias", "token ids"]),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, ["logit_bias", "1024"]),
        ({"min_tokens": 17}, ["min_tokens", "max_new_tokens=16"]),
        ({"min_tokens": -1}, ["min_tokens", "[0, max_new_tokens=16]"]),
    ],
)
def test_invalid_controls_are_refused_naming_field_and_limit(controls, names):
    with pytest.raises(RequestError) as err:
        SamplingParams(max_new_tokens=16, **controls)
    for name in names:
        assert name in str(err.value), f"the error for {controls} names {name!r}: {err.value}"


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(engine):
    vocab = engine.model.dims.vocab_size
    with pytest.raises(RequestError, match=rf"logit_bias.*\[0, {vocab}\).*{vocab + 5}"):
        engine.add_request("bias-oov", "hello", None, greedy(logit_bias={vocab + 5: 1.0}))
    assert not engine.has_unfinished(), "the refused request is not queued"


def test_http_bodies_pass_the_controls_to_the_engine():
    """OpenAI `presence_penalty`/`frequency_penalty`/`logit_bias`, vLLM's `repetition_penalty` and LoRAX's
    `parameters.repetition_penalty` reach SamplingParams; out of range they are a validation error (400)."""
    from pydantic import ValidationError

    from lora_cluster.config import ServeConfig
    from lora_cluster.serve.http.lorax_schemas import LoraxParameters
    from lora_cluster.serve.http.openai_schemas import ChatCompletionRequest, CompletionRequest

    limits = ServeConfig()
    body = CompletionRequest(model="m", prompt="hi", presence_penalty=0.5, frequency_penalty=-1.0,
                             repetition_penalty=1.2, logit_bias={"7": -100, "0": 2.5})  # fmt: skip
    p = body.sampling(limits, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2), (
        "the completions body's penalties are passed on"
    )
    assert p.logit_bias == {7: -100.0, 0: 2.5}, "logit_bias keys (JSON strings) become token ids"
    assert CompletionRequest(model="m", prompt="hi", min_tokens=5).sampling(limits, 16).min_tokens == 5, (
        "vLLM's min_tokens is passed on"
    )
    capped = CompletionRequest(model="m", prompt="hi", max_tokens=4, min_tokens=9).sampling(limits, 16)
    assert capped.min_tokens == 4, "min_tokens above max_tokens is capped (a schema cannot relate the two)"
    messages = [{"role": "user", "content": "x"}]
    chat = ChatCompletionRequest(model="m", messages=messages, frequency_penalty=2.0)
    assert chat.sampling(limits, 16).frequency_penalty == 2.0, "the chat body's penalties are passed on"
    lorax, _ = LoraxParameters(repetition_penalty=1.3).sampling(limits)
    assert lorax.repetition_penalty == 1.3, "LoRAX's repetition_penalty is passed on"
    assert LoraxParameters().sampling(limits)[0].repetition_penalty == 1.0, "LoRAX's default is off"
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.1}, {"repetition_penalty": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            CompletionRequest(model="m", prompt="hi", **bad)
    with pytest.raises(ValidationError, match="repetition_penalty"):
        LoraxParameters(repetition_penalty=-1.0)
    for bias in ({"07": 1.0}, {"-1": 1.0}, {"x": 1.0}, {"5": 100.5}, {str(i): 1.0 for i in range(1025)}):
        with pytest.raises(ValidationError, match="logit_bias"):
            CompletionRequest(model="m", prompt="hi", logit_bias=bias)


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 512, 1001, 32000, 151936])
def test_the_openapi_logit_bias_key_pattern_is_the_token_id_range(n):
    """The OpenAPI schema states logit_bias keys as the decimal token ids below the vocabulary size."""
    import re

    from lora_cluster.serve.http.schemas import token_ids_below

    pattern = re.compile(token_ids_below(n))
    wrong = [k for k in range(n + 1000) if bool(pattern.match(str(k))) != (k < n)]
    assert wrong == [], f"the pattern for vocabulary {n} matches exactly 0..{n - 1}: wrong for {wrong[:5]}"
    for key in ("01", "-1", "", "1.0", " 1"):
        assert not pattern.match(key), f"{key!r} is not a token id key"

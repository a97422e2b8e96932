"""The API shapes of logprobs are valid JSON when a constrained row's alternatives are -inf (tokens its
grammar does not allow): each such logprob is reported as -9999.0, as vLLM's OpenAI server does.
A fuzz run found `/generate` with `response_format`, `details` and `return_k_alternatives` answering
500 ("Out of range float values are not JSON compliant")."""

from __future__ import annotations

import json
import math

import pytest

from lora_cluster.request.output import TokenLogprob
from lora_cluster.serve.http.logprob_format import (
    LOGPROB_FLOOR,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    lorax_alternatives,
    lorax_prefill,
)

MASKED = TokenLogprob(token_id=65, logprob=-0.0, top=((65, -0.0), (66, -math.inf)))


def _texts() -> TokenTexts:
    return TokenTexts(chr)


@pytest.mark.parametrize("shape", ["completion", "echo", "chat", "lorax_alternatives", "lorax_prefill"])
def test_a_masked_alternative_is_valid_json(shape):
    out = {
        "completion": lambda: completion_logprobs([MASKED], _texts()),
        "echo": lambda: echo_logprobs([64, 65], [None, MASKED], _texts()),
        "chat": lambda: chat_logprobs([MASKED], _texts()),
        "lorax_alternatives": lambda: lorax_alternatives(MASKED, _texts()),
        "lorax_prefill": lambda: lorax_prefill([64, 65], [None, TokenLogprob(65, -math.inf)], _texts()),
    }[shape]()
    text = json.dumps(out, allow_nan=False)  # raises on -inf, as Starlette's JSONResponse does
    assert str(LOGPROB_FLOOR) in text, f"the masked logprob is reported as {LOGPROB_FLOOR}: {text}"


def test_a_finite_logprob_is_unchanged():
    out = chat_logprobs([TokenLogprob(65, -1.25, ((65, -1.25), (66, -2.5)))], _texts())
    assert [e["logprob"] for e in out["content"][0]["top_logprobs"]] == [-1.25, -2.5], (
        "finite logprobs are reported as they are")

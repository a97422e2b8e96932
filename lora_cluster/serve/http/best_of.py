"""`best_of`: which of several candidate generations of one prompt a response returns.

OpenAI completions and chat, as vLLM: the `n` candidates of `best_of` with the highest cumulative
logprob (the sum of the generated tokens' logprobs), best first. LoRAX, as its router: the candidate
with the highest mean logprob per generated token; the others, in their order, are the response's
`details.best_of_sequences`.

The logprobs are those of the raw model distribution (`engine.logprobs`), the ones a response reports,
so a client can recompute the ranking. Ties keep the earlier candidate first. A candidate without a
generated token has a mean of -inf (LoRAX divides by zero there) and a sum of 0.
Items are the final wire items of the candidates (`protocol.output_item`), each with `logprobs` (the
caller asks the engine for them: logprobs >= 0).
"""

from __future__ import annotations

import math
from typing import Any


def cumulative_logprob(item: dict[str, Any]) -> float:
    """The sum of a final item's generated tokens' logprobs."""
    return math.fsum(lp.logprob for lp in item.get("logprobs") or [])


def mean_logprob(item: dict[str, Any]) -> float:
    """The mean of a final item's generated tokens' logprobs (-inf without tokens)."""
    logprobs = item.get("logprobs") or []
    return cumulative_logprob(item) / len(logprobs) if logprobs else -math.inf


def best_n(candidates: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` candidates with the highest cumulative logprob, best first (vLLM's best_of)."""
    order = sorted(range(len(candidates)), key=lambda i: -cumulative_logprob(candidates[i]))
    return [candidates[i] for i in order[:n]]


def best_one(candidates: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """LoRAX's best_of: the index of the candidate with the highest mean logprob per token, and the
    indices of the others in their order."""
    best = max(range(len(candidates)), key=lambda i: (mean_logprob(candidates[i]), -i))
    return best, [i for i in range(len(candidates)) if i != best]


def openai_rules(max_n: int) -> list[dict[str, Any]]:
    """The OpenAPI rule of best_of in an OpenAI body: at least n, and with stream only equal to n (n
    defaults to 1). JSON Schema cannot compare two fields, so each allowed value is spelled out, in as
    few cases as it takes (a client generating bodies from the schema expands every case against the
    body's other rules): unset; equal to n; or above n without stream. With max_n 1 both are 1 at
    most and there is nothing to state."""
    if max_n == 1:
        return []
    equal_n = [{"properties": {"best_of": {"const": k}, "n": {"const": k}},
                "required": ["n"] if k > 1 else []} for k in range(1, max_n + 1)]
    above_n = [{"properties": {"best_of": {"const": k}, "n": {"maximum": k - 1}, "stream": {"const": False}}}
               for k in range(2, max_n + 1)]
    return [{"anyOf": [{"properties": {"best_of": {"type": "null"}}}, *equal_n, *above_n]}]


LORAX_ONE = {"properties": {"best_of": {"anyOf": [{"type": "null"}, {"maximum": 1}]}}}


def lorax_rule() -> dict[str, Any]:
    """The OpenAPI rule of best_of in LoRAX's parameters: above 1 only with sampling (do_sample, or a
    temperature, top_k or top_p that warps; temperature 0 is greedy) and without a seed."""
    sampled = {"properties": {"seed": {"type": "null"}, "temperature": {"not": {"const": 0}}}, "anyOf": [
        {"properties": {"do_sample": {"const": True}}, "required": ["do_sample"]},
        {"properties": {"temperature": {"type": "number", "not": {"const": 1}}}, "required": ["temperature"]},
        {"properties": {"top_k": {"type": "integer"}}, "required": ["top_k"]},
        {"properties": {"top_p": {"type": "number", "not": {"const": 1}}}, "required": ["top_p"]}]}
    return {"anyOf": [LORAX_ONE, sampled]}


def lorax_stream_rule() -> dict[str, Any]:
    """The OpenAPI rule of a LoRAX body: with `stream: true`, best_of at most 1."""
    not_streamed = {"properties": {"stream": {"const": False}}}
    return {"anyOf": [not_streamed, {"properties": {"parameters": LORAX_ONE}}]}

"""`best_of`: which of several candidate generations of one prompt a response returns.

OpenAI completions and chat, as vLLM: the `n` candidates of `best_of` with the highest cumulative
logprob (the sum of the generated tokens' logprobs), best first. LoRAX, as its router: the candidate
with the highest mean logprob per generated token; the others, in their order, are the response's
`details.best_of_sequences`.

The logprobs are those of the raw model distribution (`engine.sample.logprobs`), the ones a response reports,
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

"""When a request stops: stop token ids, end-of-sequence, stop strings and length limits.

`append_token` is what a sampled token does to its sequence: its logprob and id are recorded, the
grammar's matcher (if any) consumes it, and `stop_reason` says whether the request ends; a grammar
that allows nothing more ends it with `stop`.

Checked after each new token, in this order: a stop token id (kept in the ids, not in the text), an
end-of-sequence token unless `ignore_eos` (kept in the ids), a stop string in the text (the text is
cut before it), then `max_new_tokens` or the model's length limit (the detokenizer's held-back tail
is released, and a stop string it completes still cuts the text). Before `min_tokens` output tokens
only the model's length limit ends a sequence (vLLM): stop ids and EOS cannot be sampled then
(`engine.sample.logit_controls`), and a stop string in that text does not stop it.
"""

from __future__ import annotations

import time
from typing import Protocol

from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.sample.guided_state import GuidedState
from lora_cluster.request.output import FinishReason, TokenLogprob
from lora_cluster.request.sampling_params import SamplingParams


class StoppingRow(Protocol):
    """What the stop checks read and advance of a sequence (engine.schedule.sequence.Sequence has it)."""

    sampling: SamplingParams
    output_ids: list[int]
    detok: IncrementalDetokenizer

    @property
    def num_tokens(self) -> int: ...


class TokenRow(StoppingRow, Protocol):
    """What `append_token` writes of a sequence (engine.schedule.sequence.Sequence has it)."""

    output_logprobs: list[TokenLogprob]
    first_token_time: float | None
    guided: GuidedState | None


def append_token(seq: TokenRow, token: int, logprob: TokenLogprob | None, eos_token_ids: set[int],
                 max_model_len: int) -> FinishReason | None:
    """Add a sampled token (and its logprob, when asked) to `seq`; the reason it stops now, or None."""
    if logprob is not None:
        seq.output_logprobs.append(logprob)
    seq.output_ids.append(token)
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    complete = seq.guided is not None and seq.guided.accept(token)
    reason = stop_reason(seq, eos_token_ids, max_model_len)
    if reason is None and complete:  # the grammar allows nothing but the end: stop now
        seq.detok.flush(seq.output_ids)
        reason = FinishReason.STOP
    return reason


def stop_reason(seq: StoppingRow, eos_token_ids: set[int], max_model_len: int) -> FinishReason | None:
    """Advance `seq`'s detokenizer over its newest output token; the reason it stops now, or None."""
    token, p = seq.output_ids[-1], seq.sampling
    if len(seq.output_ids) < p.min_tokens:  # stop ids and EOS were masked; stop strings wait too
        seq.detok.step(seq.output_ids)
        if seq.num_tokens >= max_model_len:
            seq.detok.flush(seq.output_ids)
            return FinishReason.LENGTH
        return None
    if token in p.stop_token_ids:
        seq.detok.flush(seq.output_ids[:-1])
        return FinishReason.STOP
    if token in eos_token_ids and not p.ignore_eos:
        seq.detok.flush(seq.output_ids)
        return FinishReason.EOS
    before = len(seq.detok.text)
    seq.detok.step(seq.output_ids)
    if p.stop and _truncate_at_stop(seq, before):
        return FinishReason.STOP
    if len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= max_model_len:
        seq.detok.flush(seq.output_ids)
        if p.stop and _truncate_at_stop(seq, before):
            return FinishReason.STOP
        return FinishReason.LENGTH
    return None


def _truncate_at_stop(seq: StoppingRow, before: int) -> bool:
    """Cut the text at the first stop string that may have been completed since `before` characters."""
    text = seq.detok.text
    start = max(0, before - max(len(s) for s in seq.sampling.stop) + 1)
    hits = [i for i in (text.find(s, start) for s in seq.sampling.stop) if i >= 0]
    if not hits:
        return False
    seq.detok.text = text[: min(hits)]
    return True

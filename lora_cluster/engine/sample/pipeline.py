"""The sampling pipeline of one step: from the forward pass's logits to each sampled row's token.

Order (each step, the same for every row): the constrained rows' token masks (`token_mask`, filled
on the mask thread while an accelerator runs the forward pass, on the step thread after it on the
CPU) -> the logit controls (`logit_controls`) -> the sampler (`sampling`); logprobs are taken from
the masked model logits before the controls (`logprobs`: the raw distribution, or the grammar's
allowed part of it), and the prompt-logprob rows after the sampled ones go to their sequences.
A constrained row that the controls left with no finite logit samples from its masked logits.

Invariant: a step without constrained rows does no mask work; rows without controls are sampled
from the model's logits as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lora_cluster.engine.sample.logit_controls import ControlledRow, apply_logit_controls
from lora_cluster.engine.sample.logprobs import record_prompt_logprobs, token_logprobs
from lora_cluster.engine.sample.sampling import sample
from lora_cluster.engine.sample.token_mask import GuidedRow, TokenMasks
from lora_cluster.request.output import TokenLogprob


class SampledRow(ControlledRow, GuidedRow, Protocol):
    """What the pipeline reads of a sampled sequence (engine.schedule.sequence.Sequence has it)."""

    generator: torch.Generator | None


@dataclass(frozen=True)
class SampledTokens:
    """One token per sampled row, and its logprob where the request asked for them (else None)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


class StepSampler:
    """Samples a step's rows (see the module docstring).

    `mask_pool`: the thread that fills token masks while the forward pass runs (None on the CPU: the
    step thread fills them); the sampler owns it from then on, and `close` shuts it down."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], mask_pool: Executor | None):
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self._mask_pool = mask_pool

    def start_masks(self, rows: Sequence[GuidedRow]) -> TokenMasks | None:
        """Begin filling the constrained rows' masks (None: no row is constrained); call before the
        forward pass, so that the mask thread works while it runs."""
        return TokenMasks.start(rows, self.vocab_size, self._mask_pool)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampledRow], masks: TokenMasks | None,
               prompt_logprob_spans: Sequence[tuple[Any, int, int]] = ()) -> SampledTokens:
        """Tokens of `rows` from `logits` [len(rows) + prompt-logprob rows, V]; the prompt-logprob rows
        (after the sampled ones) are recorded on their spans' sequences."""
        n = len(rows)
        params = [r.sampling for r in rows]
        model_logits = logits[:n] if masks is None else masks.apply(logits[:n])
        controlled = apply_logit_controls(model_logits, rows, self.eos_token_ids)
        if masks is not None:
            controlled = masks.keep_allowed(controlled, model_logits)
        tokens = sample(controlled, params, [r.generator for r in rows])
        logprobs = token_logprobs(model_logits, tokens, [p.logprobs for p in params])
        record_prompt_logprobs(logits[n:], prompt_logprob_spans)
        return SampledTokens(tokens, logprobs)

    def close(self) -> None:
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)

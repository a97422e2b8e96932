"""Logit controls: min_tokens, logit_bias and the repetition, frequency and presence penalties.

Applied per row of a step's sampled logits, before temperature, top-k, top-p and the greedy argmax,
in vLLM's order:
1. `min_tokens`: while a sequence has fewer output tokens, its stop token ids and (unless
   `ignore_eos`) the model's end-of-sequence ids are set to -inf (vLLM's MinTokensLogitsProcessor;
   transformers' MinNewTokensLengthLogitsProcessor).
2. `logit_bias`: each listed token's bias is added to its logit (OpenAI; transformers'
   SequenceBiasLogitsProcessor with one-token sequences).
3. `repetition_penalty` p: every token that occurs in prompt + output has its logit divided by p when
   positive and multiplied by p otherwise (transformers' RepetitionPenaltyLogitsProcessor, CTRL).
4. `frequency_penalty` f and `presence_penalty` r (OpenAI's definition, over output tokens only):
   `logit[j] -= c[j] * f + (c[j] > 0) * r` with c[j] the count of token j in the output.

Invariants: rows whose parameters are all defaults are returned bit for bit (no copy when no row
has a control); the input tensor is never modified, so logprobs taken from it are the raw model
distribution (vLLM's default `raw_logprobs`, see `engine.sample.logprobs`). The work is vectorized over
the rows that have controls: token occurrences are scattered into [rows, V] tensors, never a
Python loop over the vocabulary; the Python work per step is O(tokens of those rows).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from lora_cluster.request.sampling_params import SamplingParams


class ControlledRow(Protocol):
    """What the controls read of a sequence (engine.schedule.sequence.Sequence has it)."""

    sampling: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


def apply_logit_controls(
    logits: torch.Tensor, rows: Sequence[ControlledRow], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """`logits` [N, V] with each row's controls applied (row i belongs to `rows[i]`); a new tensor
    when any row has a control, else `logits` itself."""
    picked = [i for i, r in enumerate(rows) if r.sampling.has_logit_controls]
    if not picked:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    sel = [rows[i] for i in picked]
    index = torch.tensor(picked, device=device)
    sub = logits.index_select(0, index)
    _min_tokens(sub, sel, eos_token_ids)
    _logit_bias(sub, sel)
    params = [r.sampling for r in sel]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _occurrences(sel, vocab, device, with_prompt=True) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalized, sub)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = _occurrences(sel, vocab, device, with_prompt=False)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).float()
    return logits.clone().index_copy_(0, index, sub)


def _min_tokens(sub: torch.Tensor, rows: list[ControlledRow], eos_token_ids: Collection[int]) -> None:
    """-inf on the stop ids of the rows still short of their min_tokens (in place)."""
    vocab = sub.shape[-1]
    cells: list[tuple[int, int]] = []
    for j, r in enumerate(rows):
        p = r.sampling
        if len(r.output_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        cells += [(j, t) for t in stops if 0 <= t < vocab]
    if cells:
        at = torch.tensor(cells, device=sub.device)
        sub[at[:, 0], at[:, 1]] = float("-inf")


def _logit_bias(sub: torch.Tensor, rows: list[ControlledRow]) -> None:
    """Add each row's logit_bias (in place); ids outside the vocabulary were refused at admission."""
    cells = [(j, t, b) for j, r in enumerate(rows) for t, b in r.sampling.logit_bias.items()]
    if not cells:
        return
    at = torch.tensor([(j, t) for j, t, _ in cells], device=sub.device)
    bias = torch.tensor([b for _, _, b in cells], dtype=sub.dtype, device=sub.device)
    sub.index_put_((at[:, 0], at[:, 1]), bias, accumulate=True)


def _occurrences(
    rows: list[ControlledRow], vocab: int, device: torch.device, with_prompt: bool
) -> torch.Tensor:
    """Counts [len(rows), vocab] of each token in each row's output (and prompt when asked)."""
    ids = [(r.prompt_ids + r.output_ids) if with_prompt else r.output_ids for r in rows]
    width = max(1, max(len(x) for x in ids))
    padded = torch.full((len(rows), width), vocab, dtype=torch.long)  # column `vocab` takes the padding
    for j, x in enumerate(ids):
        if x:
            padded[j, : len(x)] = torch.tensor(x, dtype=torch.long)
    counts = torch.zeros((len(rows), vocab + 1), device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]

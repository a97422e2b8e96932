"""Metadata of one engine step, built by a small pure function from the scheduler's decision.

Token order: scheduled sequences are sorted by adapter slot (stable), each sequence's tokens kept
contiguous, so that the tokens of one adapter form one segment for the SGMV kernels. Decoding
sequences (one token each) attend together over the KV slot range; prefill chunks attend one
sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from lora_kernels import LoraMeta, build_lora_meta, with_slot_ranks

from lora_cluster.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillSpan:
    """A prefill chunk of one sequence (its prompt, or prompt + output when recomputed after a
    preemption): batch tokens [start, end) at positions [ctx_start, ctx_start + n)."""

    kv_slot: int
    start: int
    end: int
    ctx_start: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_slots: torch.Tensor  # [T] int64, KV slot of each token's sequence
    lora: dict[str, LoraMeta]  # projection -> segments of adapters that target it
    prefills: tuple[PrefillSpan, ...]
    decode_rows: torch.Tensor  # [D] batch token index of each decoding sequence
    decode_slots: torch.Tensor  # [D] its KV slot
    decode_span: int  # attention runs over KV slots [0, decode_span)
    decode_mask: torch.Tensor | None  # [decode_span, 1, 1, max_ctx] bool, True = attend
    sample_rows: torch.Tensor  # [N] batch token index whose logits are sampled
    sampled: tuple[Sequence, ...]  # [N] the sequence each sampled row belongs to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_batch(
    decodes: Seq[Sequence],
    prefills: Seq[tuple[Sequence, int]],
    module_ranks: dict[str, list[int]],
    device: torch.device,
) -> StepBatch:
    """Lay out the step's tokens (see module docstring) and derive every index the forward needs."""
    work = [(s, 1, True) for s in decodes] + [(s, n, False) for s, n in prefills]
    work.sort(key=lambda item: item[0].lora_slot)
    ids: list[int] = []
    positions: list[int] = []
    kv_slots: list[int] = []
    lora_slots: list[int] = []
    spans: list[PrefillSpan] = []
    decode_rows: list[int] = []
    decode_slots: list[int] = []
    decode_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    for seq, n, is_decode in work:
        start, first = len(ids), seq.num_computed
        ids.extend(seq.token_at(i) for i in range(first, first + n))
        positions.extend(range(first, first + n))
        kv_slots.extend([seq.kv_slot] * n)
        lora_slots.extend([seq.lora_slot] * n)
        if is_decode:
            decode_rows.append(start)
            decode_slots.append(seq.kv_slot)
            decode_lens.append(first + 1)
        else:
            spans.append(PrefillSpan(seq.kv_slot, start, start + n, first))
        if first + n == seq.num_tokens:  # the chunk reaches the sequence's end: sample its next token
            sample_rows.append(len(ids) - 1)
            sampled.append(seq)
    token_slot = torch.tensor(lora_slots, dtype=torch.int64, device=device)
    mask = None
    span = 0
    if decode_rows:
        span = max(decode_slots) + 1
        max_ctx = max(decode_lens)
        lens = torch.ones(span, dtype=torch.int64)  # idle slots attend to position 0 (ignored) to avoid NaN
        lens[decode_slots] = torch.tensor(decode_lens)
        mask = (torch.arange(max_ctx)[None, :] < lens[:, None])[:, None, None, :].to(device)

    def _t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return StepBatch(
        input_ids=_t(ids),
        positions=_t(positions),
        kv_slots=_t(kv_slots),
        lora=_module_metas(token_slot, module_ranks),
        prefills=tuple(spans),
        decode_rows=_t(decode_rows),
        decode_slots=_t(decode_slots),
        decode_span=span,
        decode_mask=mask,
        sample_rows=_t(sample_rows),
        sampled=tuple(sampled),
    )


def _module_metas(token_slot: torch.Tensor, module_ranks: dict[str, list[int]]) -> dict[str, LoraMeta]:
    """One segment layout per step (one read of `token_slot`), with each projection's slot ranks."""
    ranks = iter(module_ranks.items())
    first, first_ranks = next(ranks)
    meta = build_lora_meta(token_slot, first_ranks)
    return {first: meta, **{m: with_slot_ranks(meta, r) for m, r in ranks}}

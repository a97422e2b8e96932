"""The pairs of a mixture-of-experts step, shared by the experts' implementations
(`lora_kernels.moe_experts`, `lora_kernels.triton_moe`): the per-token expert LoRA of a step and the
(token, choice) pairs sorted by (expert, adapter row), so that each expert's pairs, and within them
each adapter's, are contiguous."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Activation", "ExpertLora", "expert_spans", "pair_groups", "sort_pairs"]

Activation = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ExpertLora:
    """One layer's LoRA on the experts for one step (shapes: `lora_kernels.moe_experts`)."""

    rows: Tensor  # [T] int64, adapter row of each token, -1 = none
    gate_up_a: Tensor  # [N, E, R, H]
    gate_up_b: Tensor  # [N, E, 2I, R]
    down_a: Tensor  # [N, E, R, I]
    down_b: Tensor  # [N, E, H, R]
    rank: int  # rank columns read (<= R)


def sort_pairs(ids: Tensor, num_experts: int, lora: ExpertLora | None) -> tuple[Tensor, list[int], int]:
    """The step's (token, choice) pairs in (expert, adapter row) order: (order [T*K] of flat pair
    indices, the pair count of each (expert, row + 1) group in that order, rows + 1 per expert).
    One host read (the counts)."""
    flat = ids.reshape(-1)
    if lora is None:
        key, span = flat, 1
    else:
        span = lora.gate_up_a.shape[0] + 1
        key = flat * span + lora.rows.repeat_interleave(ids.shape[1]) + 1
    order = torch.argsort(key, stable=True)
    return order, torch.bincount(key, minlength=num_experts * span).tolist(), span


def pair_groups(counts: list[int], span: int) -> list[tuple[int, int, int, int]]:
    """(expert, adapter row or -1, first pair, pair count) of each non-empty group, in pair order."""
    starts = itertools.accumulate(counts, initial=0)
    pairs = zip(starts, counts, strict=False)  # one more start than counts
    return [(g // span, g % span - 1, s, n) for g, (s, n) in enumerate(pairs) if n]


def expert_spans(groups: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """(expert, first pair, pair count) of each chosen expert: its groups are contiguous."""
    out: list[tuple[int, int, int]] = []
    for e, _, s, n in groups:
        if out and out[-1][0] == e:
            out[-1] = (e, out[-1][1], out[-1][2] + n)
        else:
            out.append((e, s, n))
    return out

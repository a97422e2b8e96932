"""Batch metadata for heterogeneous-adapter LoRA: segments of equal adapter slot.

A batch of ``T`` tokens carries one adapter slot index per token (``token_slot``, ``-1`` = base
model only). The segmented kernels (SGMV) work on *segments*: maximal runs of consecutive tokens
with the same slot, in token order. The engine sorts sequences by slot so that runs are long;
``build_lora_meta`` does not sort, it only finds the runs.

Base segments (slot ``-1``) are KEPT in the segment lists, with rank 0, so that ``seg_indptr`` is
a plain CSR-style boundary array covering all ``T`` tokens. Kernels skip (or zero, for shrink)
segments whose slot is ``-1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

__all__ = ["LoraMeta", "build_lora_meta", "with_slot_ranks"]


@dataclass(frozen=True)
class LoraMeta:
    """Segment metadata of one batch; build it with :func:`build_lora_meta`.

    Tensor fields live on one device; the ``*_list`` tuples are the same values as plain Python
    ints so that CPU-side loops and launch-grid computations never need a device synchronisation.
    """

    seg_indptr: Tensor  # [S+1] int64, segment i covers tokens seg_indptr[i] : seg_indptr[i+1]
    seg_slot: Tensor  # [S] int64, slot of each segment (-1 for base segments)
    seg_rank: Tensor  # [S] int64, rank of the adapter in that slot (0 for base segments)
    seg_indptr_list: tuple[int, ...]  # len S+1, same values as seg_indptr
    seg_slot_list: tuple[int, ...]  # len S, same values as seg_slot
    seg_rank_list: tuple[int, ...]  # len S, same values as seg_rank
    seg_len_list: tuple[int, ...]  # len S, tokens per segment (for Tensor.split_with_sizes)
    max_rank: int  # max(seg_rank_list), 0 when no token uses an adapter of rank > 0
    max_seg_len: int  # longest segment in tokens (0 for an empty batch)

    @property
    def token_slot(self) -> Tensor:
        """[T] int64 slot of each token, -1 = base model only, rebuilt from the segments on their
        device (no kernel needs it; no synchronisation)."""
        lengths = self.seg_indptr[1:] - self.seg_indptr[:-1]
        return torch.repeat_interleave(self.seg_slot, lengths, output_size=self.num_tokens)

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens in the batch."""
        return self.seg_indptr_list[-1]

    @property
    def num_segments(self) -> int:
        """S, the number of segments (base segments included)."""
        return len(self.seg_slot_list)


def build_lora_meta(token_slot: Tensor, slot_ranks: Sequence[int] | Tensor) -> LoraMeta:
    """Build the segment metadata of a batch.

    Args:
        token_slot: [T] integer tensor, slot of each token in ``[-1, L)``; need not be sorted.
        slot_ranks: [L] rank of the adapter held by each slot (0 for an empty slot).

    Returns:
        A :class:`LoraMeta` whose segments are the maximal runs of equal slot in token order; base
        runs (slot -1) are kept with rank 0. Tensors are on ``token_slot``'s device (one small
        host-to-device copy); this function syncs once to read ``token_slot`` on the host.

    Raises:
        ValueError: on a slot outside ``[-1, L)``, a negative rank or a non-1-D ``token_slot``.
    """
    if token_slot.dim() != 1:
        raise ValueError(f"token_slot must be 1-D [T], got shape {tuple(token_slot.shape)}")
    device = token_slot.device
    token_slot = token_slot.to(torch.int64)
    ranks = [int(r) for r in (slot_ranks.tolist() if isinstance(slot_ranks, Tensor) else slot_ranks)]
    if any(r < 0 for r in ranks):
        raise ValueError(f"slot ranks must be >= 0, got {ranks}")
    ts = token_slot.cpu()
    t = ts.numel()
    if t:
        lo, hi = int(ts.min()), int(ts.max())
        if lo < -1 or hi >= len(ranks):
            raise ValueError(f"token_slot values must be in [-1, {len(ranks)}), got range [{lo}, {hi}]")
        starts = (torch.nonzero(ts[1:] != ts[:-1]).flatten() + 1).tolist()
        indptr = [0, *starts, t]
        seg_slot = ts[indptr[:-1]].tolist()
    else:
        indptr, seg_slot = [0], []
    seg_rank = [ranks[s] if s >= 0 else 0 for s in seg_slot]
    seg_len = [b - a for a, b in itertools.pairwise(indptr)]
    n = len(seg_slot)
    packed = torch.tensor([*indptr, *seg_slot, *seg_rank], dtype=torch.int64)
    if packed.device != device:
        packed = packed.to(device)
    return LoraMeta(
        seg_indptr=packed[: n + 1],
        seg_slot=packed[n + 1 : 2 * n + 1],
        seg_rank=packed[2 * n + 1 :],
        seg_indptr_list=tuple(indptr),
        seg_slot_list=tuple(seg_slot),
        seg_rank_list=tuple(seg_rank),
        seg_len_list=tuple(seg_len),
        max_rank=max(seg_rank, default=0),
        max_seg_len=max(seg_len, default=0),
    )


def with_slot_ranks(meta: LoraMeta, slot_ranks: Sequence[int]) -> LoraMeta:
    """The same segments with the ranks of other slots (e.g. another projection's), without
    re-reading ``token_slot``: no device synchronisation, one small host-to-device copy."""
    seg_rank = [slot_ranks[s] if s >= 0 else 0 for s in meta.seg_slot_list]
    return replace(
        meta,
        seg_rank=torch.tensor(seg_rank, dtype=torch.int64, device=meta.seg_indptr.device),
        seg_rank_list=tuple(seg_rank),
        max_rank=max(seg_rank, default=0),
    )

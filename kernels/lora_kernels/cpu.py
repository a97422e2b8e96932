"""Fast CPU LoRA ops: dense BLAS matmuls over contiguous token runs, sliced to each adapter's rank.

Same signatures, shapes and semantics as :mod:`lora_kernels.reference` (see there). Differences:

* The SGMV functions and ``add_lora`` loop over ``meta``'s segments with the host-side tuples
  (``seg_*_list``): no per-token Python loop and no device synchronisation. Each segment costs one
  or two BLAS calls writing straight into (slices of) ``out`` via ``out=`` / ``addmm_``; a strided
  ``out`` view with unit column stride (e.g. ``fused[:, 128:256]``) is a valid BLAS operand, so no
  copy is made. Rank slicing (``lora_a[s, :r]``, ``lora_b[s, :, :r]``) skips the zero padding;
  like the reference, results assume the padding beyond each adapter's rank is zero.
* The BGMV functions have no segments: they gather the per-token adapter weights and use one
  batched matmul per chunk of tokens (chunks bound the gathered copy to ``_GATHER_ELEMS``). The
  gathers copy whole rows (A's [rank, K] rows, B's stored [rank, N] rows through ``lora_b.mT``), so
  each is a run of contiguous copies; the matmuls are [1, K] x [K, r] and [1, r] x [r, N] per token.
* ``x``, the weights, ``y`` and ``out`` must share one dtype (BLAS ``out=`` needs it); float16 and
  bfloat16 work and accumulate as CPU BLAS does (the ``add_lora`` intermediate is in ``x``'s dtype).
* A batch without any adapter token (``meta.max_rank == 0``) is a no-op for ``add_lora`` (and
  for ``sgmv_expand`` with ``add=True``); ``sgmv_shrink`` then just zeroes ``out``.
* The SGMV functions and ``add_lora`` take the slot-batched path of :mod:`lora_kernels.slot_batch`
  (one ``bmm`` over the pool's slots in place instead of the segment loop) when its policy says it
  pays: many short segments, as a decode step of many distinct adapters has. ``batched=True`` /
  ``False`` forces a path (tests, benchmarks); results are the same either way.
* ``add_lora`` runs decode-like batches (``slot_batch.decode_like``: many short segments, whatever
  their span) through the C++ kernel of :mod:`lora_kernels.native` instead, once ``native.load()``
  has built it (the engine does at start) and it takes the tensors; ``native=False`` keeps the
  torch paths (tests, benchmarks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native as native_kernel
from . import slot_batch
from .meta import LoraMeta

__all__ = ["add_lora", "bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink"]

# Upper bound (elements) on the per-chunk copy of gathered adapter weights in the BGMV path.
_GATHER_ELEMS = 1 << 22


def bgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, token_slot: Tensor, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[slot, :R_out].T per token; base rows = 0."""
    n_tok, k = x.shape
    r_out = out.shape[1]
    if n_tok == 0:
        return
    base = (token_slot < 0).unsqueeze(1)
    slots = token_slot.clamp(min=0)
    step = max(1, _GATHER_ELEMS // max(1, r_out * k))
    for c in range(0, n_tok, step):
        a = lora_a[slots[c : c + step], :r_out]  # [n, R_out, K] gathered copy
        h = torch.bmm(x[c : c + step].unsqueeze(1), a.mT).squeeze(1)  # [n, R_out]
        if scale != 1.0:
            h.mul_(scale)
        out[c : c + step] = h.masked_fill_(base[c : c + step], 0)


def bgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, token_slot: Tensor, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[slot, :, :R_in].T per token; base rows untouched."""
    n_tok, r_in = y.shape
    if n_tok == 0:
        return
    base = (token_slot < 0).unsqueeze(1)
    slots = token_slot.clamp(min=0)
    step = max(1, _GATHER_ELEMS // max(1, r_in * out.shape[1]))
    b_t = lora_b.mT  # [L, R, N]: the pool stores B this way, so a slot's rank rows are contiguous
    for c in range(0, n_tok, step):
        b = b_t[slots[c : c + step], :r_in]  # [n, R_in, N] gathered copy
        d = torch.bmm(y[c : c + step].unsqueeze(1), b).squeeze(1)  # [n, N]
        o, m = out[c : c + step], base[c : c + step]
        if add:
            o.add_(d.masked_fill_(m, 0))
        else:
            o.copy_(torch.where(m, o, d))


def _batch(meta: LoraMeta, x: Tensor, batched: bool | None) -> slot_batch.SlotBatch | None:
    """The slot layout when the slot-batched path runs (forced by ``batched``, else by its policy)."""
    if batched is False:
        return None
    sb = slot_batch.slot_batch(meta, x.device)
    return sb if batched or slot_batch.use_slot_batch(meta, sb) else None


def sgmv_shrink(
    out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta, scale: float = 1.0, *, batched: bool | None = None
) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[s, :R_out].T per segment; base rows = 0."""
    if meta.max_rank == 0:
        out.zero_()
        return
    sb = _batch(meta, x, batched)
    if sb is not None:
        slot_batch.shrink(out, x, lora_a, sb, scale)
        return
    out.zero_()
    r_full, r_out = lora_a.shape[1], out.shape[1]
    a_t = lora_a.mT  # [L, K, R] view: a_t[slot] is a BLAS-ready transposed operand
    lens = meta.seg_len_list
    for xs, os, slot, rank in zip(
        x.split_with_sizes(lens), out.split_with_sizes(lens), meta.seg_slot_list, meta.seg_rank_list,
        strict=True,
    ):  # fmt: skip
        if rank == 0:  # base segment (slot -1) or empty slot: rows stay 0
            continue
        r = min(rank, r_out, r_full)
        torch.mm(xs, a_t[slot] if r == r_full else a_t[slot, :, :r], out=os if r == r_out else os[:, :r])
    if scale != 1.0:
        out.mul_(scale)


def sgmv_expand(
    out: Tensor, y: Tensor, lora_b: Tensor, meta: LoraMeta, add: bool = True, *, batched: bool | None = None
) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[s, :, :R_in].T per segment with s >= 0; base rows untouched."""
    if add and meta.max_rank == 0:
        return
    sb = _batch(meta, y, batched) if meta.max_rank else None
    if sb is not None:
        slot_batch.expand(out, y, lora_b, sb, add)
        return
    r_full = lora_b.shape[2]
    r_in = min(y.shape[1], r_full)
    b_t = lora_b.mT  # [L, R, N] view
    lens = meta.seg_len_list
    for ys, os, slot, rank in zip(
        y.split_with_sizes(lens), out.split_with_sizes(lens), meta.seg_slot_list, meta.seg_rank_list,
        strict=True,
    ):  # fmt: skip
        if slot < 0:
            continue
        r = rank if rank < r_in else r_in
        if r == 0:  # rank-0 adapter: its delta is exactly zero
            if not add:
                os.zero_()
            continue
        w = b_t[slot] if r == r_full else b_t[slot, :r]
        if r < ys.shape[1]:
            ys = ys[:, :r]
        if add:
            os.addmm_(ys, w)
        else:
            torch.mm(ys, w, out=os)


def add_lora(
    out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta, *, batched: bool | None = None,
    native: bool = True,
) -> None:
    """out[T, N] += (x[T, K] @ lora_a[s].T) @ lora_b[s].T per token with s >= 0; base rows untouched.

    One [T, max_rank] intermediate buffer for the whole call; per adapter segment one ``mm`` into
    its rank-sliced rows of the buffer and one ``addmm_`` into its rows of ``out``.
    """
    r_full = lora_a.shape[1]
    max_rank = min(meta.max_rank, r_full)
    if max_rank == 0:
        return
    if (
        native and batched is not False and native_kernel.supports(out, x, lora_a, lora_b)
        and (batched or slot_batch.decode_like(meta))
    ):  # fmt: skip
        native_kernel.add_lora(out, x, lora_a, lora_b, meta)
        return
    sb = _batch(meta, x, batched)
    if sb is not None:
        slot_batch.add_lora(out, x, lora_a, lora_b, sb, max_rank)
        return
    lens = meta.seg_len_list
    buf = torch.empty(x.shape[0], max_rank, dtype=x.dtype, device=x.device)
    a_t, b_t = lora_a.mT, lora_b.mT  # [L, K, R], [L, R, N] views
    for xs, hs, os, slot, rank in zip(
        x.split_with_sizes(lens), buf.split_with_sizes(lens), out.split_with_sizes(lens),
        meta.seg_slot_list, meta.seg_rank_list,
        strict=True,
    ):  # fmt: skip
        if rank == 0:
            continue
        if rank >= max_rank:
            r, h = max_rank, hs
        else:
            r, h = rank, hs[:, :rank]
        if r == r_full:
            torch.mm(xs, a_t[slot], out=h)
            os.addmm_(h, b_t[slot])
        else:
            torch.mm(xs, a_t[slot, :, :r], out=h)
            os.addmm_(h, b_t[slot, :r])

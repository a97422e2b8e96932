"""Triton LoRA kernels: SGMV (per segment) and BGMV (per token) shrink/expand, plus add_lora.

Same signatures, shapes and semantics as :mod:`lora_kernels.reference` (see there). Importing this
module imports triton; the package only imports it on demand. Kernels run on CUDA tensors, or on
CPU tensors under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton itself
is first imported in the process (triton reads it when its and our ``@triton.jit`` functions are
decorated) and stay set while launching (tests).

Who calls what: the engine's LoRA layer (``lora_cluster.engine.model.lora_layer``) runs the decode rows
of a step through the BGMV functions when they are mostly distinct adapters (``use_bgmv``), and the
other rows through SGMV: ``add_lora`` per unfused projection, one ``sgmv_shrink`` over stacked A and
an ``sgmv_expand`` per member for the fused q/k/v and gate/up groups.

Kernel design:

* SGMV: one kernel for shrink and expand (``SHRINK``/``ADD`` constexpr flags), one program per
  (segment, block of ``BLOCK_M`` tokens of the segment, block of ``BLOCK_N`` output columns); the
  launch grid comes from ``meta``'s host tuples, so no device sync. The reduction runs over K in
  ``BLOCK_K`` tiles with ``tl.dot``; rank padding beyond the segment's adapter rank is masked out
  of the loads (shrink: columns >= rank are written as 0; expand: the K loop stops at the rank).
  Programs of base segments (slot -1) write zeros (shrink) or return (expand). A segment shorter
  than ``BLOCK_M`` (16, the ``tl.dot`` minimum) still computes a full, row-masked tile.
* BGMV: one kernel for shrink and expand as well, one program per (token, block of output
  columns), reducing with ``tl.sum``: no 16-row tile, so no masked rows for short segments. It has
  not been benchmarked against SGMV.
* Loads are cast to float32 and accumulated in float32; stores cast to ``out``'s dtype. ``tl.dot``
  uses exact ("ieee") float32 products when either operand is float32 (e.g. ``add_lora``'s
  intermediate) and "tf32" when both are fp16/bf16 (their values are exact in tf32). All tensors
  are addressed through their strides, so ``out`` and the inputs may be strided views.
* ``add_lora`` = SGMV shrink into a float32 [T, max_rank] buffer + SGMV expand with ``add=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .meta import LoraMeta

__all__ = ["add_lora", "bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink"]

_BLOCK_M = 16  # tokens per SGMV program (tl.dot needs >= 16)


def _precision(*tensors: Tensor) -> str:
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


@triton.jit
def _sgmv_kernel(
    v_ptr, w_ptr, out_ptr, indptr_ptr, slot_ptr, rank_ptr,
    N, K, scale,
    sv_t, sv_k, sw_l, sw_n, sw_k, so_t, so_n,
    SHRINK: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, n] (+)= scale * sum_k v[t, k] * w[slot, n, k] for the tokens t of one segment.

    Shrink: v = x [T, K], w = lora_a ([L, R, K], n = rank row, N = R_out); rows n >= rank are masked
    to 0, and base segments (slot -1) are written as 0.
    Expand: v = y [T, R_in], w = lora_b ([L, N, R], k = rank column, K = R_in); the reduction stops
    at min(rank, K), and base segments are left untouched.
    """
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(indptr_ptr + pid_s)
    end = tl.load(indptr_ptr + pid_s + 1)
    slot = tl.load(slot_ptr + pid_s)
    rank = tl.load(rank_ptr + pid_s)
    row0 = start + pid_m * BLOCK_M
    if SHRINK:
        writes = row0 < end
        k_end = K
        n_end = rank
    else:
        writes = (row0 < end) & (slot >= 0)
        k_end = tl.minimum(rank, K)
        n_end = N
    if writes:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < end
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if (slot >= 0) & (pid_n * BLOCK_N < n_end):
            w_n_mask = n_mask & (offs_n < n_end)
            w_base = w_ptr + slot.to(tl.int64) * sw_l
            for k0 in range(0, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_end
                v = tl.load(
                    v_ptr + offs_m[:, None].to(tl.int64) * sv_t + offs_k[None, :] * sv_k,
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                w = tl.load(
                    w_base + offs_k[:, None] * sw_k + offs_n[None, :] * sw_n,
                    mask=k_mask[:, None] & w_n_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.dot(v, w, input_precision=PRECISION)
        acc = acc * scale
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * so_t + offs_n[None, :] * so_n
        o_mask = m_mask[:, None] & n_mask[None, :]
        if ADD:
            acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _bgmv_kernel(
    v_ptr, w_ptr, out_ptr, slot_ptr,
    N, K, scale,
    sv_t, sv_k, sw_l, sw_n, sw_k, so_t, so_n,
    SHRINK: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[t, n] (+)= scale * sum_k v[t, k] * w[slot_t, n, k] for one token t.

    Shrink: v = x, w = lora_a ([L, R, K] viewed as n = rank row), base rows written as 0.
    Expand: v = y, w = lora_b ([L, N, R] with k = rank column), base rows untouched.
    """
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    o_ptrs = out_ptr + t.to(tl.int64) * so_t + offs_n * so_n
    if slot >= 0:
        w_base = w_ptr + slot.to(tl.int64) * sw_l
        v_base = v_ptr + t.to(tl.int64) * sv_t
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            v = tl.load(v_base + offs_k * sv_k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(
                w_base + offs_n[:, None] * sw_n + offs_k[None, :] * sw_k,
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(w * v[None, :], axis=1)
        acc = acc * scale
        if ADD:
            acc += tl.load(o_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    elif SHRINK:
        tl.store(o_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=n_mask)


def bgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, token_slot: Tensor, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[slot, :R_out].T per token; base rows = 0."""
    n_tok, k = x.shape
    r_out = out.shape[1]
    if n_tok == 0 or r_out == 0:
        return
    block_n = _pow2(r_out, 16, 64)
    grid = (n_tok, triton.cdiv(r_out, block_n))
    _bgmv_kernel[grid](
        x, lora_a, out, token_slot, r_out, k, float(scale),
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        SHRINK=True, ADD=False, BLOCK_N=block_n, BLOCK_K=_pow2(k, 16, 128),
    )  # fmt: skip


def bgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, token_slot: Tensor, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[slot, :, :R_in].T per token; base rows untouched."""
    n_tok, r_in = y.shape
    n = out.shape[1]
    if n_tok == 0 or n == 0:
        return
    block_n = _pow2(n, 16, 128)
    grid = (n_tok, triton.cdiv(n, block_n))
    _bgmv_kernel[grid](
        y, lora_b, out, token_slot, n, r_in, 1.0,
        y.stride(0), y.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        SHRINK=False, ADD=add, BLOCK_N=block_n, BLOCK_K=_pow2(r_in, 16, 64),
    )  # fmt: skip


def _sgmv(
    out: Tensor,
    v: Tensor,
    w: Tensor,
    meta: LoraMeta,
    k: int,
    scale: float,
    *,
    shrink: bool,
    add: bool,
    block_k: int,
) -> None:
    """Launch :func:`_sgmv_kernel` over ``meta``'s segments.

    out[T, N] (+)= scale * v[T, :k] @ w[s, :N, :k].T per segment of slot s (see the kernel for how
    shrink and expand bound the reduction by the segment's rank and treat base segments).
    """
    n = out.shape[1]
    block_n = _pow2(n, 16, 64)
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, _BLOCK_M), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        v, w, out, meta.seg_indptr, meta.seg_slot, meta.seg_rank, n, k, float(scale),
        v.stride(0), v.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        SHRINK=shrink, ADD=add, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=_precision(v, w),
    )  # fmt: skip


def sgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[s, :R_out].T per segment; base rows = 0."""
    k = x.shape[1]
    if meta.num_segments == 0 or out.shape[1] == 0:
        return
    _sgmv(out, x, lora_a, meta, k, scale, shrink=True, add=False, block_k=_pow2(k, 16, 64))


def sgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, meta: LoraMeta, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[s, :, :R_in].T per segment with s >= 0; base rows untouched."""
    r_in = min(y.shape[1], lora_b.shape[2])
    if meta.num_segments == 0 or out.shape[1] == 0 or (add and meta.max_rank == 0):
        return
    block_k = _pow2(min(r_in, meta.max_rank), 16, 64)
    _sgmv(out, y, lora_b, meta, r_in, 1.0, shrink=False, add=add, block_k=block_k)


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta) -> None:
    """out[T, N] += (x[T, K] @ lora_a[s].T) @ lora_b[s].T per token with s >= 0; base rows untouched."""
    max_rank = min(meta.max_rank, lora_a.shape[1])
    if max_rank == 0:
        return
    h = torch.empty(x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    sgmv_shrink(h, x, lora_a, meta)
    sgmv_expand(out, h, lora_b, meta, add=True)

"""Triton LoRA kernels: SGMV (per segment) and BGMV (per token) shrink/expand, plus add_lora.

Same signatures, shapes and semantics as :mod:`lora_kernels.reference` (see there). Importing this
module imports triton; the package only imports it on demand. Kernels run on CUDA tensors, or on
CPU tensors under the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before triton itself
is first imported in the process (triton reads it when its and our ``@triton.jit`` functions are
decorated) and stay set while launching (tests).

Kernel design:

* SGMV: one program per (segment, block of ``BLOCK_M`` tokens of the segment, block of ``BLOCK_N``
  output columns); the launch grid comes from ``meta``'s host tuples, so no device sync. The
  reduction runs over K in ``BLOCK_K`` tiles with ``tl.dot``; rank padding beyond the segment's
  adapter rank is masked out of the loads (shrink: columns >= rank are written as 0; expand: the
  K loop stops at the rank). Programs of base segments (slot -1) write zeros (shrink) or return
  (expand).
* BGMV: one program per (token, block of output columns), reducing with ``tl.sum``: no 16-row
  minimum tile, best for decode batches where tokens carry different adapters.
* Loads are cast to float32 and accumulated in float32; stores cast to ``out``'s dtype. ``tl.dot``
  uses exact ("ieee") float32 products for float32 data and "tf32" for fp16/bf16 data (their
  values are exact in tf32). All tensors are addressed through their strides, so ``out`` and the
  inputs may be strided views.
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
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, out_ptr, indptr_ptr, slot_ptr, rank_ptr,
    N, K, scale,
    sx_t, sx_k, sa_l, sa_r, sa_k, so_t, so_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, n] = scale * sum_k x[t, k] * a[slot, n, k] for t in one segment; N = R_out."""
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(indptr_ptr + pid_s)
    end = tl.load(indptr_ptr + pid_s + 1)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:
        slot = tl.load(slot_ptr + pid_s)
        rank = tl.load(rank_ptr + pid_s)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < end
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if (slot >= 0) & (pid_n * BLOCK_N < rank):
            a_n_mask = n_mask & (offs_n < rank)
            a_base = a_ptr + slot.to(tl.int64) * sa_l
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                x = tl.load(
                    x_ptr + offs_m[:, None].to(tl.int64) * sx_t + offs_k[None, :] * sx_k,
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                a = tl.load(
                    a_base + offs_k[:, None] * sa_k + offs_n[None, :] * sa_r,
                    mask=k_mask[:, None] & a_n_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.dot(x, a, input_precision=PRECISION)
        acc = acc * scale
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * so_t + offs_n[None, :] * so_r
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, b_ptr, out_ptr, indptr_ptr, slot_ptr, rank_ptr,
    N, R_IN,
    sy_t, sy_r, sb_l, sb_n, sb_r, so_t, so_n,
    ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, n] (+)= sum_{r < min(rank, R_IN)} y[t, r] * b[slot, n, r] for t in one segment."""
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(indptr_ptr + pid_s)
    end = tl.load(indptr_ptr + pid_s + 1)
    slot = tl.load(slot_ptr + pid_s)
    row0 = start + pid_m * BLOCK_M
    if (row0 < end) & (slot >= 0):
        kmax = tl.minimum(tl.load(rank_ptr + pid_s), R_IN)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < end
        n_mask = offs_n < N
        b_base = b_ptr + slot.to(tl.int64) * sb_l
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, kmax, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < kmax
            y = tl.load(
                y_ptr + offs_m[:, None].to(tl.int64) * sy_t + offs_k[None, :] * sy_r,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            b = tl.load(
                b_base + offs_k[:, None] * sb_r + offs_n[None, :] * sb_n,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(y, b, input_precision=PRECISION)
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


def sgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[s, :R_out].T per segment; base rows = 0."""
    k = x.shape[1]
    r_out = out.shape[1]
    if meta.num_segments == 0 or r_out == 0:
        return
    block_n = _pow2(r_out, 16, 64)
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, _BLOCK_M), triton.cdiv(r_out, block_n))
    _sgmv_shrink_kernel[grid](
        x, lora_a, out, meta.seg_indptr, meta.seg_slot, meta.seg_rank, r_out, k, float(scale),
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_pow2(k, 16, 64), PRECISION=_precision(x, lora_a),
    )  # fmt: skip


def sgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, meta: LoraMeta, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[s, :, :R_in].T per segment with s >= 0; base rows untouched."""
    r_in = min(y.shape[1], lora_b.shape[2])
    n = out.shape[1]
    if meta.num_segments == 0 or n == 0 or (add and meta.max_rank == 0):
        return
    block_n = _pow2(n, 16, 64)
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, _BLOCK_M), triton.cdiv(n, block_n))
    _sgmv_expand_kernel[grid](
        y, lora_b, out, meta.seg_indptr, meta.seg_slot, meta.seg_rank, n, r_in,
        y.stride(0), y.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        ADD=add, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_pow2(min(r_in, meta.max_rank), 16, 64),
        PRECISION=_precision(y, lora_b),
    )  # fmt: skip


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta) -> None:
    """out[T, N] += (x[T, K] @ lora_a[s].T) @ lora_b[s].T per token with s >= 0; base rows untouched."""
    max_rank = min(meta.max_rank, lora_a.shape[1])
    if max_rank == 0:
        return
    h = torch.empty(x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    sgmv_shrink(h, x, lora_a, meta)
    sgmv_expand(out, h, lora_b, meta, add=True)

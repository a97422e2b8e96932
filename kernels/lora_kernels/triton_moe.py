"""Triton kernels for the experts of a mixture-of-experts block, with per-token LoRA on them (see
:mod:`lora_kernels.moe_experts` for shapes and semantics; its torch reference is the tests' oracle).

The (token, choice) pairs are sorted by (expert, adapter row) on the host side of the step
(``moe_experts.sort_pairs``: one read of the group counts), so each expert's pairs are contiguous.

* ``_grouped_gemm_kernel``: one program per (tile of ``BLOCK_M`` pairs of one expert, tile of
  ``BLOCK_N`` outputs); the block table names each tile's expert and pair range, so experts no token
  chose launch nothing and no weight is copied. It reads its rows of ``a`` through the pairs' token
  index (gate/up) or in place (down), loads the expert's weight tile in place and accumulates in
  float32 with ``tl.dot`` (IEEE float32 products for float32 inputs, no TF32, so float32 engines
  keep PEFT's tokens); the store casts to the output's dtype.
* ``_lora_shrink_kernel`` / ``_lora_expand_kernel``: per pair, ``a_row @ A[row, e, :rank].T`` in
  float32, then ``out_row += h @ B[row, e, :, :rank].T``, reading each pair's adapter row and expert
  in place (BGMV style over pairs); pairs without an adapter row return at once.

The activation, the routing weights and the sum of each token's choices (``index_add_``) are torch
ops between the launches. Like the other kernels it runs on CPU tensors under ``TRITON_INTERPRET=1``
(tests); the engine uses it on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .moe_pairs import Activation, ExpertLora, expert_spans, pair_groups, sort_pairs

__all__ = ["moe_experts"]

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_index_ptr, w_ptr, out_ptr, table_ptr, num_blocks, n_out, k_in,
    s_a, s_we, s_wn, s_wk, s_o,
    GATHER: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[p, n] = a[src(p)] . w[e, n] for the pairs p of one block (expert e, pairs start:end)."""
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(table_ptr + b).to(tl.int64)
    start = tl.load(table_ptr + num_blocks + b)
    end = tl.load(table_ptr + 2 * num_blocks + b)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    if GATHER:  # noqa: SIM108 (a constexpr branch)
        src = tl.load(a_index_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        src = offs_m.to(tl.int64)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_in
        a_mask = m_mask[:, None] & k_mask[None, :]
        a = tl.load(a_ptr + src[:, None] * s_a + offs_k[None, :], mask=a_mask, other=0.0)
        w = tl.load(w_ptr + e * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * s_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_shrink_kernel(
    a_ptr, a_index_ptr, la_ptr, row_ptr, expert_ptr, h_ptr, k_in, rank,
    s_a, s_ln, s_le, s_lr, s_lk, s_h,
    GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[p, :rank] = a[src(p)] @ la[row(p), e(p), :rank].T in float32 (pairs with an adapter row)."""
    p = tl.program_id(0)
    row = tl.load(row_ptr + p).to(tl.int64)
    if row >= 0:
        e = tl.load(expert_ptr + p).to(tl.int64)
        if GATHER:  # noqa: SIM108 (a constexpr branch)
            src = tl.load(a_index_ptr + p).to(tl.int64)
        else:
            src = p.to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_in
            xv = tl.load(a_ptr + src * s_a + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            la = tl.load(la_ptr + row * s_ln + e * s_le + offs_r[:, None] * s_lr + offs_k[None, :] * s_lk,
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(la * xv[None, :], axis=1)
        tl.store(h_ptr + p.to(tl.int64) * s_h + offs_r, acc, mask=r_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr, lb_ptr, row_ptr, expert_ptr, out_ptr, n_out, rank,
    s_h, s_bn, s_be, s_bo, s_br, s_o,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[p, n] += h[p, :rank] . lb[row(p), e(p), n, :rank] (pairs with an adapter row)."""
    p = tl.program_id(0)
    pn = tl.program_id(1)
    row = tl.load(row_ptr + p).to(tl.int64)
    if row >= 0:
        e = tl.load(expert_ptr + p).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_out
        hv = tl.load(h_ptr + p.to(tl.int64) * s_h + offs_r, mask=r_mask, other=0.0)
        lb = tl.load(lb_ptr + row * s_bn + e * s_be + offs_n[:, None] * s_bo + offs_r[None, :] * s_br,
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        delta = tl.sum(lb * hv[None, :], axis=1)
        out = out_ptr + p.to(tl.int64) * s_o + offs_n
        cur = tl.load(out, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out, (cur + delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def _gemm(out: Tensor, a: Tensor, index: Tensor | None, w: Tensor, table: Tensor) -> None:
    """out [P, N] (contiguous rows) = a[index] @ w[e].T per block of the table (see the kernel)."""
    blocks = table.shape[1]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (blocks, triton.cdiv(out.shape[1], BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, index if index is not None else table, w, out, table, blocks, out.shape[1], a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        GATHER=index is not None, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def _lora(out: Tensor, a: Tensor, index: Tensor | None, la: Tensor, lb: Tensor, rows: Tensor,
          experts: Tensor, rank: int) -> None:  # fmt: skip
    """out[p] += (a[index[p]] @ la[rows[p], experts[p], :rank].T) @ lb[rows[p], experts[p], :, :rank].T."""
    pairs = out.shape[0]
    block_r = max(triton.next_power_of_2(rank), 2)
    h = torch.empty(pairs, rank, dtype=torch.float32, device=a.device)
    _lora_shrink_kernel[(pairs,)](
        a, index if index is not None else rows, la, rows, experts, h, a.shape[1], rank,
        a.stride(0), la.stride(0), la.stride(1), la.stride(2), la.stride(3), h.stride(0),
        GATHER=index is not None, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _lora_expand_kernel[(pairs, triton.cdiv(out.shape[1], BLOCK_N))](
        h, lb, rows, experts, out, out.shape[1], rank,
        h.stride(0), lb.stride(0), lb.stride(1), lb.stride(2), lb.stride(3), out.stride(0),
        BLOCK_R=block_r, BLOCK_N=BLOCK_N,
    )  # fmt: skip


def moe_experts(out: Tensor, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                act: Activation, lora: ExpertLora | None = None) -> None:  # fmt: skip
    """``lora_kernels.moe_experts``'s semantics with the Triton kernels of this module."""
    t, k = ids.shape
    out.zero_()
    if t == 0:
        return
    inter = down.shape[2]
    order, counts, span = sort_pairs(ids, gate_up.shape[0], lora)
    groups = pair_groups(counts, span)
    blocks = [(e, s + j, s + n) for e, s, n in expert_spans(groups) for j in range(0, n, BLOCK_M)]
    table = torch.tensor(blocks, dtype=torch.int32).t().contiguous().to(x.device, non_blocking=True)
    tokens = order // k
    x = x.contiguous()
    h = torch.empty(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    _gemm(h, x, tokens, gate_up, table)
    adapted = lora is not None and lora.rank > 0 and any(row >= 0 for _, row, _, _ in groups)
    if adapted:
        rows = lora.rows.index_select(0, tokens).contiguous()
        experts = ids.reshape(-1).index_select(0, order).contiguous()
        _lora(h, x, tokens, lora.gate_up_a, lora.gate_up_b, rows, experts, lora.rank)
    hidden = (act(h[:, :inter]) * h[:, inter:]).contiguous()
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    _gemm(y, hidden, None, down, table)
    if adapted:
        _lora(y, hidden, None, lora.down_a, lora.down_b, rows, experts, lora.rank)
    scaled = y * weights.reshape(-1).index_select(0, order)[:, None]
    out.index_add_(0, tokens, scaled.to(out.dtype))

"""Triton decode attention that reads a paged KV cache in place (see :mod:`lora_kernels.paged_attention`
for the layout and the signature; the torch reference there is the oracle of the tests).

One program per (decoding sequence, query head). It walks the sequence's blocks through its row of
``block_table`` and keeps an online softmax (running max ``m``, running sum ``l``, accumulator
``acc``) over ``BLOCK_SIZE`` keys at a time, so no gathered copy of the cache is made and memory
traffic is one read of the sequence's keys and values per query head. Loads are cast to float32 and
everything accumulates in float32 (bf16/fp16 caches included); the store casts to ``out``'s dtype.
The head dimension is padded to a power of two with masked loads. Like the other kernels it runs on
CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["paged_decode_attention"]


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr,
    scale, head_dim, group, window, softcap,
    sq_d, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_d, so_h, st_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """out[d, h] = softmax(q[d, h] . K[d, lo:len]^T * scale) @ V[d, lo:len], K/V read through the block
    table; lo = max(0, len - window) (the host passes 2**31 - 1 for no window); scores soft-capped
    when SOFTCAP."""
    d = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + d.to(tl.int64) * sq_d + h * sq_h + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    seq_len = tl.load(lens_ptr + d)
    m = tl.full((), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    lo = tl.maximum(seq_len - window, 0)
    for b in range(lo // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(table_ptr + d.to(tl.int64) * st_d + b).to(tl.int64)
        t_mask = ((b * BLOCK_SIZE + offs_t) < seq_len) & ((b * BLOCK_SIZE + offs_t) >= lo)
        tile_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + block * sk_b + offs_t[:, None] * sk_t + kvh * sk_h + offs_d[None, :],
            mask=tile_mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(t_mask, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(
            v_ptr + block * sv_b + offs_t[:, None] * sv_t + kvh * sv_h + offs_d[None, :],
            mask=tile_mask, other=0.0,
        ).to(tl.float32)  # fmt: skip
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    o = acc / l_sum
    tl.store(out_ptr + d.to(tl.int64) * so_d + h * so_h + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    out: Tensor,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    max_len: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Same contract as the reference (``max_len`` is not needed: each program reads its own length)."""
    n_seq, heads, head_dim = q.shape
    if n_seq == 0:
        return
    for t in (q, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged attention needs a unit stride in the head dimension")
    group = heads // k_cache.shape[2]
    window = int(window) if window else 2**31 - 1
    _paged_decode_kernel[(n_seq, heads)](
        q, k_cache, v_cache, out, block_table, seq_lens, float(scale), head_dim, group, window,
        float(softcap or 1.0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_D=triton.next_power_of_2(head_dim),
        SOFTCAP=bool(softcap),
    )  # fmt: skip

"""Attention of one layer over the paged KV cache, with the layer's sliding window and soft-capping.

Decode rows (one query each, first in the batch) go through the paged decode kernel (the Triton
kernel reading blocks in place on CUDA, a gather + SDPA otherwise), which takes the window and the
soft-cap itself. Each prefill chunk attends over its sequence's gathered blocks: query at absolute
position `p` sees key `j` iff `j <= p` and, with a window `w`, `j > p - w` (transformers'
sliding-window mask, `kv_idx > q_idx - sliding_window`). Without soft-capping the chunk runs
through SDPA; with it, scores are computed explicitly (`cap * tanh(scores * scale / cap)`, then the
mask, then a float32 softmax), as transformers' eager attention does.

Invariant: the KV cache keeps every token of a sequence; a window only narrows what is read, so
a window never changes which blocks a sequence holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lora_kernels.paged_attention import PagedAttentionFn, gather_blocks

from lora_cluster.engine.model.batch import StepBatch


def chunk_mask(ctx_start: int, n: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: which of the first `ctx` keys each of the chunk's `n` queries (positions
    `ctx_start .. ctx_start + n - 1`) attends to."""
    keys = torch.arange(ctx, device=device)[None, :]
    pos = ctx_start + torch.arange(n, device=device)[:, None]
    mask = keys <= pos
    if window:
        mask &= keys > pos - window
    return mask


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float) -> torch.Tensor:  # fmt: skip
    """q [1, heads, n, d], k/v [1, kv_heads, ctx, d], mask [n, ctx] (None: causal from position 0)."""
    if not softcap:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def layer_attention(
    batch: StepBatch, paged: PagedAttentionFn, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
    *, scale: float, window: int | None, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """q [T, heads, head_dim] of the step's tokens -> attention output [T, heads, head_dim]."""
    out = torch.empty_like(q)
    d = batch.num_decodes
    if d:
        extra = {"window": window or 0, "softcap": softcap} if window or softcap else {}
        paged(out[:d], q[:d], k_cache, v_cache, batch.decode_blocks, batch.decode_lens,
              batch.decode_max_len, scale, **extra)  # fmt: skip
    for p in batch.prefills:
        n, ctx = p.end - p.start, p.ctx_start + p.end - p.start
        qp = q[p.start : p.end].transpose(0, 1)[None]
        kp, vp = gather_blocks(k_cache, p.blocks[None], ctx), gather_blocks(v_cache, p.blocks[None], ctx)
        plain = p.ctx_start == 0 and not (window and window < ctx)
        mask = None if plain else chunk_mask(p.ctx_start, n, ctx, window, q.device)
        out[p.start : p.end] = dense_attention(qp, kp, vp, mask, scale, softcap)[0].transpose(0, 1)
    return out

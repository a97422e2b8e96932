"""Decode attention over a paged KV cache: the plain-torch reference and the implementation choice.

Cache layout (one tensor per layer for keys, one for values): ``[num_blocks, block_size, kv_heads,
head_dim]``. A sequence's tokens live in the blocks listed by its row of ``block_table``: token
``p`` is at ``cache[block_table[d, p // block_size], p % block_size]``. Entries of a row past the
sequence's last block may hold any valid block index (they are masked out by ``seq_lens``).

``paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, max_len, scale)``, for
``D`` decoding sequences, one query token each:

* ``q``: [D, heads, head_dim]; ``out``: same shape, written in place;
* ``block_table``: [D, >= ceil(max_len / block_size)] integer; ``seq_lens``: [D] integer, the
  number of cached tokens each query attends to (its own included, >= 1);
* ``max_len``: a host int >= max(seq_lens), so that no implementation has to read the device;
* grouped-query attention: query head ``h`` reads kv head ``h // (heads // kv_heads)``;
* ``window`` (keyword, 0 = none): a sliding window, the query attends to its last ``window`` cached
  tokens only (key ``j`` with ``seq_len - window <= j < seq_len``, as transformers' sliding-window
  mask ``kv_idx > q_idx - window``);
* ``softcap`` (keyword, 0 = none): scores become ``softcap * tanh(scores / softcap)`` after the
  scale and before the softmax (Gemma 2's attention logit soft-capping).

Implementations: ``torch`` (this module: gathers the blocks into a contiguous [D, kv_heads, len,
head_dim] copy and runs ``scaled_dot_product_attention``; the engine's path on CPU) and ``triton``
(:mod:`lora_kernels.triton_paged`: reads the blocks in place; the path on CUDA).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PagedAttentionFn", "get_paged_attention", "paged_decode_attention"]

PagedAttentionFn = Callable[..., None]


def gather_blocks(cache: Tensor, blocks: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of the sequences whose blocks are the rows of ``blocks`` [D, B]:
    [D, kv_heads, length, head_dim] (a copy)."""
    d, bs = blocks.shape[0], cache.shape[1]
    n = -(-length // bs)
    # index_select copies whole blocks (memcpy per block): on CPU ~50x faster than cache[blocks]
    kv = cache.index_select(0, blocks[:, :n].reshape(-1)).view(d, n * bs, cache.shape[2], cache.shape[3])
    return kv[:, :length].transpose(1, 2)


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
    """Reference: softmax(q k^T * scale) v over each sequence's first ``seq_lens[d]`` tokens (the
    last ``window`` of them with a window; scores soft-capped with ``softcap``)."""
    if q.shape[0] == 0:
        return
    k = gather_blocks(k_cache, block_table, max_len)
    v = gather_blocks(v_cache, block_table, max_len)
    pos = torch.arange(max_len, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]
    if window:
        mask &= pos >= seq_lens[:, None] - window
    mask = mask[:, None, None, :]
    if not softcap:
        o = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out.copy_(o[:, :, 0])
        return
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q[:, :, None, :], k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    out.copy_(torch.matmul(probs, v)[:, :, 0])


def get_paged_attention(impl: str, device: torch.device | str) -> PagedAttentionFn:
    """``triton`` (in-place block reads) for ``auto`` on a CUDA device when triton is importable, else
    the torch reference; ``torch`` / ``triton`` force one (ValueError for anything else)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown paged attention impl {impl!r}; valid: auto, torch, triton")
    if impl == "auto":
        cuda = torch.device(device).type == "cuda"
        impl = "triton" if cuda and importlib.util.find_spec("triton") is not None else "torch"
    if impl == "torch":
        return paged_decode_attention
    from .triton_paged import paged_decode_attention as triton_paged

    return triton_paged

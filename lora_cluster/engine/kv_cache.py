"""The engine's KV cache: one slot per running sequence, allocated once at start.

Layout per layer: keys and values are [num_slots, kv_heads, max_len, head_dim], so that a
sequence's cache is a strided view usable by attention without copies, and decodes of all running
sequences can attend in one call over the slot range `[0, span)` with a length mask. The scheduler
hands out the lowest free slot first, which keeps that range short.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store keys/values [T, kv_heads, head_dim] of tokens at (slots[t], positions[t])."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

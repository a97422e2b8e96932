"""The engine's paged KV cache: fixed-size blocks of tokens, handed to sequences as they grow.

Two parts:
* `BlockAllocator`, pure bookkeeping (no tensors): a pool of `num_blocks` blocks of `block_size`
  tokens and, per sequence slot (`Sequence.kv_slot`, one per running sequence), the list of its
  blocks in token order. Token `p` of the sequence in slot `s` lives in block
  `table(s)[p // block_size]` at offset `p % block_size`. Blocks are taken on demand (`grow`) and all
  of a slot's blocks go back at once (`free`) when the sequence finishes or is preempted.
  Invariants: a block belongs to at most one slot; free + held = num_blocks; `grow` either covers
  the requested tokens or changes nothing.
* `PagedKVCache`, the device tensors: per layer, keys and values [num_blocks, block_size, kv_heads,
  head_dim], allocated once at start (`write` scatters a step's keys/values through flat token
  indices, `block * block_size + offset`).

Memory follows actual tokens (a sequence holds ceil(tokens / block_size) blocks, not `max_model_len`
tokens), so more sequences fit in the same bytes; the scheduler preempts (recompute) a running
sequence when a more urgent one needs a block and none is free.
"""

from __future__ import annotations

import torch


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free list of KV blocks and the block table of each sequence slot (see the module docstring)."""

    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token: {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest block first
        self._tables: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def table(self, slot: int) -> list[int]:
        """The blocks of the sequence in `slot`, in token order (the caller must not modify it)."""
        return self._tables[slot]

    def capacity(self, slot: int) -> int:
        """Tokens the slot's blocks hold."""
        return len(self._tables[slot]) * self.block_size

    def tokens_fit(self, slot: int, num_tokens: int) -> int:
        """The most tokens, at most `num_tokens`, that the slot could cover with the free blocks."""
        return min(num_tokens, self.capacity(slot) + len(self._free) * self.block_size)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Make the slot hold at least `num_tokens` tokens; False (nothing taken) if blocks are short."""
        need = blocks_for(num_tokens, self.block_size) - len(self._tables[slot])
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        self._tables[slot].extend(self._free.pop() for _ in range(need))
        return True

    def free(self, slot: int) -> None:
        """Give back every block of the slot."""
        table = self._tables[slot]
        self._free.extend(reversed(table))
        table.clear()


class PagedKVCache:
    """Device tensors of the KV blocks (layout in the module docstring), allocated once."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len

    def write(self, layer: int, flat_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values [T, kv_heads, head_dim] of tokens at `flat_index[t]` (block * size + offset)."""
        self.k[layer].view(-1, *k.shape[1:])[flat_index] = k
        self.v[layer].view(-1, *v.shape[1:])[flat_index] = v

    @staticmethod
    def block_bytes(
        *, num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Device bytes of one block across all layers, keys and values."""
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

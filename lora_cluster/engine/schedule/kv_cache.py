"""The engine's paged KV cache: fixed-size blocks of tokens, handed to sequences as they grow.

Two parts:
* `BlockAllocator`, pure bookkeeping (no tensors): a pool of `num_blocks` blocks of `block_size`
  tokens and, per sequence slot (`Sequence.kv_slot`, one per running sequence), the list of its
  blocks in token order. Token `p` of the sequence in slot `s` lives in block
  `table(s)[p // block_size]` at offset `p % block_size`. Blocks are taken on demand (`grow`) and all
  of a slot's blocks go back at once (`free`) when the sequence finishes or is preempted.
  Invariants: free + idle + held = num_blocks; `grow` either covers the requested tokens or changes
  nothing; a sequence writes only positions >= its computed tokens, so only into blocks it holds alone.
* Prefix caching (with a `PrefixCacheIndex`, `engine.schedule.prefix_cache`): a full block whose tokens are
  all computed gets the key of `replica_policy.prefix_hash` (`commit`); a newly admitted sequence takes the
  longest chain of cached blocks of its tokens (`reuse`), one reference each, and computes only the
  rest. Only full blocks are shared, and `reuse` always leaves at least one token to compute (its
  logits give the next token), which lies past the shared blocks: a shared block is never written,
  so no copy on write is needed. A released cached block stays *idle* with its content; `grow`
  takes blocks without content first, then evicts idle cached blocks least recently used, so
  `num_free_blocks` (free + idle) is what running sequences can get before any is preempted.
* `PagedKVCache`, the device tensors: per layer, keys and values [num_blocks, block_size, kv_heads,
  head_dim], allocated once at start (`write` scatters a step's keys/values through flat token
  indices, `block * block_size + offset`).

Memory follows actual tokens (a sequence holds ceil(tokens / block_size) blocks, not `max_model_len`
tokens), so more sequences fit in the same bytes; the scheduler preempts (recompute) a running
sequence when a more urgent one needs a block and none is free.
"""

from __future__ import annotations

import torch

from lora_cluster.engine.schedule.prefix_cache import PrefixCacheIndex
from lora_cluster.replica_policy.prefix_hash import TokenAt, extend_keys


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free list of KV blocks, their reference counts and the block table of each sequence slot, with
    optional prefix caching (see the module docstring)."""

    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int,
                 prefix_cache: PrefixCacheIndex | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token: {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_cache = prefix_cache  # None: no block is ever shared
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest block first
        self._refs = [0] * num_blocks
        self._tables: list[list[int]] = [[] for _ in range(num_slots)]
        self._roots: list[bytes | None] = [None] * num_slots  # chain root of each slot's sequence
        self._keys: list[list[bytes]] = [[] for _ in range(num_slots)]  # keys of its full blocks so far
        self._committed = [0] * num_slots  # its first blocks already offered to the cache
        self.queried_tokens = 0  # since start: tokens of admitted sequences looked up in the cache
        self.hit_tokens = 0  # since start: of those, tokens found cached (not computed again)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: those without content and the idle cached ones."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache is not None else 0)

    def table(self, slot: int) -> list[int]:
        """The blocks of the sequence in `slot`, in token order (the caller must not modify it)."""
        return self._tables[slot]

    def capacity(self, slot: int) -> int:
        """Tokens the slot's blocks hold."""
        return len(self._tables[slot]) * self.block_size

    def tokens_fit(self, slot: int, num_tokens: int) -> int:
        """The most tokens, at most `num_tokens`, that the slot could cover with the free blocks."""
        return min(num_tokens, self.capacity(slot) + self.num_free_blocks * self.block_size)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Make the slot hold at least `num_tokens` tokens; False (nothing taken) if blocks are short."""
        need = blocks_for(num_tokens, self.block_size) - len(self._tables[slot])
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        self._tables[slot].extend(self._take() for _ in range(need))
        return True

    def _take(self) -> int:
        """A block for new content: one without content, else the least recently used idle cached one."""
        block = self._free.pop() if self._free else self.prefix_cache.evict()  # type: ignore[union-attr]
        self._refs[block] = 1
        return block

    def reuse(self, slot: int, root: bytes, token_at: TokenAt, num_tokens: int, *,
              lookup: bool = True) -> int:
        """Start caching for the sequence just given the empty `slot`, of `num_tokens` tokens whose
        blocks chain from `root`; with `lookup`, attach the longest chain of cached blocks of its
        tokens that leaves at least one token to compute. Returns the tokens those blocks hold (0
        without a prefix cache)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        self._roots[slot] = root
        if not lookup:
            return 0
        keys, table = self._keys[slot], self._tables[slot]
        extend_keys(keys, root, token_at, num_tokens - 1, self.block_size)
        for key in keys:
            block = cache.lookup(key)
            if block is None:
                break
            if self._refs[block] == 0:
                cache.unpark(block)
            self._refs[block] += 1
            table.append(block)
        self._committed[slot] = len(table)
        hit = len(table) * self.block_size
        self.queried_tokens += num_tokens
        self.hit_tokens += hit
        return hit

    def commit(self, slot: int, token_at: TokenAt, num_computed: int) -> None:
        """Offer the slot's full blocks whose `num_computed` first tokens are computed to the cache
        (a block whose key another block already holds stays uncached)."""
        cache, root = self.prefix_cache, self._roots[slot]
        if cache is None or root is None:
            return
        keys, table = self._keys[slot], self._tables[slot]
        extend_keys(keys, root, token_at, num_computed, self.block_size)
        full = min(num_computed // self.block_size, len(table))
        for i in range(self._committed[slot], full):
            cache.add(keys[i], table[i])
        self._committed[slot] = max(self._committed[slot], full)

    def free(self, slot: int) -> None:
        """Give back every block of the slot: a block no other slot holds goes back to the free list,
        or, cached, becomes idle (the slot's last block first, so a chain is evicted from its end)."""
        table, cache = self._tables[slot], self.prefix_cache
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if cache is not None and cache.is_cached(block):
                cache.park(block)
            else:
                self._free.append(block)
        table.clear()
        self._keys[slot].clear()
        self._roots[slot], self._committed[slot] = None, 0

    def prefix_stats(self) -> dict[str, int]:
        """Cumulative prefix cache counters and its size now, for metrics (zeros without a cache)."""
        cache = self.prefix_cache
        return {
            "prefix_cache_queried_tokens": self.queried_tokens, "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_blocks": cache.num_cached if cache is not None else 0,
            "prefix_cache_evictions": cache.evictions if cache is not None else 0,
        }


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

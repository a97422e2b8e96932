"""The prefix cache's index: which KV block holds the content of which key, and which to evict first.

A *cached* block is a full block whose keys and values are valid for a key of `replica_policy.prefix_hash`
(the weights that computed it and every token up to its end). The allocator (`kv_cache.BlockAllocator`)
owns reference counts; this index knows, for cached blocks only:

* `lookup(key)` -> the block holding that key's content, if any (held by sequences or idle);
* the *idle* cached blocks, those no sequence references, in least recently used order. They keep
  their content until the allocator needs a block and its free list (blocks with no content) is
  empty: then `evict` hands out the least recently used idle block and forgets its key. So memory
  taken by the cache is always available to running sequences, and the scheduler, which preempts
  only when the allocator cannot grow a sequence, preempts no one while an idle cached block is left.

Invariants: a key names at most one block and a block has at most one key (the first block that
filled with a content keeps its key; a duplicate computed meanwhile stays unkeyed and goes back to the
free list when released); a block is idle only while it is cached and unreferenced; the index holds at
most as many keys as the pool has blocks. Pure bookkeeping (no torch), driven by one thread.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCacheIndex:
    """key <-> block of the cached blocks, and the LRU order of the idle ones (see the module docstring)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.evictions = 0  # since start: idle cached blocks handed out for other content

    @property
    def num_cached(self) -> int:
        """Blocks holding a keyed content (referenced or idle)."""
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        """Cached blocks no sequence references: evictable."""
        return len(self._idle)

    def lookup(self, key: bytes) -> int | None:
        """The block holding `key`'s content, or None."""
        return self._block_of.get(key)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def add(self, key: bytes, block: int) -> bool:
        """Give a referenced, full, computed block its key; False (nothing changes) when the key already
        names a block or the block already has a key."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def park(self, block: int) -> None:
        """A cached block lost its last reference: idle, the most recently used."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle cached block is referenced again (a sequence reuses it): no longer evictable."""
        del self._idle[block]

    def evict(self) -> int:
        """The least recently used idle block, its key forgotten (the caller refills it); one must be idle."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1
        return block

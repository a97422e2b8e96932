"""One simulated replica's prefix cache: the engine's block cache (`engine.schedule.kv_cache`,
`engine.schedule.prefix_cache`) as bookkeeping over block keys, without the KV itself.

A request carries the engine's content keys of its full blocks (`SimRequest.blocks`: a chain over
the adapter id at its version and every token up to the block, `replica_policy.prefix_hash`), so two
adapters with the same tokens never share a block, and one adapter's requests share the blocks of
their common prefix (chats, `sim.chats`). A request that shares no prefix (the Poisson workload) gets
keys of its own at its first admission (`own_keys`: its id and block number, no other request's), so
it reuses nothing at first, and after a preemption finds what it computed, unless the pool needed
those blocks meanwhile, as the engine's own sequence does (`enable_prefix_caching`, on by default).
The model follows the engine's rules:

* **Admission** (`admit`, at each admission, re-admissions after a preemption included): the request
  takes the longest chain of its blocks that is cached, one reference each, and computes only the
  rest; at least one token is always computed (its logits give the next token), so at most
  `(tokens to compute - 1) // block_size` blocks are reused. Its first admission's figure is the
  request's `cached` (the engine's `num_cached_tokens`).
* **Memory**: the pool has `capacity` blocks. A running request holds its reused blocks and, for the
  rest of its prompt and its answer, private blocks (it reserves them at admission: the model does
  not grow sequences step by step). Cached blocks no request references are *idle*: they keep their
  content until the pool needs a block, then go least recently used first (`evictions`). Idle blocks
  are what the pool gives up; blocks of running requests are never taken, and the replica model
  admits by batch slots, not by blocks, so a pool held entirely by running requests is counted
  (`overcommitted`), not preempted.
* **Keys** (`computed`): when a request's prefill completes, and when it finishes or is preempted,
  its full blocks among the tokens computed so far get their keys, unless the key already names a
  block (a duplicate computed meanwhile stays private, as in the engine).
* **Release** (`release`, at finish or preemption): its blocks become idle, the chain's last block
  first, so a chain is evicted from its end.

Invariants: `used = cached blocks + private blocks of running requests`; after every call, `used <=
capacity` unless no idle block is left; a block's reference count is the number of running requests
holding it; idle blocks are exactly the cached blocks with no reference.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from lora_cluster.sim.workload import BlockKey, SimRequest

OWN_KEY_BITS = 16  # an own key is (request id << OWN_KEY_BITS) + block number


def own_keys(req: SimRequest, block_size: int) -> range:
    """Keys of `req`'s full blocks that no other request has (ints, where a chat's keys are bytes)."""
    blocks = (req.prompt + req.output) // block_size
    if blocks >> OWN_KEY_BITS:
        raise ValueError(f"request {req.rid} of adapter {req.adapter!r} has {blocks} blocks, over the "
                         f"{1 << OWN_KEY_BITS} its own keys can number")
    first = req.rid << OWN_KEY_BITS
    return range(first, first + blocks)


class _Held:
    __slots__ = ("done", "keys", "private")

    def __init__(self, keys: list[BlockKey], private: int):
        self.keys, self.private = keys, private  # the cached blocks it references, its blocks without a key
        self.done = len(keys)  # its first blocks already reused or offered to the cache


class SimPrefixCache:
    """The cached blocks of one replica, their references and the LRU order of the idle ones."""

    def __init__(self, capacity: int, block_size: int):
        if capacity < 1 or block_size < 1:
            raise ValueError(f"a prefix cache needs capacity >= 1 and block_size >= 1, "
                             f"got {capacity} and {block_size}")
        self.capacity, self.block_size = capacity, block_size
        self._refs: dict[BlockKey, int] = {}  # cached block -> running requests holding it
        self._idle: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
        self._held: dict[int, _Held] = {}  # request id -> what it holds
        self._private = 0
        self.queried_tokens = self.hit_tokens = self.evictions = self.overcommitted = 0

    @property
    def used(self) -> int:
        return len(self._refs) + self._private

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many first blocks of `keys` are cached (a query: nothing changes)."""
        n = 0
        for key in keys:
            if key not in self._refs:
                break
            n += 1
        return n

    def admit(self, req: SimRequest) -> None:
        """`req` is admitted with `req.prefill_left` tokens to compute: it reuses its longest cached
        chain (its `prefill_left` drops by the tokens found) and reserves private blocks for the rest;
        a request without keys gets its own (`own_keys`)."""
        bs = self.block_size
        if not req.blocks:
            req.blocks = own_keys(req, bs)
        todo = req.prefill_left  # prompt + tokens generated before a preemption
        usable = req.blocks[:max(0, todo - 1) // bs]
        hit = self.cached_blocks(usable)
        keys = list(usable[:hit])
        for key in keys:
            self._refs[key] += 1
            self._idle.pop(key, None)
        private = max(0, -(-(req.prompt + req.output) // bs) - hit)
        self._held[req.rid] = _Held(keys, private)
        self._private += private
        req.prefill_left = todo - hit * bs
        self.queried_tokens += todo
        self.hit_tokens += hit * bs
        if req.preemptions == 0:
            req.cached = hit * bs
        self._fit()

    def computed(self, req: SimRequest, tokens: int) -> None:
        """The first `tokens` tokens of `req` are computed: its full blocks among them get keys."""
        held = self._held.get(req.rid)
        if held is None:
            return
        refs, full = self._refs, min(tokens // self.block_size, len(req.blocks))
        for i in range(held.done, full):
            key = req.blocks[i]
            if key in refs:  # another request keyed it meanwhile: this block stays private
                continue
            refs[key] = 1
            held.keys.append(key)
            if held.private:
                held.private -= 1
                self._private -= 1
        held.done = max(held.done, full)
        self._fit()

    def release(self, req: SimRequest, tokens: int) -> None:
        """`req` stops (finished or preempted) with `tokens` tokens computed: its keyed blocks go idle."""
        self.computed(req, tokens)
        held = self._held.pop(req.rid, None)
        if held is None:
            return
        self._private -= held.private
        refs, idle = self._refs, self._idle
        for key in reversed(held.keys):  # the chain's last block first: the first to be evicted
            refs[key] -= 1
            if not refs[key]:
                idle[key] = None
                idle.move_to_end(key)

    def _fit(self) -> None:
        while self.used > self.capacity and self._idle:
            key, _ = self._idle.popitem(last=False)
            del self._refs[key]
            self.evictions += 1
        if self.used > self.capacity:
            self.overcommitted += 1

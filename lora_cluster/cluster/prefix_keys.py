"""Routing keys of prompt prefixes: what a replica reports it caches, what the router looks up.

The engine addresses its cached KV blocks by a chain over (adapter id, adapter *version*, tokens)
(`replica_policy.prefix_hash`): the version keeps the cache correct across reloads, but the ingress cannot
know it. Routing needs only a hint, so it uses keys of its own, version-blind:

    key(d) = BLAKE2b-64(adapter id or the base model's mark, token ids [0, d))
             for d = GRAIN, 2 GRAIN, ... up to MAX_DEPTH tokens

A request's prompt of n tokens has the keys of every depth <= n (at most MAX_DEPTH / GRAIN = 64,
shallowest first), computed in one pass over at most MAX_DEPTH tokens (~0.1 ms at the bound). A
replica that ran a prompt keeps a few of them (`summary_keys`): a geometric ladder (GRAIN, 2 GRAIN,
4 GRAIN, ...: prefixes that many prompts share, such as a system prompt, at any length) and the
deepest one (the prompt's own chain: the next turn of a chat extends it). It records them in a
`PrefixSummary` and reports them with its routing stats; the router looks up every key of the
request and takes, per replica, the deepest one it reports (`routing_score.cached_tokens`). So
the next turn of a chat finds the replica of its previous turn to within GRAIN tokens, whatever
the length of the system prompt it shares with other chats.

Invariants:
* The keys depend only on the adapter id and the token ids (deterministic across processes: not
  Python's salted `hash`), so the router and every replica compute the same keys for one prompt.
* A key is a hint, never a correctness input: the engine's versioned keys decide what is reused.
  A reported key may be stale (the engine evicted the blocks, or the adapter was reloaded): the
  request then computes its prefix there, as it would anywhere else.
* `PrefixSummary` holds at most `capacity` keys, the most recently used; reporting it is O(capacity).
* Key i of `routing_keys` is the depth (i + 1) * GRAIN: the position gives the cached length.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

GRAIN = 64  # tokens between two keys of a prompt
MAX_DEPTH = 4096  # tokens: deeper prefixes have no keys of their own
SUMMARY_KEYS = 256  # keys a replica reports (the most recently used)
_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
_BASE = b"\x00base"  # the base model's mark (adapter ids are non-empty text without NUL)


def routing_keys(adapter_id: str | None, tokens: Sequence[int]) -> tuple[str, ...]:
    """The keys of the prefixes of `tokens` every GRAIN tokens up to MAX_DEPTH, shallowest first
    (empty for a prompt shorter than GRAIN, or for ids that are not 32-bit token ids)."""
    depths = range(GRAIN, min(len(tokens), MAX_DEPTH) + 1, GRAIN)
    if not depths:
        return ()
    try:
        ids = array(_TYPECODE, tokens[:depths[-1]])
    except (OverflowError, TypeError):
        return ()
    if sys.byteorder != "little":
        ids.byteswap()
    data = memoryview(ids.tobytes())
    h = blake2b(_BASE if adapter_id is None else b"\x01" + adapter_id.encode(), digest_size=8)
    keys, done = [], 0
    for depth in depths:
        h.update(data[4 * done:4 * depth])
        done = depth
        keys.append(h.copy().hexdigest())
    return tuple(keys)


def cached_depth(prefix: Sequence[str], held: frozenset[str]) -> int:
    """Tokens of the deepest of a request's keys (`prefix`, shallowest first) that are in `held`
    (a replica's reported keys); 0: none."""
    if not held or held.isdisjoint(prefix):
        return 0
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] in held:
            return (i + 1) * GRAIN
    return 0


def summary_keys(keys: Sequence[str]) -> list[str]:
    """What a replica keeps of a prompt's keys: the geometric ladder's depths and the deepest key."""
    kept = [keys[i] for i in range(len(keys)) if (i + 1) & i == 0]  # depths GRAIN * 2^k
    if keys and (len(keys) & (len(keys) - 1)):
        kept.append(keys[-1])
    return kept


class PrefixSummary:
    """A replica's recently used prefix keys, bounded (see the module docstring)."""

    def __init__(self, capacity: int = SUMMARY_KEYS):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[str]) -> None:
        """A prompt with these keys (`routing_keys`) ran here: its `summary_keys` become the most
        recently used (the least recently used ones beyond `capacity` are forgotten)."""
        for key in summary_keys(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def keys(self) -> tuple[str, ...]:
        """The keys to report, least recently used first."""
        return tuple(self._keys)

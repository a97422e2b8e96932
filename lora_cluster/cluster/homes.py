"""An adapter's home: rendezvous hashing of adapters onto replicas, and each adapter's ranking.

`home_score(adapter, replica)` is the rendezvous (highest random weight) score: among any set of
candidates, the one with the highest score is the adapter's home there. `HomeRanks` keeps, per
adapter, every replica id ordered by descending score (ties by id), so that "the adapter's home
among the replicas that satisfy P" is the first replica of the ranking that satisfies P, found
without hashing every candidate again. Rankings hold for one set of replicas: `reset` when it
changes. Bounded: at most `max_ids` replica ids in all, the least recently used adapters' rankings
dropped first. Pure.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

MAX_RANKED_IDS = 1 << 22  # replica ids kept in all rankings (8 bytes each: 32 MiB)
_RANK_BITS = 24  # a ranking's sort key: score << _RANK_BITS | (replicas - place by id), 56 bits at most
_RANK_MASK = (1 << _RANK_BITS) - 1


def home_score(adapter_id: str, replica_id: str) -> int:
    """Rendezvous (highest random weight) hashing: the replica with the highest score among the
    candidates is the adapter's home there. Misses of one adapter thus go to the same replica while
    it can take them, where the next request finds the adapter loaded, instead of loading it on
    every replica in turn; when a replica comes or goes, only its own adapters move. Stable across
    processes (crc32, not Python's salted `hash`)."""
    return zlib.crc32(f"{adapter_id}\0{replica_id}".encode())


def home_seed(adapter_id: str) -> int:
    """The adapter's part of every `home_score` of it: `seeded_score(home_seed(a), r)` equals
    `home_score(a, r)` (crc32 continued), so scoring many replicas for one adapter hashes its id once."""
    return zlib.crc32(f"{adapter_id}\0".encode())


def seeded_score(seed: int, replica_id: str) -> int:
    """`home_score` of the adapter whose `home_seed` is `seed`, at `replica_id`."""
    return zlib.crc32(replica_id.encode(), seed)


class HomeRanks:
    """Per adapter, the replica ids of `ids()` by descending `home_score`, ties by ascending id."""

    def __init__(self, ids: Callable[[], Iterable[str]], max_ids: int = MAX_RANKED_IDS):
        self._ids, self.max_ids = ids, max_ids
        self._ranks: OrderedDict[str, list[str]] = OrderedDict()
        self._kept = 0  # replica ids held in all rankings
        self._sorted: list[str] = []  # the replica ids in ascending order, encoded below (since `reset`)
        self._encoded: list[bytes] = []

    def ranking(self, adapter_id: str) -> list[str]:
        """The adapter's ranking (read-only): built at the first ask after a `reset`."""
        ranks = self._ranks.get(adapter_id)
        if ranks is not None:
            self._ranks.move_to_end(adapter_id)
            return ranks
        if not self._sorted:
            self._sorted = sorted(self._ids())
            self._encoded = [rid.encode() for rid in self._sorted]
        # the same scores as `home_score` (crc32 continued from the adapter's part of the input), each
        # packed with its id's place above it (`_RANK_BITS`), so that one sort of plain ints, descending,
        # orders by score and then by ascending id
        seed, crc32, ids = home_seed(adapter_id), zlib.crc32, self._sorted
        n = len(ids)
        keys = [(crc32(b, seed) << _RANK_BITS) | (n - i) for i, b in enumerate(self._encoded)]
        keys.sort(reverse=True)
        ranks = [ids[n - (key & _RANK_MASK)] for key in keys]
        self._ranks[adapter_id] = ranks
        self._kept += len(ranks)
        while self._kept > self.max_ids and len(self._ranks) > 1:
            self._kept -= len(self._ranks.popitem(last=False)[1])
        return ranks

    def reset(self) -> None:
        """The set of replicas changed: every ranking is rebuilt at its next ask."""
        self._ranks.clear()
        self._kept = 0
        self._sorted, self._encoded = [], []

    def __len__(self) -> int:
        return len(self._ranks)

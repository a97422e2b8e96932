"""Routing by index: the choice of `routing_score.rank_replicas` at a cost that does not grow with
the replica count. Used unchanged by the live request router (`serve.routing.request_router`) and
by the simulator (`sim.routing`).

The full rank builds a `ReplicaView` of every replica (`PlacementTracker.view`) and sorts them by
`rank_key(adapter, view)` for every request. The index keeps instead:

* each replica's view, rebuilt only when something it reads changed: its routing stats
  (`set_stats`, `replace`), a placement recorded there (`record`), or one of its placements
  reaching the tracker's ttl (a heap of expiry times); when only its ongoing count changed
  (`touch`, `recheck`), the view keeps everything else and takes the new count. A rebuild waits
  for the next decision (or `settle`), so a decision reads the views the full rank would build at
  that instant;
* holders: adapter -> the replicas whose view holds it (resident, loading, or recently placed);
* prefix holders: routing key of a prompt prefix (`cluster.prefix_keys`) -> the replicas whose
  view reports it, at most `MAX_KEY_HOLDERS` per key (those that began reporting it last);
* host holders: adapter -> the replicas whose view lists it in their host tier (`ReplicaView.host`),
  at most `MAX_KEY_HOLDERS` per adapter (those that began listing it last);
* a heap of every replica keyed by `rank_key(ABSENT, view)`, and one keyed by `rank_key(None,
  view)` from the first base-model request on; entries are invalidated by a per-replica version
  (lazy deletion, compacted when they pile up).

Why it is exact: for a replica whose view does not hold adapter A (and that the controller's
placement table does not name for A, and whose host tier does not hold A),
`rank_key(A, view) == rank_key(ABSENT, view)`: the cost and every tie-break read only the view,
never A. So the replicas outside A's holders are ordered by the ABSENT heap, and `ranked(A)` =
`rank_replicas` over A's holders, its host holders, the table's replicas for A and the best `spare`
others, cut after the last of those others, is a prefix of `rank_replicas` over
every replica (keys end with the replica id, so they are unique). A base-model request (None)
holds no adapter and is ranked by the None heap alone. A request's prompt prefix (its routing
keys) adds the replicas that report any of them to the candidates: a replica that reports none
gets no prefix bonus, so the same argument holds. Bounds keep the cost per decision independent
of the replica count: a key keeps at most `MAX_KEY_HOLDERS` replicas (those that began reporting it
last), and a decision takes the holders of the request's keys deepest first until it has
`MAX_KEY_HOLDERS` (the deeper the cached prefix, the larger its bonus). So a prefix cached on more
replicas than that (a system prompt everybody caches) is weighed on some of them, the others
ranked as if they lacked it: the index equals the full rank while the request's keys have at most
`MAX_KEY_HOLDERS` holders in all. Likewise an adapter in more host tiers than that is weighed on
the last `MAX_KEY_HOLDERS` to take it (the host tier is a tie-break among equal costs: the others
rank as if their host tier lacked it).

Freshness invariant: the index is exact when every change of a replica's ongoing count is
signalled by `touch` before the next decision. The candidates' counts are re-read at every
decision anyway, so a missed signal can only hide a replica that became better unseen.
Cost per decision: O((holders + placed + 2 MAX_KEY_HOLDERS + spare) log replicas + prefix keys
+ touched replicas since the last).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence

from lora_cluster.cluster.routing_score import (
    PREFIX_SHARE,
    PlacementTracker,
    ReplicaView,
    rank_key,
    rank_replicas,
)
from lora_cluster.cluster.routing_stats import RoutingStats

ABSENT = "\x00absent"  # an adapter id no replica holds (adapter ids cannot contain NUL)
Key = tuple[float, int, bool, bool, int, int, str]
MAX_KEY_HOLDERS = 32  # replicas the index keeps per prefix routing key, and per adapter in host tiers


class RoutingIndex:
    """The replicas one router ranks, indexed by adapter and by rank (see the module docstring)."""

    def __init__(self, *, miss_cost: float, placement_ttl_s: float, clock: Callable[[], float],
                 ongoing: Callable[[str], int], prefix_share: float = PREFIX_SHARE):
        """`clock`: monotonic seconds (placement ages); `ongoing(replica_id)`: its current ongoing count;
        `prefix_share`: the most a cached prefix takes off a replica's cost, as a share of `miss_cost`."""
        self.miss_cost, self._clock, self._ongoing = miss_cost, clock, ongoing
        self.prefix_share = prefix_share
        self.tracker = PlacementTracker(ttl_s=placement_ttl_s)
        self.stats: dict[str, RoutingStats] = {}
        self.views: dict[str, ReplicaView] = {}
        self.holders: dict[str, set[str]] = {}  # adapter -> replicas whose view holds it
        self.prefix_holders: dict[str, dict[str, None]] = {}  # routing key -> latest replicas reporting it
        self.host_holders: dict[str, dict[str, None]] = {}  # adapter -> latest replicas with it in host
        self._heaps: dict[str | None, list[tuple[Key, int, str]]] = {ABSENT: []}  # None: on first use
        self._version: dict[str, int] = {}  # replica -> its valid heap entries' version (never reused)
        self._versions = 0
        self._dirty: dict[str, None] = {}  # replicas whose view is rebuilt in full
        self._recount: dict[str, None] = {}  # replicas whose ongoing count changed (or may have)
        self._expiry: list[tuple[float, str]] = []  # (when a recorded placement expires, replica)

    def __len__(self) -> int:
        return len(self.stats)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self.stats

    # ----- commands: what changed -----------------------------------------------------------------

    def set_stats(self, replica_id: str, stats: RoutingStats) -> None:
        """A replica's routing stats (a new replica joins the index with its first)."""
        self.stats[replica_id] = stats
        self._dirty[replica_id] = None

    def replace(self, stats: Mapping[str, RoutingStats]) -> None:
        """The whole replica set with its latest stats: replicas not in `stats` are forgotten."""
        for rid in [r for r in self.stats if r not in stats]:
            self._forget(rid)
        for rid, s in stats.items():
            self.set_stats(rid, s)
        self.prune()

    def touch(self, replica_id: str) -> None:
        """The replica's ongoing count changed (or may have)."""
        if replica_id in self.stats:
            self._recount[replica_id] = None

    def recheck(self, replica_id: str) -> None:
        """The replica's ongoing count may have changed unsignalled: read it now, rebuild if it did."""
        view = self.views.get(replica_id)
        if view is not None and self._ongoing(replica_id) != view.ongoing:
            self._recount[replica_id] = None

    def touch_all(self) -> None:
        """Every replica's count may have changed unsignalled (O(replicas) at the next decision)."""
        self._recount.update(dict.fromkeys(self.stats))

    def record(self, replica_id: str, adapter_id: str | None) -> None:
        """A request of `adapter_id` was (or is about to be) sent to `replica_id`."""
        if adapter_id is None or replica_id not in self.stats:
            return
        now = self._clock()
        unchanged = self.tracker.is_recent(replica_id, adapter_id, now)  # the view reads membership only
        self.tracker.record(replica_id, adapter_id, now)
        heapq.heappush(self._expiry, (now + self.tracker.ttl_s, replica_id))
        if not unchanged:
            self._dirty[replica_id] = None

    def settle(self) -> None:
        """Rebuild now the views that changed (the next decision would)."""
        self._rebuild()

    def prune(self) -> None:
        """Forget expired placements and those of departed replicas (now and then)."""
        self.tracker.prune(self.stats, self._clock())

    # ----- queries ----------------------------------------------------------------------------------

    def view(self, replica_id: str, placed: str | None = None) -> ReplicaView:
        """The full rank's view of one replica, now (`placed`: an adapter the table assigns it)."""
        return self.tracker.view(replica_id, self.stats[replica_id], self._ongoing(replica_id),
                                 self._clock(), placed=placed)

    def ranked(self, adapter_id: str | None, placed: Iterable[str] = (), spare: int = 1,
               prefix: Sequence[str] = ()) -> list[str]:
        """Replica ids best first: a prefix of `rank_replicas(adapter_id, every replica's view,
        prefix)` that contains its first choice and at least `spare` replicas outside the adapter's
        and the prefix keys' holders (all replicas when there are not that many). `placed`: the
        controller's table's replicas for this adapter (counted as holding it); `prefix`: the
        request's routing keys. Empty only when the index has no replica."""
        for _ in range(3):  # a re-read count that changed is rebuilt, then ranked again
            self._rebuild()
            ranked, stale = self._rank_candidates(adapter_id, placed, spare, prefix)
            if not stale:
                return ranked
            self._recount.update(dict.fromkeys(stale))
        return ranked

    def choose(self, adapter_id: str | None, placed: Iterable[str] = (),
               prefix: Sequence[str] = ()) -> str | None:
        """The full rank's first choice (None: no replica)."""
        ranked = self.ranked(adapter_id, placed, prefix=prefix)
        return ranked[0] if ranked else None

    # ----- internals --------------------------------------------------------------------------------

    def _rank_candidates(self, adapter_id: str | None, placed: Iterable[str], spare: int,
                         prefix: Sequence[str]) -> tuple[list[str], list[str]]:
        views = self.views
        placed_here = [rid for rid in placed if rid in views]
        holders: set[str] = set()
        if adapter_id is not None:
            holders.update(self.holders.get(adapter_id, ()))
            holders.update(self.host_holders.get(adapter_id, ()))
            holders.update(placed_here)
        cached: set[str] = set()
        for key in reversed(prefix):  # deepest first, until the bound
            cached.update(self.prefix_holders.get(key, ()))
            if len(cached) >= MAX_KEY_HOLDERS:
                break
        holders |= cached
        others = self._best(adapter_id, holders, spare)
        chosen = [views[rid] if adapter_id in views[rid].confirmed else self.view(rid, adapter_id)
                  for rid in placed_here]  # a reported adapter, placed or not, gives the same view
        chosen += [views[rid] for rid in holders.difference(placed_here)]
        chosen += [views[rid] for rid in others]
        stale = [v.replica_id for v in chosen if self._ongoing(v.replica_id) != v.ongoing]
        ranked = rank_replicas(adapter_id, chosen, self.miss_cost, prefix, self.prefix_share)
        if len(others) == spare and spare > 0:  # more replicas rank after the last of the others
            ranked = ranked[:ranked.index(others[-1]) + 1]
        return ranked, stale

    def _best(self, adapter_id: str | None, holders: set[str], n: int) -> list[str]:
        """The `n` replicas outside `holders` that rank first for an adapter they do not hold."""
        if adapter_id is None and None not in self._heaps:
            self._heaps[None] = []
            self._compact(None)
        heap = self._heaps[None if adapter_id is None else ABSENT]
        version, kept = self._version, []
        best: list[str] = []
        while heap and len(best) < n:
            entry = heapq.heappop(heap)
            rid = entry[2]
            if version.get(rid) != entry[1]:
                continue
            kept.append(entry)
            if rid not in holders:
                best.append(rid)
        for entry in kept:
            heapq.heappush(heap, entry)
        return best

    def _rebuild(self) -> None:
        now, expiry = self._clock(), self._expiry
        while expiry and expiry[0][0] <= now:
            rid = heapq.heappop(expiry)[1]
            if rid in self.stats:
                self._dirty[rid] = None
        if not self._dirty and not self._recount:
            return
        for rid in self._dirty:
            old, new = self.views.get(rid), self.view(rid)
            if old is None or (old.adapters is not new.adapters and old.adapters != new.adapters):
                before = frozenset() if old is None else old.adapters
                self._unhold(rid, before - new.adapters)
                for aid in new.adapters - before:
                    self.holders.setdefault(aid, set()).add(rid)
            if old is None or old.prefixes is not new.prefixes:
                _hold_latest(self.prefix_holders, rid, frozenset() if old is None else old.prefixes,
                             new.prefixes)
            if old is None or old.host is not new.host:
                _hold_latest(self.host_holders, rid, frozenset() if old is None else old.host, new.host)
            self._put(rid, new)
        for rid in self._recount:
            old = self.views.get(rid)
            if rid in self._dirty or old is None:
                continue
            ongoing = self._ongoing(rid)
            if ongoing != old.ongoing:
                self._put(rid, dataclasses.replace(old, ongoing=ongoing))
        self._dirty.clear()
        self._recount.clear()
        bound = 8 * len(self.views) + 64
        for key, heap in self._heaps.items():  # ABSENT or None
            if len(heap) > bound:
                self._compact(key)

    def _compact(self, aid: str | None) -> None:
        """The heap for `aid` (ABSENT or None) rebuilt from the current views, one entry each."""
        heap = self._heaps[aid]
        heap[:] = [(rank_key(aid, v, self.miss_cost), self._version[rid], rid)
                   for rid, v in self.views.items()]
        heapq.heapify(heap)

    def _put(self, replica_id: str, view: ReplicaView) -> None:
        self.views[replica_id] = view
        self._versions += 1
        version = self._version[replica_id] = self._versions
        for aid, heap in self._heaps.items():
            heapq.heappush(heap, (rank_key(aid, view, self.miss_cost), version, replica_id))

    def _unhold(self, replica_id: str, adapters: Iterable[str]) -> None:
        for aid in adapters:
            holders = self.holders[aid]
            holders.discard(replica_id)
            if not holders:
                del self.holders[aid]

    def _forget(self, replica_id: str) -> None:
        view = self.views.pop(replica_id, None)
        if view is not None:
            self._unhold(replica_id, view.adapters)
            _hold_latest(self.prefix_holders, replica_id, view.prefixes, frozenset())
            _hold_latest(self.host_holders, replica_id, view.host, frozenset())
        del self.stats[replica_id]
        self._version.pop(replica_id, None)
        self._dirty.pop(replica_id, None)
        self._recount.pop(replica_id, None)


def _hold_latest(index: dict[str, dict[str, None]], replica_id: str, before: frozenset[str],
                 after: frozenset[str]) -> None:
    """The replica's reported keys (prefix keys, or adapters in its host tier) went from `before` to
    `after`: `index` (key -> replicas) follows, each key keeping its latest `MAX_KEY_HOLDERS`."""
    for key in before - after:
        holders = index.get(key)
        if holders is not None:
            holders.pop(replica_id, None)
            if not holders:
                del index[key]
    for key in after - before:
        holders = index.setdefault(key, {})
        holders[replica_id] = None
        if len(holders) > MAX_KEY_HOLDERS:
            del holders[next(iter(holders))]  # the earliest reporter leaves the key's list

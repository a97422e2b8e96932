"""The live request router's decision (`serve.routing.request_router.LoraAffinityRouter.choose_replicas`),
made with the same policy code over the simulated replicas.

The live router builds a `ReplicaView` of every replica (`PlacementTracker.view`: the replica's
last routing stats, its exact ongoing count, this router's recent placements, and, for a replica
the controller's placement table names for the request's adapter, that adapter as held) and takes
the first of `rank_replicas`. The simulator makes the same choice without ranking every replica
for every request, which would cost O(replicas) per request at 256 replicas:

* For a replica that does not hold adapter A (A not in its view's adapters, and not placed there),
  `rank_key(A, view)` equals `rank_key(ABSENT, view)` for an id that no replica holds: the cost and
  every tie-break read only the view, never A. So non-holders are ordered once, in a heap keyed by
  `rank_key(ABSENT, view)`, updated when a replica's view changes.
* The winner is the first of `rank_replicas(A, holders of A + the best non-holder)`.
  `tests/test_cluster_sim.py` checks this against `rank_replicas` over all replicas.

Views are rebuilt lazily: a replica whose ongoing count, routing stats or placements changed, or
one of whose placements reached the tracker's ttl (a heap of expiry times), is marked, and its
view is rebuilt at the next decision, so every decision reads the views the live router would
build at that instant.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from lora_cluster.cluster.routing_score import PlacementTracker, ReplicaView, rank_key, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.sim.replica import SimReplica

ABSENT = "\x00absent"  # an adapter id no replica holds (adapter ids cannot contain NUL)


class AffinityRouting:
    def __init__(self, replicas: Mapping[str, SimReplica], *, miss_cost: float, placement_ttl_s: float,
                 clock: Callable[[], float]):
        self.replicas, self.miss_cost, self._clock = replicas, miss_cost, clock
        self.tracker = PlacementTracker(ttl_s=placement_ttl_s)
        self.stats: dict[str, RoutingStats] = {rid: RoutingStats() for rid in replicas}
        self.placement: Mapping[str, tuple[str, ...]] = {}  # the controller's table, as last fetched
        self.views: dict[str, ReplicaView] = {}
        self.holders: dict[str, set[str]] = {}  # adapter -> replicas whose view holds it
        self._heap: list[tuple[tuple[float, int, bool, int, int, str], int, str]] = []
        self._version: dict[str, int] = {}
        self._dirty: dict[str, None] = dict.fromkeys(replicas)
        self._expiry: list[tuple[float, str]] = []  # (when a recorded placement expires, replica)
        self.decisions = 0

    def changed(self, replica_id: str) -> None:
        """The replica's ongoing count changed."""
        self._dirty[replica_id] = None

    def refresh_stats(self, replica_id: str) -> None:
        """The replica's routing stats arrive (`record_routing_stats`, every routing_stats_period_s)."""
        self.stats[replica_id] = self.replicas[replica_id].routing_stats()
        self._dirty[replica_id] = None

    def prune(self) -> None:
        self.tracker.prune(self.replicas, self._clock())

    def record(self, replica_id: str, adapter_id: str) -> None:
        """A request of `adapter_id` was sent to `replica_id` (`on_request_routed`)."""
        now = self._clock()
        self.tracker.record(replica_id, adapter_id, now)
        heapq.heappush(self._expiry, (now + self.tracker.ttl_s, replica_id))
        self._dirty[replica_id] = None

    def view(self, replica_id: str, placed: str | None = None) -> ReplicaView:
        """The live router's view of one replica, now."""
        return self.tracker.view(replica_id, self.stats[replica_id], self.replicas[replica_id].ongoing,
                                 self._clock(), placed=placed)

    def choose(self, adapter_id: str) -> str:
        """The replica the live router would rank first for a request of `adapter_id`."""
        self.decisions += 1
        self._rebuild()
        placed = self.placement.get(adapter_id, ())
        holders = set(self.holders.get(adapter_id, ())).union(placed)
        views = [self.view(rid, adapter_id) if rid in placed else self.views[rid] for rid in holders]
        best = self._best_other(holders)
        if best is not None:
            views.append(self.views[best])
        choice = rank_replicas(adapter_id, views, self.miss_cost)[0]
        self.record(choice, adapter_id)
        return choice

    def _rebuild(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            self._dirty[heapq.heappop(self._expiry)[1]] = None
        if not self._dirty:
            return
        for rid in self._dirty:
            old = self.views.get(rid)
            new = self.view(rid)
            self.views[rid] = new
            if old is None or old.adapters != new.adapters:
                for aid in (old.adapters - new.adapters) if old is not None else ():
                    holders = self.holders[aid]
                    holders.discard(rid)
                    if not holders:
                        del self.holders[aid]
                for aid in (new.adapters - old.adapters) if old is not None else new.adapters:
                    self.holders.setdefault(aid, set()).add(rid)
            version = self._version.get(rid, 0) + 1
            self._version[rid] = version
            heapq.heappush(self._heap, (rank_key(ABSENT, new, self.miss_cost), version, rid))
        self._dirty.clear()
        if len(self._heap) > 8 * len(self.views) + 64:
            self._heap = [(rank_key(ABSENT, v, self.miss_cost), self._version[rid], rid)
                          for rid, v in self.views.items()]
            heapq.heapify(self._heap)

    def _best_other(self, holders: set[str]) -> str | None:
        """The replica that ranks first among those outside `holders`."""
        heap, skipped, best = self._heap, [], None
        while heap:
            _, version, rid = heap[0]
            if version != self._version[rid]:
                heapq.heappop(heap)
            elif rid in holders:
                skipped.append(heapq.heappop(heap))
            else:
                best = rid
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return best

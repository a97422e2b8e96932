"""The cluster tier and prefetch in the simulator, driven by the live policy code
(`cluster.cluster_tier.ClusterTier`, `cluster.prefetch_plan.PrefetchPlanner`) on the simulated clock.

* A node's fetch of an adapter its own store lacks asks `ClusterTier.choose`: a copy from another
  node (the profile's `peer` cost: node to node at the assumed NIC bandwidth, then the checksum and
  parse on arrival), waiting for a fetch from S3 already in flight on another node, or S3 itself.
  A fetch from S3 publishes the adapter once; a copy adds the node to the holders.
* Prefetch: every `tick_s` the planner ranks the adapters by the demand the replicas saw (the counts
  the live replicas report as `adapter_requests`, summed per tick as the controller sums its reports;
  nothing per request reaches the controller) and hands out S3 fetches into the cluster tier, one
  lane per node (`lanes_per_node`), never on a load worker a live request could take, within
  `bytes_per_s_per_node` times the node count and `max_bytes`. The prefetched adapter lands on the
  fetching node's disk, not in its host memory, and is published. Before any request the planner
  walks the catalog in a shuffled order (the simulator's adapter names are in popularity order, which
  a live cluster does not know).
* What each node reports of the tier (`held_on`): the adapters with a copy on that node, the latest
  it published or copied first, as a live replica reports `cluster_held`; the controller's miss
  choice reads them (`scheduling.choose_replica`).

Not modelled: contention between a node's S3 streams, prefetch included, and its NIC (each fetch runs at
the profile's per-stream figure); node failures (the policy's `node_lost` is unit-tested instead).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass

from lora_cluster.cluster.cluster_tier import ClusterTier, FetchFrom
from lora_cluster.cluster.prefetch_plan import PrefetchPlanner
from lora_cluster.cluster.reports import MAX_REPORTED_CLUSTER
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.profile import MB, ReplicaProfile
from lora_cluster.sim.store import NodeStore

GB = 1 << 30


@dataclass(frozen=True)
class ClusterTierSettings:
    """The simulated cluster tier's bounds (per node, so that they scale with the cluster)."""

    budget_bytes_per_node: int = 8 * GB  # object-store memory for published adapters, per node
    prefetch: bool = True
    lanes_per_node: int = 4  # prefetch fetches at once on one node
    bytes_per_s_per_node: float = 400 * MB  # prefetch bandwidth per node (four S3 streams)
    max_share: float = 0.9  # prefetch fills the cluster tier up to this share of its budget
    tick_s: float = 0.5  # how often the prefetch plan runs (the controller's report period order)
    half_life_s: float = 60.0  # of the demand history


class SimClusterTier:
    def __init__(self, profile: ReplicaProfile, loop: EventLoop, sizes: dict[str, int], catalog: list[str],
                 node_ids: list[str], settings: ClusterTierSettings, seed: int):
        if profile.node_to_node is None:
            raise ValueError(f"profile {profile.name} has no node-to-node cost (tiers.peer)")
        self.profile, self.loop, self.sizes, self.settings = profile, loop, sizes, settings
        budget = settings.budget_bytes_per_node * len(node_ids)
        self.index = ClusterTier(budget, clock=loop.clock)
        shuffled = list(catalog)
        random.Random(seed + 46).shuffle(shuffled)
        rate = settings.bytes_per_s_per_node * len(node_ids)
        self.planner = PrefetchPlanner(shuffled, sizes, bytes_per_s=rate,
                                       max_bytes=int(settings.max_share * budget), clock=loop.clock,
                                       half_life_s=settings.half_life_s)
        self.node_ids = node_ids
        self.lanes: dict[str, int] = dict.fromkeys(node_ids, 0)  # prefetches running per node
        self.prefetching: set[str] = set()
        self.copies_from: dict[tuple[str, str], str] = {}  # (node, adapter) -> holder, copies in progress
        self._counts: Counter[str] = Counter()
        # node -> the adapters it published or copied, latest last (pruned of gone copies past a bound)
        self._on_node: dict[str, OrderedDict[str, None]] = {}
        self.stores: dict[str, NodeStore] = {}  # each node's store, where its prefetches land
        self.prefetched = self.peer_copies = self.waits = 0
        if settings.prefetch:
            loop.at(0.0, self._tick)

    def register(self, node_id: str, store: NodeStore) -> None:
        self.stores[node_id] = store

    def preloaded(self, node_id: str, adapter_ids: list[str]) -> None:
        """`node_id` fetched `adapter_ids` at start (the engine's `preload`): published, as a live
        node's downloads are (the first node to publish one owns it; the others hold copies)."""
        for adapter_id in adapter_ids:
            nbytes = self.sizes[adapter_id]
            if adapter_id in self.index or self.index.claim_publication(adapter_id, nbytes):
                self.index.published_by(adapter_id, node_id, nbytes, sha256="")
                self._copied(node_id, adapter_id)

    def observe(self, adapter_id: str) -> None:
        """A request for `adapter_id` reached a replica (summed until the next tick, as a report)."""
        self._counts[adapter_id] += 1

    def start_fetch(self, node_id: str, adapter_id: str) -> tuple[str, float]:
        """A live fetch of an adapter `node_id`'s store lacks: its tier ("peer" or "s3") and seconds."""
        nbytes = self.sizes[adapter_id]
        peer_s = self.profile.peer_fetch_s(nbytes)
        choice = self.index.choose(adapter_id, node_id, peer_s=peer_s,
                                   source_s=self.profile.fetch_s("s3", nbytes))
        if choice.kind is FetchFrom.SOURCE:
            self.index.source_fetch_started(adapter_id, node_id, choice.seconds)
            return "s3", choice.seconds
        holder = choice.node_id or ""  # a peer or a fetch in flight always names its node
        self.index.copy_started(adapter_id, holder)
        self.copies_from[(node_id, adapter_id)] = holder
        self.peer_copies += 1
        self.waits += choice.kind is FetchFrom.WAIT
        return "peer", choice.seconds

    def fetch_done(self, node_id: str, adapter_id: str, tier: str) -> None:
        if tier == "s3":
            self._from_source(node_id, adapter_id)
        elif tier == "peer":
            holder = self.copies_from.pop((node_id, adapter_id))
            self.index.copy_ended(adapter_id, holder, node_id, ok=True)
            self._copied(node_id, adapter_id)

    def _from_source(self, node_id: str, adapter_id: str) -> None:
        self.index.source_fetch_ended(adapter_id, node_id)
        nbytes = self.sizes[adapter_id]
        if self.index.claim_publication(adapter_id, nbytes):
            self.index.published_by(adapter_id, node_id, nbytes, sha256="")
            self._copied(node_id, adapter_id)

    def _copied(self, node_id: str, adapter_id: str) -> None:
        latest = self._on_node.setdefault(node_id, OrderedDict())
        latest[adapter_id] = None
        latest.move_to_end(adapter_id)
        if len(latest) > 4 * MAX_REPORTED_CLUSTER:  # drop the copies gone, then the oldest
            for gone in [a for a in latest if not self._has_copy(node_id, a)]:
                del latest[gone]
            while len(latest) > 2 * MAX_REPORTED_CLUSTER:
                latest.popitem(last=False)

    def _has_copy(self, node_id: str, adapter_id: str) -> bool:
        entry = self.index.published.get(adapter_id)
        return entry is not None and node_id in entry.copies

    def held_on(self, node_id: str, limit: int = MAX_REPORTED_CLUSTER) -> tuple[str, ...]:
        """The adapters with a cluster-tier copy on `node_id`, at most `limit`, the latest it
        published or copied (least recent first, as a report lists them): O(what it walks)."""
        latest = self._on_node.get(node_id)
        if not latest:
            return ()
        held = itertools.islice((a for a in reversed(latest) if self._has_copy(node_id, a)), limit)
        return tuple(reversed(list(held)))

    # ----- prefetch -------------------------------------------------------------------------

    def _tick(self) -> None:
        if self._counts:
            self.planner.observe(self._counts)
            self._counts = Counter()
        lanes = self.settings.lanes_per_node
        idle = [n for n in self.node_ids if self.lanes[n] < lanes]
        index = self.index
        jobs = self.planner.plan(sum(lanes - self.lanes[n] for n in idle),
                                 skip=lambda a: a in index or a in index.in_flight or a in self.prefetching,
                                 used_bytes=index.bytes)
        for adapter_id in jobs:
            node_id = min(idle, key=lambda n: self.lanes[n])
            seconds = self.profile.fetch_s("s3", self.sizes[adapter_id])
            self.lanes[node_id] += 1
            self.prefetching.add(adapter_id)
            index.source_fetch_started(adapter_id, node_id, seconds)
            self.loop.after(seconds, self._prefetched, node_id, adapter_id)
        self.loop.after(self.settings.tick_s, self._tick)

    def _prefetched(self, node_id: str, adapter_id: str) -> None:
        self.lanes[node_id] -= 1
        self.prefetching.discard(adapter_id)
        self.prefetched += 1
        store = self.stores.get(node_id)
        if store is not None:
            store.disk.put(adapter_id, self.sizes[adapter_id])
        self._from_source(node_id, adapter_id)

    def details(self) -> dict[str, float]:
        """The run's cluster-tier figures (`SimResult.details["cluster_tier"]`)."""
        return {"published": len(self.index.published), "published_gib": self.index.bytes / GB,
                "peer_copies": self.peer_copies, "waited_for_source_fetch": self.waits,
                "prefetched": self.prefetched, "evicted": self.index.evicted}

"""The adapter-affinity routing policy: pure functions over replica stats, no Ray.

A request for adapter A goes to a replica that already holds A (on its device, or loading it) and
has room; otherwise to the replica that can take A most cheaply. Costs are counted in "requests that
would wait": a replica's *queue excess* is how many requests would be ahead of this one beyond its
free batch slots (`ongoing + 1 - max_num_seqs`, at least 0). A replica without A pays `miss_cost`
on top (the load of A), and that again when it has no free adapter slot (A would evict another
adapter, which then misses later). So a hot adapter stays on its replica until that replica's queue
excess exceeds `miss_cost`, and then spills to a second replica, where it becomes a hit too. A
replica in adapter thrash reports a `miss_penalty` from 0 to 1 (`engine.adapters.thrash`: loading
costs it a large share of its step or loader time): a miss there costs
`THRASH_MISS_FACTOR * miss_penalty * miss_cost` more, a soft score, so misses go to a replica that
is not thrashing when one is as good otherwise, and still come here when none is.
A replica whose prefix cache holds the request's prompt prefix (`prefix_keys`: the deepest of
the request's routing keys that the replica reports, `cached_tokens` deep) costs less by
`prefix_bonus` = `prefix_share * miss_cost * log2(1 + tokens / GRAIN) / log2(1 + MAX_DEPTH / GRAIN)`:
deeper prefixes weigh more (each doubling about as much), and the bonus never exceeds
`prefix_share` (0..1, the caller's setting: `RouterConfig.prefix_routing_share`, default
`PREFIX_SHARE`) of a miss cost. So among holders of the adapter with room, the one caching the
prompt's prefix wins (the turns of one chat stay where their earlier turns are cached: sticky
sessions without session ids), but a replica whose queue excess is more than
`prefix_share * miss_cost` above another's loses to it: a cached prefix never keeps traffic on an
overloaded replica. Below the batch slots, where every replica's queue excess is 0, the bonus is
discounted by the replica's `batch_occupancy` (0..1: a full batch costs one queued request; the bonus
never goes below 0), so new chats spread over the replicas caching their system prompt and a chat
leaves a replica whose batch is much fuller than another's that caches most of it. A replica
lacking the adapter stays costlier than a holder at the same load, prefix or not (a miss costs a
full `miss_cost`, the bonus at most one).
Among equal costs the policy prefers, in order: a replica that is not oversubscribed (the distinct
adapters recently sent to it fit in its `max_loras` slots; otherwise its adapters evict each other
and every hit there is a gamble), one whose report confirms the adapter on its device (not just a
recent placement), one that lacks it on its device but holds it in its host tier (`host`: a miss
there copies it from host memory in milliseconds, not from the source in seconds; the controller's
miss choice ranks the host tier the same way, after room and a free slot; a device holder's queue
against a miss elsewhere is already weighed in the cost, and a tie there goes on to the next
rules, so that a hot adapter spills at a tie), fewer ongoing requests, more empty adapter
slots, and the lower id (so that concurrent routers agree).

`PlacementTracker` bridges the gap between a routing decision and the replicas' next stats report
(`record_routing_stats`, every `routing_stats_period_s`): the router records where it sent each
adapter and counts those placements as resident for `ttl_s`, after which the reports are trusted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.prefix_keys import GRAIN, MAX_DEPTH, cached_depth
from lora_cluster.cluster.routing_stats import UNKNOWN_SLOTS, RoutingStats

THRASH_MISS_FACTOR = 2  # a miss on a replica in full adapter thrash costs this many miss_costs more
PREFIX_SHARE = 0.5  # the bonus of a fully cached prefix ladder as a share of miss_cost, by default


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows about one replica."""

    replica_id: str
    ongoing: int  # requests the replica is running or queueing
    max_num_seqs: int  # sequences it decodes together (batch slots)
    empty_adapter_slots: int  # slots a new adapter can take without evicting another
    adapters: frozenset[str]  # adapters resident on its device, loading, or just placed there
    can_allocate: bool = True  # False: every slot is held by running requests (a new adapter waits)
    confirmed: frozenset[str] = frozenset()  # adapters its last report shows on the device or loading
    working_set: int = 0  # distinct adapters recently sent to it
    max_loras: int = 1 << 30  # its adapter slots
    miss_penalty: float = 0.0  # 0..1: the replica's adapter thrash (a miss there is better sent elsewhere)
    prefixes: frozenset[str] = frozenset()  # routing keys of the prompt prefixes its cache holds
    host: frozenset[str] = frozenset()  # adapters its host tier holds (a miss there loads in milliseconds)

    @property
    def oversubscribed(self) -> int:
        return max(0, self.working_set - self.max_loras)


def cached_tokens(prefix: Sequence[str], replica: ReplicaView) -> int:
    """How deep a prefix of the request the replica caches, in tokens: `prefix` is the request's
    routing keys (key i: depth (i + 1) * GRAIN), the deepest one the replica reports counts (0: none)."""
    return cached_depth(prefix, replica.prefixes)


def prefix_bonus(tokens: int, miss_cost: float, share: float = PREFIX_SHARE) -> float:
    """What a cached prefix of `tokens` takes off the cost (at most `share * miss_cost`)."""
    return share * miss_cost * math.log2(1 + min(tokens, MAX_DEPTH) / GRAIN) / _FULL


_FULL = math.log2(1 + MAX_DEPTH / GRAIN)


def batch_occupancy(replica: ReplicaView) -> float:
    """The share of its batch slots a replica fills, 0..1 (a full batch weighs one queued request):
    what a cached prefix's bonus is worth less there. The bonus differs from replica to replica, so
    the tie-break on `ongoing` never comes into play between replicas caching a prompt's prefix;
    without this discount every chat of a hot adapter stays on the replicas that first cached its
    system prompt while their batches have room, however much emptier another holder's is
    (measured in the simulator: up to 1.7x the mean load on one replica). Only a replica caching the
    prefix pays it, so the others rank as for a request without a prefix (`routing_index` relies
    on that)."""
    return min(replica.ongoing, replica.max_num_seqs) / max(1, replica.max_num_seqs)


def adapter_cost(adapter_id: str | None, replica: ReplicaView, miss_cost: float,
                 prefix: Sequence[str] = (), prefix_share: float = PREFIX_SHARE) -> float:
    """Cost of serving `adapter_id` on `replica`, in requests that would wait (lower is better);
    `prefix`: the request's routing keys (`prefix_keys.routing_keys`); `prefix_share`: the most a
    cached prefix takes off, as a share of `miss_cost`."""
    cost = float(max(0, replica.ongoing + 1 - replica.max_num_seqs))
    tokens = cached_tokens(prefix, replica) if prefix else 0
    if tokens:
        cost -= max(0.0, prefix_bonus(tokens, miss_cost, prefix_share) - batch_occupancy(replica))
    if adapter_id is not None and adapter_id not in replica.adapters:
        cost += miss_cost
        if replica.empty_adapter_slots <= 0:  # evicts an adapter, which will miss later
            cost += miss_cost
        if not replica.can_allocate:  # waits until a running request releases a slot
            cost += miss_cost
        cost += THRASH_MISS_FACTOR * replica.miss_penalty * miss_cost  # its loads crowd out its work
    return cost


def rank_key(adapter_id: str | None, replica: ReplicaView, miss_cost: float, prefix: Sequence[str] = (),
             prefix_share: float = PREFIX_SHARE) -> tuple[float, int, bool, bool, int, int, str]:
    """The order of `rank_replicas`: smaller is better (cost, then the tie-breaks of the module docstring)."""
    unconfirmed = adapter_id is not None and adapter_id not in replica.confirmed
    # a miss there copies from host memory; a device holder's advantage is already in its cost
    not_host_only = adapter_id is not None and (adapter_id in replica.adapters
                                                or adapter_id not in replica.host)
    return (adapter_cost(adapter_id, replica, miss_cost, prefix, prefix_share), replica.oversubscribed,
            unconfirmed, not_host_only, replica.ongoing, -replica.empty_adapter_slots, replica.replica_id)


def rank_replicas(adapter_id: str | None, replicas: Iterable[ReplicaView], miss_cost: float,
                  prefix: Sequence[str] = (), prefix_share: float = PREFIX_SHARE) -> list[str]:
    """Replica ids, best first, for a request of `adapter_id` (None = the base model) whose prompt
    has the routing keys `prefix` (a cached prefix weighs up to `prefix_share` of `miss_cost`)."""
    return [r.replica_id for r in sorted(
        replicas, key=lambda r: rank_key(adapter_id, r, miss_cost, prefix, prefix_share))]


@dataclass
class PlacementTracker:
    """Where this router recently sent each adapter (not yet confirmed by a stats report)."""

    ttl_s: float
    _placed: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> adapter -> time
    _last_prune: float = 0.0

    def record(self, replica_id: str, adapter_id: str | None, now: float) -> None:
        if adapter_id is not None:
            self._placed.setdefault(replica_id, {})[adapter_id] = now

    def is_recent(self, replica_id: str, adapter_id: str, now: float) -> bool:
        """`adapter_id` is among `recent(replica_id, now)` (without building the set)."""
        placed_at = self._placed.get(replica_id, {}).get(adapter_id)
        return placed_at is not None and now - placed_at < self.ttl_s

    def recent(self, replica_id: str, now: float) -> set[str]:
        placed = self._placed.get(replica_id, {})
        return {a for a, t in placed.items() if now - t < self.ttl_s}

    def prune(self, live_replicas: Iterable[str], now: float) -> None:
        """Forget dead replicas and expired placements (call now and then; cheap when nothing expired)."""
        live = set(live_replicas)
        for rid in list(self._placed):
            if rid not in live:
                del self._placed[rid]
        if now - self._last_prune < self.ttl_s:
            return
        self._last_prune = now
        for placed in self._placed.values():
            for aid in [a for a, t in placed.items() if now - t >= self.ttl_s]:
                del placed[aid]

    def view(self, replica_id: str, stats: RoutingStats, ongoing: int, now: float,
             placed: str | None = None) -> ReplicaView:
        """Merge a replica's last report (empty `RoutingStats()` before its first) with recent placements.
        `placed`: an adapter the controller's placement table assigns to this replica (it is
        prefetched there, so the policy counts it as held and spreads its requests over its holders)."""
        reported = stats.held
        if placed is not None and placed not in reported:
            reported = reported | {placed}
        recent = self.recent(replica_id, now)
        pending = recent - reported
        empty = stats.empty_adapter_slots  # unknown: its slot count, else one
        if empty is None:
            empty = 1 if stats.max_loras is None else stats.max_loras
        free = 1 if stats.free_adapter_slots is None else stats.free_adapter_slots
        return ReplicaView(
            replica_id=replica_id,
            ongoing=ongoing,
            max_num_seqs=UNKNOWN_SLOTS if stats.max_num_seqs is None else stats.max_num_seqs,  # unknown: room
            empty_adapter_slots=empty - len(pending),
            adapters=reported | pending if pending else reported,
            can_allocate=free > len(pending),
            confirmed=reported,
            working_set=len(recent),
            max_loras=UNKNOWN_SLOTS if stats.max_loras is None else stats.max_loras,
            miss_penalty=stats.miss_penalty,
            prefixes=stats.prefix_set,
            host=stats.host_set,
        )

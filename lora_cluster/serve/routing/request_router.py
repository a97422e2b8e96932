"""The Ray Serve request router of the LoRA replicas: adapter affinity (policy in `affinity`).

Ray creates one `LoraAffinityRouter` per deployment handle, in the process that holds the handle
(the ingress), and calls `choose_replicas` for every call. The router learns

* the request's adapter from the call itself: the first positional argument of `generate` (and of
  its unary twin `complete`) is a `GenerateJob` (`protocol.routing_key`); a `ToReplica` argument
  pins an admin call to one replica;
* each replica's state from its `record_routing_stats` report, which the Serve controller polls every
  `request_routing_stats_period_s` and broadcasts with the replica list (`RunningReplica.routing_stats`);
* its own recent decisions (at choice time, then `on_request_routed`), so that requests for a new
  adapter that arrive between two reports land on the same replica, and so that it knows each
  replica's working set (the distinct adapters it sent there lately);
* queue lengths from Serve's replica queue-length cache (else from the reports); the Ray internals
  this takes are wrapped in `ray_internals`.

It returns every replica as its own rank, best first; Serve takes the first one that has room
(below `max_ongoing_requests`) and backs off and retries when none has.

The latest reports are also published in-process (`replica_tables.replica_stats`) for /metrics and /debug.
Ray pickles this module *by value* into every process that routes, so it keeps no module state.
Placement ages are measured on a monotonic clock (`time.monotonic` unless `initialize_state` is given
another): a wall-clock step, back or forward, neither keeps a placement alive nor expires it early.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lora_cluster.cluster.routing_score import PlacementTracker, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import serve_defaults
from lora_cluster.serve.ops.ray_internals import cached_queue_len, deployment_key
from lora_cluster.serve.protocol import ToReplica, routing_key
from lora_cluster.serve.routing.replica_tables import placement_table, publish_replica_stats

log = logging.getLogger(__name__)


class LoraAffinityRouter(RequestRouter):
    """Send a request to a replica that holds its adapter and has room, else to the cheapest one."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, miss_cost: float = serve_defaults().router_miss_cost,
                         placement_ttl_s: float = serve_defaults().router_placement_ttl_s,
                         clock: Callable[[], float] = time.monotonic, **_: Any) -> None:
        """Called by Serve with `request_router_kwargs` (from ServeConfig's router_* fields).
        `clock`: seconds on a monotonic clock, for placement ages (a test injects its own)."""
        self._miss_cost = float(miss_cost)
        self._clock = clock
        self._placements = PlacementTracker(ttl_s=float(placement_ttl_s))
        self._stats: dict[str, RoutingStats] = {}  # replica id -> its last report, parsed once

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        stats = {r.replica_id.unique_id: RoutingStats.from_dict(r.routing_stats) for r in replicas}
        self._stats = stats
        self._placements.prune(stats, self._clock())
        publish_replica_stats(*deployment_key(self), stats)

    def _stats_of(self, replica: RunningReplica) -> RoutingStats:
        """The replica's last report, as parsed when Serve broadcast the replica list."""
        parsed = self._stats.get(replica.replica_id.unique_id)
        return parsed if parsed is not None else RoutingStats.from_dict(replica.routing_stats)

    def _ongoing(self, replica: RunningReplica) -> int:
        """Requests on the replica: Serve's queue-length cache (updated on every send, completion and
        rejection), else the replica's last report."""
        cached = cached_queue_len(self, replica.replica_id)
        if cached is not None:
            return cached
        return self._stats_of(replica).ongoing

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter_id, target = None, None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # never spin when all are full
            adapter_id, target = routing_key(pending_request.args)
        if target is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pinned or isinstance(pending_request.args[0], ToReplica):
                return [pinned]  # an admin call waits for its replica; a granted job is not stranded
        now = self._clock()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        placed = set(placement_table(*deployment_key(self)).get(adapter_id, ())) if adapter_id else set()
        views = [self._placements.view(rid, self._stats_of(r), self._ongoing(r), now,
                                       placed=adapter_id if rid in placed else None)
                 for rid, r in by_id.items()]
        ranked = rank_replicas(adapter_id, views, self._miss_cost)
        if ranked:  # tentatively: a concurrent request for the same new adapter should follow it
            self._placements.record(ranked[0], adapter_id, now)
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter_id, _ = routing_key(pending_request.args)
        self._placements.record(replica_id.unique_id, adapter_id, self._clock())

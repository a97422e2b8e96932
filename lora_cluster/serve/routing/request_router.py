"""The Ray Serve request router of the LoRA replicas: adapter affinity (policy in `affinity`).

Ray creates one `LoraAffinityRouter` per deployment handle, in the process that holds the handle
(the ingress), and calls `choose_replicas` for every call. The router learns

* the request's adapter from the call itself: the first positional argument of `generate` (and of
  its unary twin `complete`) is a `GenerateJob` (`protocol.routing_key`); a `ToReplica` argument
  pins an admin call to one replica; and the routing keys of the job's prompt prefix
  (`protocol.routing_prefix`), which the policy weighs against the prefixes each replica reports
  caching (`routing_score.prefix_bonus`);
* each replica's state from its `record_routing_stats` report, which the Serve controller polls every
  `request_routing_stats_period_s` and broadcasts with the replica list (`RunningReplica.routing_stats`);
* its own recent decisions (at choice time, then `on_request_routed`), so that requests for a new
  adapter that arrive between two reports land on the same replica, and so that it knows each
  replica's working set (the distinct adapters it sent there lately);
* queue lengths from Serve's replica queue-length cache (else from the reports); the Ray internals
  this takes are wrapped in `ray_internals` (`QueueLengthListener` signals each change Serve makes).

It ranks by index (`cluster.routing_index.RoutingIndex`: the adapter's holders, the controller's
table's replicas for it and the best `SPARE` others, not every replica) and returns that prefix of
the full rank (`rank_replicas` over every replica), one replica per rank, then every replica as
one last rank. Serve takes the first of the prefix that has room (below `max_ongoing_requests`);
when all of them are full it takes, of the last rank, the replica with the shortest queue that has
room (its own rule), and backs off and retries when none has. So a request is never stranded, and
the cost of a decision does not grow with the replica count. Queue lengths that Serve's probes
write without a signal are re-read for the last prefix at the next decision, and for every replica
after a decision whose prefix was full (Serve then probed the last rank).

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

from lora_cluster.cluster.routing_index import RoutingIndex
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import RouterConfig
from lora_cluster.serve.ops.ray_internals import QueueLengthListener, cached_queue_len, deployment_key
from lora_cluster.serve.protocol import ToReplica, routing_key, routing_prefix
from lora_cluster.serve.routing.replica_tables import placement_table, publish_replica_stats

log = logging.getLogger(__name__)

SPARE = 4  # replicas outside the adapter's holders in the ranked prefix (the first is the full rank's best)


class LoraAffinityRouter(QueueLengthListener, RequestRouter):
    """Send a request to a replica that holds its adapter and has room, else to the cheapest one."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, router: dict[str, Any] | None = None,
                         clock: Callable[[], float] = time.monotonic, **_: Any) -> None:
        """Called by Serve with `request_router_kwargs`: `router` is the config's router section
        (`RouterConfig`, as plain data; None: its defaults). With `prefix_aware_routing` off, requests
        are ranked without their prompt prefix (adapter-only routing). `clock`: seconds on a monotonic
        clock, for placement ages (a test injects its own)."""
        section = RouterConfig.model_validate(router or {})
        self._index = RoutingIndex(miss_cost=section.router_miss_cost,
                                   placement_ttl_s=section.router_placement_ttl_s, clock=clock,
                                   ongoing=self._ongoing, prefix_share=section.prefix_routing_share)
        self._prefix_aware = section.prefix_aware_routing
        self._by_id: dict[str, RunningReplica] = {}
        self._synced: list[RunningReplica] | None = None  # the replica list the index holds
        self._last: list[str] = []  # the last prefix returned (Serve may have probed it)
        self._rescan = False  # the last prefix was full: Serve probed the last rank

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        publish_replica_stats(*deployment_key(self), self._sync(replicas))
        self._index.settle()  # rebuild the views now, not in the next decision

    def _sync(self, replicas: list[RunningReplica]) -> dict[str, RoutingStats]:
        """The index's replicas become `replicas`, with their last reports (O(replicas), once per list)."""
        self._by_id = {r.replica_id.unique_id: r for r in replicas}
        stats = {rid: RoutingStats.from_dict(r.routing_stats) for rid, r in self._by_id.items()}
        self._index.replace(stats)
        self._synced = replicas
        return stats

    def _ensure_synced(self, replicas: list[RunningReplica]) -> None:
        """Serve passes its own list, a copy of the one `update_replicas` got: same replicas, no resync."""
        if replicas is self._synced:
            return
        by_id = self._by_id
        if len(replicas) != len(by_id) or any(by_id.get(r.replica_id.unique_id) is not r for r in replicas):
            self._sync(replicas)
        self._synced = replicas

    def _ongoing(self, replica_id: str) -> int:
        """Requests on the replica: Serve's queue-length cache (updated on every send, completion and
        rejection), else the replica's last report."""
        cached = cached_queue_len(self, self._by_id[replica_id].replica_id)
        if cached is not None:
            return cached
        return self._index.stats[replica_id].ongoing

    def queue_len_changed(self, replica_id: str) -> None:
        self._index.touch(replica_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter_id, target = None, None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # never spin when all are full
            adapter_id, target = routing_key(pending_request.args)
        self._ensure_synced(candidate_replicas)
        index, by_id = self._index, self._by_id
        if target is not None:
            pinned = [by_id[target]] if target in by_id else []
            if pinned or isinstance(pending_request.args[0], ToReplica):
                return [pinned]  # an admin call waits for its replica; a granted job is not stranded
        aware = pending_request is not None and self._prefix_aware
        prefix = routing_prefix(pending_request.args) if aware else ()
        if self._rescan:
            index.touch_all()
        for rid in self._last:
            index.recheck(rid)
        placed = placement_table(*deployment_key(self)).get(adapter_id, ()) if adapter_id else ()
        ranked = index.ranked(adapter_id, placed, spare=SPARE, prefix=prefix)
        if not ranked:
            return []
        index.record(ranked[0], adapter_id)  # tentatively: a concurrent request for a new adapter follows it
        self._last = ranked
        views = index.views
        self._rescan = all(views[rid].ongoing >= by_id[rid].max_ongoing_requests for rid in ranked)
        return [[by_id[rid]] for rid in ranked] + [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        adapter_id, _ = routing_key(pending_request.args)
        self._index.record(replica_id.unique_id, adapter_id)

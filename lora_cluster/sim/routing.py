"""The live request router's decision (`serve.routing.request_router.LoraAffinityRouter.choose_replicas`),
made with the same policy code over the simulated replicas.

The live router ranks through `cluster.routing_index.RoutingIndex` (the adapter's holders, the
controller's table's replicas for it, and the best replicas outside them from a heap keyed by
`rank_key` of an id nobody holds); so does this one, the same class, fed from the simulation:
every change of a replica's ongoing count (`changed`), its routing stats as they arrive
(`refresh_stats`), and every placement (`record`). The choice is the first of the full rank
(`rank_replicas` over every replica's view, as `tests/sim/test_cluster_sim.py` checks). A request's
prompt routing keys (`SimRequest.prefix`, chats only) are ranked with it as the live router ranks
`GenerateJob.routing_prefix`, against the prefixes each replica reports (`SimReplica.prefixes`), with
`RouterConfig.prefix_routing_share`; the policy passes none with `prefix_aware_routing` off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lora_cluster.cluster.routing_index import RoutingIndex
from lora_cluster.cluster.routing_score import PREFIX_SHARE, ReplicaView
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.sim.replica import SimReplica


class AffinityRouting:
    """The simulated ingress's router: one `RoutingIndex` over the simulated replicas."""

    def __init__(self, replicas: Mapping[str, SimReplica], *, miss_cost: float, placement_ttl_s: float,
                 clock: Callable[[], float], prefix_share: float = PREFIX_SHARE):
        self.replicas, self.miss_cost, self.prefix_share = replicas, miss_cost, prefix_share
        self.index = RoutingIndex(miss_cost=miss_cost, placement_ttl_s=placement_ttl_s, clock=clock,
                                  ongoing=lambda rid: replicas[rid].ongoing, prefix_share=prefix_share)
        for rid in replicas:
            self.index.set_stats(rid, RoutingStats())
        self.placement: Mapping[str, tuple[str, ...]] = {}  # the controller's table, as last fetched
        self.decisions = 0

    def changed(self, replica_id: str) -> None:
        """The replica's ongoing count changed."""
        self.index.touch(replica_id)

    def refresh_stats(self, replica_id: str) -> None:
        """The replica's routing stats arrive (`record_routing_stats`, every routing_stats_period_s)."""
        self.index.set_stats(replica_id, self.replicas[replica_id].routing_stats())

    def prune(self) -> None:
        self.index.prune()

    def record(self, replica_id: str, adapter_id: str) -> None:
        """A request of `adapter_id` was sent to `replica_id` (`on_request_routed`)."""
        self.index.record(replica_id, adapter_id)

    def view(self, replica_id: str, placed: str | None = None) -> ReplicaView:
        """The live router's view of one replica, now."""
        return self.index.view(replica_id, placed)

    def choose(self, adapter_id: str, prefix: Sequence[str] = ()) -> str:
        """The replica the live router would rank first for a request of `adapter_id` whose prompt has
        the routing keys `prefix` (empty: ranked by adapter and load alone)."""
        self.decisions += 1
        choice = self.index.choose(adapter_id, self.placement.get(adapter_id, ()), prefix=prefix)
        if choice is None:
            raise RuntimeError("the simulated cluster has no replica")
        self.record(choice, adapter_id)
        return choice

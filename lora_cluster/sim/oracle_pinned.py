"""Our policy with the oracle's placement pinned (`--policy oracle-pinned`), a yardstick, NOT a shipped
policy.

It separates what the oracle (`sim.oracle`) gains by its placement from what it gains by its routing
and queueing: everything is `lora-cluster`'s (the ingress's admission and router, the controller's
queue, grants, preemption and placement, the replicas' eviction), except that before the first
request the adapters the oracle would pin (`oracle.true_placement`: the workload's true popularity,
which no live policy knows) are pinned in the device slots of the replicas it names (`SimReplica.pin`:
no load counted, never evicted nor preempted for a slot). Each replica keeps at least one slot
unpinned, as the oracle's. The router and the controller see the pinned adapters as any other
resident adapter (in the replicas' reports), so requests of a pinned adapter go to its replicas first
by the policy's own rules; a request of another adapter may only take the slots left unpinned, and
waits for one when every unpinned slot of its replica is busy.

What it answers (docs/scale.md, "Pinned placement: the lever, and its price"): how much of the hit
rate between `lora-cluster` and the oracle a protected placement wins back, and what the
protection costs at our capacity at SLO.
"""

from __future__ import annotations

from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.context import SimContext
from lora_cluster.sim.oracle import true_placement


class OraclePinnedPolicy(LoraClusterPolicy):
    """`lora-cluster` with the oracle's placement pinned at start (see the module docstring)."""

    name = "oracle-pinned"

    def __init__(self, ctx: SimContext):
        placement = true_placement(ctx)  # first: a context without the true demand is refused at once
        super().__init__(ctx)
        self.placement = placement

    def start(self) -> None:
        """Pin the oracle's placement in the replicas' device slots, then start as `lora-cluster`."""
        for adapter, replica_ids in self.placement.holders.items():
            for replica_id in replica_ids:
                self.replicas[replica_id].pin(adapter)
        super().start()

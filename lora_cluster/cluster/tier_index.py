"""Where the replicas' reports place adapters off the device: each replica's host tier, and the cluster
tier's copies on each node (`ReplicaReport.host_held`, `cluster_held`), indexed by adapter so that a
miss finds the replicas that read an adapter from host memory or from their node's copy in O(those
replicas), not a walk of the cluster. `ClusterView` keeps one and feeds it every report and forgotten
replica (`follow`). Pure: no clock, no Ray.
"""

from __future__ import annotations

from lora_cluster.cluster.reports import ReplicaReport


class TierIndex:
    """Adapter -> replicas whose host tier holds it; adapter -> replicas reporting its node's cluster
    copy; node -> the replicas whose report names it. Bounded by the reports: one entry per adapter
    some report lists (at most `MAX_REPORTED_HOST` and the cluster tier's per replica)."""

    def __init__(self) -> None:
        self._host: dict[str, set[str]] = {}
        self._cluster: dict[str, set[str]] = {}
        self._on_node: dict[str, set[str]] = {}
        self._node_of: dict[str, str] = {}

    def follow(self, replica_id: str, old: ReplicaReport | None, new: ReplicaReport | None) -> None:
        """The indexes follow the replica's report from `old` to `new` (None: none)."""
        reindex(self._host, replica_id, frozenset() if old is None else old.host_set,
                frozenset() if new is None else new.host_set)
        reindex(self._cluster, replica_id, frozenset() if old is None else old.cluster_set,
                frozenset() if new is None else new.cluster_set)
        if old is None or new is None or old.node_id != new.node_id:  # mostly: its node stays
            reindex(self._on_node, replica_id, frozenset(() if old is None else (old.node_id,)),
                    frozenset(() if new is None else (new.node_id,)))
            if new is None:
                self._node_of.pop(replica_id, None)
            else:
                self._node_of[replica_id] = new.node_id

    def host_holders(self, adapter_id: str) -> frozenset[str] | set[str]:
        """The replicas whose report lists `adapter_id` in their host tier (a miss there copies it from
        host memory, not from the source); read-only."""
        return self._host.get(adapter_id, frozenset())

    def cluster_nodes(self, adapter_id: str) -> set[str]:
        """The nodes where a replica's report lists a cluster-tier copy of `adapter_id`: O(the replicas
        reporting it)."""
        return {self._node_of[rid] for rid in self._cluster.get(adapter_id, ()) if rid in self._node_of}

    def cluster_local(self, adapter_id: str) -> set[str]:
        """The replicas on a node where a cluster-tier copy of `adapter_id` lies (`cluster_nodes`): a
        miss there reads the node's own copy. O(the replicas reporting it + the replicas on those nodes)."""
        out: set[str] = set()
        for node in self.cluster_nodes(adapter_id):
            out.update(self._on_node.get(node, ()))
        return out


def reindex(index: dict[str, set[str]], replica_id: str, before: frozenset[str],
            after: frozenset[str]) -> None:
    """`index` (key -> replicas) follows one replica's keys from `before` to `after`."""
    if before is after or before == after:
        return
    for key in before - after:
        holders = index[key]
        holders.discard(replica_id)
        if not holders:
            del index[key]
    for key in after - before:
        index.setdefault(key, set()).add(replica_id)

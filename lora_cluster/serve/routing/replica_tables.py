"""What this ingress process knows of its replicas, shared between the request router and the dispatcher.

Ray Serve builds the request router inside the ingress process and hands it the replicas' routing
stats; the dispatcher and the admin routes of the same process read them from here, by
(application, deployment). The controller's placement table (hot adapter -> replicas that should
hold it) travels the other way: the ingress fetches it and the router reads it. Both tables are
bounded by the deployments of the process (one entry per deployment, replaced on every update).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from lora_cluster.cluster.routing_stats import RoutingStats

_lock = threading.Lock()
_published: dict[tuple[str, str], dict[str, RoutingStats]] = {}  # (app, deployment) -> replica -> report
_placement: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}  # (app, deployment) -> adapter -> replicas


def publish_replica_stats(app_name: str, deployment: str, stats: dict[str, RoutingStats]) -> None:
    """Called by the request router (in this process) whenever the replica list or a report changes."""
    with _lock:
        _published[(app_name, deployment)] = stats


def replica_stats(app_name: str, deployment: str) -> dict[str, RoutingStats] | None:
    """Last report of every running replica as this process's router sees them; None: no router yet."""
    with _lock:
        stats = _published.get((app_name, deployment))
        return None if stats is None else dict(stats)


def publish_placement(app_name: str, deployment: str, table: Mapping[str, Iterable[str]]) -> None:
    """The controller's placement table (hot adapter -> replicas that should hold it), fetched by the
    ingress; the request router in this process reads it."""
    with _lock:
        _placement[(app_name, deployment)] = {a: tuple(r) for a, r in table.items()}


def placement_table(app_name: str, deployment: str) -> dict[str, tuple[str, ...]]:
    with _lock:
        return _placement.get((app_name, deployment), {})

"""The cluster tier's actors and their lifetime: one index per application, one object holder per node.

* The **index** (`cluster_tier.ClusterTierIndex`) keeps the tier's policy and the refs of the
  published objects; one per application, named `lora_cluster_tier:<app>`.
* A **holder** (`NodeHolder`) per node, named `lora_cluster_tier:<app>:<node id>` and pinned to its
  node, puts what the node's replicas publish into Ray's object store. The holder owns those objects
  (Ray's ownership: an object lives as long as the process that put it), so they do not depend on a
  replica: a replica that Serve replaces (it crashed, or was killed) leaves its node's published
  copies fetchable, and its successor on the node finds the same holder by name. The holder keeps no
  ref of its own once the index has the object: the index's refs alone keep the objects, so an
  eviction (or the index's end) frees them.

Both are detached (a replica creates them, the first caller wins, `get_if_exists`), so nothing that
created them ends them: each runs an `app_watch.AppWatch` and kills itself once its application is
no longer listed by Serve (`serve delete`, `serve shutdown`), which frees every object it holds;
nothing leaks after the application's teardown. Without an application (`app=None`: the tier used
outside Serve, as the live tests' plain actors use it) they are ordinary actors owned by their
creator, unnamed by application, and end with it.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lora_cluster.serve.replica.app_watch import AppWatch, serve_app_exists
from lora_cluster.serve.replica.cluster_tier import ACTOR_NAME, ClusterTierIndex

WATCH_PERIOD_S = 5.0  # how often a detached tier actor asks whether its application still exists


def _end_self() -> None:
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _watched(app: str | None, watch_period_s: float) -> AppWatch | None:
    if app is None:
        return None
    watch = AppWatch(app, serve_app_exists, _end_self, period_s=watch_period_s)
    watch.start()
    return watch


class WatchedIndex(ClusterTierIndex):
    """The index of application `app`, ending when the application does (`app_watch`)."""

    def __init__(self, budget_bytes: int, app: str | None = None, watch_period_s: float = WATCH_PERIOD_S):
        super().__init__(budget_bytes)
        self.watch = _watched(app, watch_period_s)


class NodeHolder:
    """A node's owner of its published objects (see the module docstring)."""

    def __init__(self, node_id: str, app: str | None = None, watch_period_s: float = WATCH_PERIOD_S):
        self.node_id = node_id
        self.watch = _watched(app, watch_period_s)

    def put(self, index: Any, adapter_id: str, files: dict[str, bytes], nbytes: int, digests: dict[str, str],
            form: str) -> None:
        """Put `files` (owned by this holder) and hand the ref to `index`; returns once the index holds it,
        after which this holder keeps no ref of its own."""
        ref = ray.put(files)
        ray.get(index.publish.remote(adapter_id, self.node_id, [ref], nbytes, digests, form))


def index_name(app: str) -> str:
    return f"{ACTOR_NAME}:{app}"


def holder_name(app: str, node_id: str) -> str:
    return f"{ACTOR_NAME}:{app}:{node_id}"


def cluster_tier_actor(budget_bytes: int, app: str | None = None, **options: Any) -> Any:
    """The application's tier index (created by the first caller, found by the others by name; with an
    application, detached and watched); `options` are Ray actor options (e.g. a scheduling strategy)."""
    actor_class = ray.remote(num_cpus=0)(WatchedIndex)
    name, lifetime = (ACTOR_NAME, None) if app is None else (index_name(app), "detached")
    return actor_class.options(name=name, get_if_exists=True, lifetime=lifetime, **options).remote(
        budget_bytes, app)


def node_holder(node_id: str, app: str | None = None, **options: Any) -> Any:
    """The holder of `node_id` (pinned to it; created by the first caller there, found by name after);
    `options` are Ray actor options (e.g. a namespace)."""
    actor_class = ray.remote(num_cpus=0)(NodeHolder)
    name = f"{ACTOR_NAME}:{node_id}" if app is None else holder_name(app, node_id)
    pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return actor_class.options(name=name, get_if_exists=True, lifetime=None if app is None else "detached",
                               scheduling_strategy=pinned, **options).remote(node_id, app)

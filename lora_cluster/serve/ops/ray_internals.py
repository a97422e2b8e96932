"""Every Ray name outside Ray's public API that lora-cluster relies on, in one place.

Checked against Ray 2.60 (`CHECKED_RAY_VERSION`). Nothing else in the project touches a private
Ray name; `tests/serve/test_serve_ray_internals.py` checks each one on the real Ray classes, so a Ray
upgrade that removes or renames one fails that test (naming the attribute) instead of failing at
serving time. Each function says what it reads and why no public API does the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

CHECKED_RAY_VERSION = "2.60"


def deployment_key(router: Any) -> tuple[str, str]:
    """(application name, deployment name) of the deployment a `RequestRouter` routes to.

    Reads `RequestRouter._deployment_id` (a `DeploymentID`, set in `__init__`). Ray 2.60 exposes
    `app_name` publicly but not the deployment's name, which the ingress needs to find the replica
    reports its router publishes (an ingress may hold handles to several deployments).
    """
    deployment_id = router._deployment_id
    return deployment_id.app_name, deployment_id.name


def cached_queue_len(router: Any, replica_id: Any) -> int | None:
    """Serve's cached count of ongoing requests on a replica (None: unknown or stale).

    Reads `RequestRouter.replica_queue_len_cache` (the `ReplicaQueueLengthCache` that Serve updates
    on every send, completion and rejection) and its `get(replica_id)`. The property is public, but
    the cache's type and its `get` live in `ray.serve._private` and are not documented. The
    replicas' own stats reports are up to `request_routing_stats_period_s` old; this cache is what
    Serve itself routes by.
    """
    return router.replica_queue_len_cache.get(replica_id)


@contextlib.contextmanager
def own_request_id() -> Iterator[None]:
    """Give the Serve handle call made inside this block its own internal request id.

    Every call made while handling one HTTP request inherits that request's internal id
    (`ray.serve.context._serve_request_context`, a ContextVar holding a frozen `_RequestContext`
    whose `_internal_request_id` field the handle copies into the call's metadata), and Ray Serve
    2.60's request router indexes pending calls by it: concurrent calls of one request (n > 1,
    several prompts, admin broadcasts) would be mixed up, one fulfilled with another's replica and
    the other never routed. There is no public way to set it. Cancellation is then not left to
    Serve's parent-child tracking, which keys on that id: callers cancel their calls explicitly.
    """
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def serve_root_url() -> str | None:
    """Ray Serve's HTTP address (`http://host:port[root_path]`), None when HTTP is off or unknown.

    Reads `ray.serve.context._get_global_client().root_url` (the controller's `get_root_url`, which
    `serve run` prints itself). No public API tells a replica the address its proxy serves; the ingress
    uses it for its "ready" line. Blocking (it may call the controller): call it off the event loop.
    """
    from ray.serve import context as serve_context

    client = serve_context._get_global_client(raise_if_no_controller_running=False)
    url = None if client is None else client.root_url
    return url or None


def serve_controller_name() -> tuple[str, str]:
    """(actor name, namespace) of Ray Serve's controller actor, the detached actor that keeps the
    applications' state (Serve restarts it when it dies, and it recovers from the GCS).

    Reads `ray.serve._private.constants.SERVE_CONTROLLER_NAME` and `SERVE_NAMESPACE`. No public API
    names the actor; the fault tests kill it (`ray.kill`) to check that a release and its traffic
    live through a restart of Serve's controller.
    """
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return SERVE_CONTROLLER_NAME, SERVE_NAMESPACE


def offline_router(router_cls: type[Any], app_name: str, deployment_name: str = "LoraReplica") -> Any:
    """A `RequestRouter` of `router_cls` built outside Serve, as Serve's handle router builds it
    (tests and benchmarks drive it with replicas of `offline_replica_id`; call its
    `initialize_state` next).

    Ray 2.60's `RequestRouter.__init__` takes a `DeploymentID` and a `DeploymentHandleSource`, both
    in `ray.serve._private.common`: no public constructor makes a router outside a deployment.
    """
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    deployment = DeploymentID(name=deployment_name, app_name=app_name)
    return router_cls(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN,
                      use_replica_queue_len_cache=True)


def offline_replica_id(unique_id: str, app_name: str, deployment_name: str = "LoraReplica") -> Any:
    """A `ReplicaID` (public) of a replica of the deployment `offline_router` routes to; its
    `deployment_id` is the `DeploymentID` of `ray.serve._private.common`."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    return ReplicaID(unique_id=unique_id, deployment_id=DeploymentID(name=deployment_name, app_name=app_name))


class QueueLengthListener:
    """A `RequestRouter` mixin: `queue_len_changed(replica_id)` (its unique id) after every change that
    Serve's handle router makes to the router's queue-length cache through the router's own methods.

    Ray 2.60's `ray.serve._private.router` calls, on the `RequestRouter`: `on_send_request` when it sends
    a request, `decrement_queue_len_cache` when one finishes, `on_new_queue_len_info` with a replica's
    count (its answer to a send under the rejection protocol) and `on_replica_actor_unavailable`
    (the entry is dropped). None of these is documented as a hook for custom routers; a router that
    indexes replicas by their queue length needs them. Serve's own probes (`_probe_queue_lens`) and
    entries aging out (`RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S`) change the cache without any call:
    a router reads those at the replica's next change or at the next replica-list update.
    """

    def queue_len_changed(self, replica_id: str) -> None:
        """Override: the replica's cached queue length changed."""

    def on_send_request(self, replica_id: Any) -> None:
        super().on_send_request(replica_id)  # type: ignore[misc]
        self.queue_len_changed(replica_id.unique_id)

    def decrement_queue_len_cache(self, replica_id: Any) -> None:
        super().decrement_queue_len_cache(replica_id)  # type: ignore[misc]
        self.queue_len_changed(replica_id.unique_id)

    def on_new_queue_len_info(self, replica_id: Any, num_ongoing_requests: int) -> None:
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)  # type: ignore[misc]
        self.queue_len_changed(replica_id.unique_id)

    def on_replica_actor_unavailable(self, replica_id: Any) -> None:
        super().on_replica_actor_unavailable(replica_id)  # type: ignore[misc]
        self.queue_len_changed(replica_id.unique_id)

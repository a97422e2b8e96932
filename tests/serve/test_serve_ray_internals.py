"""The private Ray names that `lora_cluster.serve.ops.ray_internals` relies on still exist and still work.

Checked on the real Ray classes (a `LoraAffinityRouter` built as Serve builds it, Serve's request
context, the handle's request metadata), without starting Ray. When a Ray upgrade removes or renames
one of them, these tests fail with a message naming the attribute and both Ray versions.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect

import pytest
import ray
from ray.serve import context as serve_context
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import ReplicaID, RequestRouter

from lora_cluster.serve.ops.ray_internals import (
    CHECKED_RAY_VERSION,
    cached_queue_len,
    deployment_key,
    offline_replica_id,
    offline_router,
    own_request_id,
    serve_controller_name,
)
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

DEPLOYMENT = DeploymentID(name="LoraReplica", app_name="lora-app")


def broken(what: str) -> str:
    """The failure message: which Ray name changed, in which Ray version, and what to update."""
    return (f"Ray {ray.__version__}: {what} (lora_cluster/serve/ops/ray_internals.py was checked against "
            f"Ray {CHECKED_RAY_VERSION}; update it for this Ray version)")


@pytest.fixture
def router() -> LoraAffinityRouter:
    """The project's router, constructed with the arguments Serve's handle router passes."""
    return LoraAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                              use_replica_queue_len_cache=True)


def test_an_offline_router_is_built_as_serve_builds_one():
    router = offline_router(LoraAffinityRouter, "lora-app")
    assert isinstance(router, LoraAffinityRouter), broken(
        "RequestRouter.__init__ no longer takes deployment_id, handle_source, use_replica_queue_len_cache")
    assert deployment_key(router) == ("lora-app", "LoraReplica"), broken(
        "an offline router no longer routes to the DeploymentID it was given")
    replica = offline_replica_id("r1", "lora-app")
    assert replica == ReplicaID(unique_id="r1", deployment_id=DEPLOYMENT), broken(
        "ReplicaID no longer takes the private DeploymentID as its deployment_id")


def test_request_router_keeps_its_deployment_id(router):
    assert hasattr(router, "_deployment_id"), broken("RequestRouter.__init__ no longer sets `_deployment_id`")
    assert deployment_key(router) == ("lora-app", "LoraReplica"), broken(
        "RequestRouter._deployment_id no longer holds the DeploymentID (`app_name`, `name`) it was given")


def test_request_router_exposes_the_replica_queue_length_cache(router):
    attribute = inspect.getattr_static(RequestRouter, "replica_queue_len_cache", None)
    assert isinstance(attribute, property), broken("RequestRouter has no `replica_queue_len_cache` property")
    replica = ReplicaID(unique_id="r1", deployment_id=DEPLOYMENT)
    assert cached_queue_len(router, replica) is None, broken(
        "RequestRouter.replica_queue_len_cache.get() no longer answers None for an unknown replica")
    router.on_new_queue_len_info(replica, 5)
    assert cached_queue_len(router, replica) == 5, broken(
        "RequestRouter.replica_queue_len_cache.get() no longer returns what on_new_queue_len_info recorded")


def test_serve_request_context_is_a_context_variable_of_a_dataclass_with_an_internal_id():
    assert isinstance(getattr(serve_context, "_serve_request_context", None), contextvars.ContextVar), broken(
        "ray.serve.context has no ContextVar `_serve_request_context`")
    assert callable(getattr(serve_context, "_get_serve_request_context", None)), broken(
        "ray.serve.context has no function `_get_serve_request_context`")
    current = serve_context._get_serve_request_context()
    fields = {f.name for f in dataclasses.fields(current)} if dataclasses.is_dataclass(current) else set()
    assert "_internal_request_id" in fields, broken(
        "ray.serve.context._get_serve_request_context() no longer returns a dataclass with "
        "`_internal_request_id`")


def test_own_request_id_gives_the_block_a_fresh_internal_id_and_restores_the_request_s():
    token = serve_context._serve_request_context.set(
        dataclasses.replace(serve_context._get_serve_request_context(), _internal_request_id="http-request"))
    try:
        with own_request_id():
            inside = serve_context._get_serve_request_context()._internal_request_id
        after = serve_context._get_serve_request_context()._internal_request_id
    finally:
        serve_context._serve_request_context.reset(token)
    assert inside not in ("", "http-request"), broken(
        "setting ray.serve.context._serve_request_context does not change `_internal_request_id`")
    assert after == "http-request", "own_request_id restores the request's own internal id when it ends"


def test_a_handle_call_takes_the_internal_id_that_own_request_id_sets():
    from ray.serve._private.default_impl import get_request_metadata
    from ray.serve._private.handle_options import DynamicHandleOptions, InitHandleOptions

    with own_request_id():
        wanted = serve_context._get_serve_request_context()._internal_request_id
        metadata = get_request_metadata(InitHandleOptions.create(), DynamicHandleOptions())
    assert metadata.internal_request_id == wanted, broken(
        "a handle call's RequestMetadata.internal_request_id no longer comes from "
        "ray.serve.context._serve_request_context's `_internal_request_id`")


def test_the_serve_client_exposes_its_root_url():
    from ray.serve._private.client import ServeControllerClient

    assert callable(getattr(serve_context, "_get_global_client", None)), broken(
        "ray.serve.context has no `_get_global_client`")
    parameters = inspect.signature(serve_context._get_global_client).parameters
    assert "raise_if_no_controller_running" in parameters, broken(
        "`_get_global_client` no longer takes `raise_if_no_controller_running`")
    attribute = inspect.getattr_static(ServeControllerClient, "root_url", None)
    assert isinstance(attribute, property), broken("ServeControllerClient has no `root_url` property")


def test_serve_names_its_controller_actor_in_its_constants():
    name, namespace = serve_controller_name()
    assert isinstance(name, str) and name, broken(
        "ray.serve._private.constants.SERVE_CONTROLLER_NAME is no longer a non-empty actor name")
    assert namespace == "serve", broken(f"Serve's namespace is {namespace!r}, not 'serve'")


def test_serves_handle_router_signals_queue_length_changes_through_the_methods_the_listener_overrides():
    import ray.serve._private.router as handle_router

    from lora_cluster.serve.ops.ray_internals import QueueLengthListener

    source = inspect.getsource(handle_router)
    for name in ("on_send_request", "decrement_queue_len_cache", "on_new_queue_len_info"):
        assert callable(getattr(RequestRouter, name, None)), broken(f"RequestRouter has no `{name}`")
        assert f".{name}" in source, broken(f"ray.serve._private.router no longer calls `{name}`")
        assert name in vars(QueueLengthListener), f"QueueLengthListener signals `{name}`"
    assert callable(getattr(RequestRouter, "on_replica_actor_unavailable", None)), broken(
        "RequestRouter has no `on_replica_actor_unavailable`")


def test_the_router_hears_of_each_queue_length_change(router):
    heard: list[str] = []
    router.queue_len_changed = heard.append
    replica = ReplicaID(unique_id="r1", deployment_id=DEPLOYMENT)
    router.on_new_queue_len_info(replica, 3)
    router.on_send_request(replica)
    router.decrement_queue_len_cache(replica)
    router.on_replica_actor_unavailable(replica)
    assert heard == ["r1"] * 4, "every change Serve makes to a replica's cached queue length is signalled"
    assert cached_queue_len(router, replica) is None, broken(
        "on_replica_actor_unavailable no longer drops the replica's cached queue length")

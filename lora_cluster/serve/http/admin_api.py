"""Operational routes: vLLM's adapter admin, /health, /metrics, /v1/cluster, /debug/replicas.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` registers the adapter on every running
replica; each validates it (a missing path is a 404, an invalid adapter a 400, never a success)
and, if any refuses, it is unregistered from the others. A name is loaded once: loading a name that
is loaded, or that a concurrent call is loading or unloading, is a 409 (see `registrations`). The
ingress remembers the registration and sends the path with each request for that adapter, so a
replica started later registers it on first use; several ingress replicas share their
registrations (`registry`), so what one loads every one serves, refuses to load again, and unloads.
`POST /v1/unload_lora_adapter {"lora_name"}`
undoes it (404 when it was not loaded).

Versions: the first load of a name is its version 1; a load of a loaded name with vLLM's
`load_inplace: true` registers its next version `name@N` (the bare name moves to it); an unload of
`name` unloads every version, of `name@N` that one (`adapter_loads`). A load of a loaded name with
a `release` object (`release_schemas`) releases `lora_path` as its next version instead: the release
route's creation, with the same options (`ReleaseCreator`); the text answer names the version, the
release and its state (`rolled_back` when its eval gate refused the candidate).

With several base models (replica groups on several bases), an adapter registers on the groups of
one base (`GroupedDispatcher.registration_base`: its group's base; a 409 when another base already
lists the id), whose replicas check it against that base; a refusal names the base.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lora_cluster.errors import ControllerOffError, LoraClusterError
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.adapter_loads import AdapterLoads
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.query_values import BOOLEAN, single_values
from lora_cluster.serve.http.release_schemas import CreateReleaseRequest, LoadLoraAdapterRequest
from lora_cluster.serve.http.schemas import UnloadLoraAdapterRequest
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.ops import metrics_exposition
from lora_cluster.serve.routing.auth import Caller, CallerDep


class ReleaseCreator(Protocol):
    """Creates a release as `POST /v1/adapters/{name}/releases` does (`releases_api.ReleaseRoutes`)."""

    async def create_release(self, name: str, req: CreateReleaseRequest,
                             caller: Caller) -> dict[str, Any]: ...


def admin_router(ctx: ApiContext, releases: ReleaseCreator) -> APIRouter:
    """The operational routes of one ingress, on `ctx` (`AdminRoutes`), in the schema's order."""
    routes, router = AdminRoutes(ctx, releases), APIRouter()
    router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                responses=openapi.ADMIN_ACTION)(routes.load_lora_adapter)
    router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                responses=openapi.ADMIN_ACTION)(routes.unload_lora_adapter)
    router.get("/health", responses=openapi.HEALTH)(routes.health)
    router.get("/metrics", response_class=PlainTextResponse)(routes.prometheus_metrics)
    router.get("/v1/cluster", responses=openapi.ADMIN_VIEW)(routes.cluster)
    router.get("/debug/replicas", responses=openapi.ADMIN_VIEW,
               dependencies=[Depends(single_values)])(routes.debug_replicas)
    return router


class AdminRoutes:
    """The handlers of the operational routes over one ingress's `ApiContext` (module docstring).

    A handler's name is its OpenAPI operation's id and summary, its docstring the operation's
    description: renaming one, or editing its docstring, changes the published schema."""

    def __init__(self, ctx: ApiContext, releases: ReleaseCreator):
        self.ctx, self.dispatcher, self.releases = ctx, ctx.dispatcher, releases
        self.loads = AdapterLoads(ctx)

    async def load_lora_adapter(self, req: LoadLoraAdapterRequest, caller: CallerDep) -> Any:
        """Register on every replica, as the name's next version with `load_inplace`, or release it
        as the next version with `release` (module docstring). The name is reserved before the
        broadcast's first await (a concurrent load of it gets a 409) and released if the load fails."""
        if req.release is not None:
            status = await self.releases.create_release(req.lora_name, req.create_request(), caller)
            outcome = "Refused" if status["state"] == "rolled_back" else "Success"
            return PlainTextResponse(f"{outcome}: LoRA adapter '{req.lora_name}' version "
                                     f"{status['candidate_version']} is in release {status['id']} "
                                     f"({status['state']}, {status['percent']:g}% of its traffic).")
        number = await self.loads.load(req.lora_name, req.lora_path, req.load_inplace)
        version = "" if number == 1 else f" as version {number}"
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully{version}.")

    async def unload_lora_adapter(self, req: UnloadLoraAdapterRequest) -> Any:
        """Unregister at once (new requests for it get a 404); the name stays reserved until every
        replica has dropped it, so that a load of the same name cannot interleave. A bare name
        unloads every version of it, `name@N` that version."""
        await self.loads.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def health(self) -> Any:
        """200 when at least one LoRA replica is running and answers; 503 otherwise."""
        try:
            replica = await self.dispatcher.any_replica("ping", timeout_s=5.0)
        except ApiException as exc:
            return JSONResponse(exc.error.body(), status_code=503)
        stats = self.dispatcher.replica_stats() or {}
        return {"status": "ok", "replicas": max(len(stats), 1), "answered": replica}

    async def prometheus_metrics(self) -> Response:
        """Several ingress replicas: the request metrics of all of them (ops.metrics_hub)."""
        if self.ctx.metrics_hub is None:
            return Response(metrics_exposition.render(), media_type=metrics_exposition.CONTENT_TYPE)
        return Response(await self.ctx.metrics_hub.render(), media_type=metrics_exposition.CONTENT_TYPE)

    async def cluster(self) -> dict[str, Any]:
        """The cluster controller's view: nodes -> replicas -> adapters, queues, memory, placement;
        503 when the controller is off or cannot be reached."""
        try:
            return await self.dispatcher.cluster_view()
        except LoraClusterError:
            raise
        except Exception as exc:
            reason = f"the cluster controller cannot be reached: {type(exc).__name__}"
            raise ControllerOffError(reason) from exc

    async def debug_replicas(self, fresh: Annotated[bool, BOOLEAN] = True) -> dict[str, Any]:
        """Every replica's engine state: fresh from each replica, or the router's last reports."""
        if fresh:
            stats = await self.dispatcher.broadcast("stats")
        else:
            stats = {rid: s.to_dict() for rid, s in (self.dispatcher.replica_stats() or {}).items()}
        registered = self.ctx.registrations.snapshot()
        return {"time": time.time(), "replicas": stats, "registered_adapters": registered}

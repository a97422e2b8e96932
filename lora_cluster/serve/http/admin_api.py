"""Operational routes: vLLM's adapter admin, /health, /metrics, /v1/cluster, /debug/replicas.

`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` registers the adapter on every running
replica; each validates it (a missing path is a 404, an invalid adapter a 400, never a success)
and, if any refuses, it is unregistered from the others. A name is loaded once: loading a name that
is loaded, or that a concurrent call is loading or unloading, is a 409 (see `registrations`). The
ingress remembers the registration and sends the path with each request for that adapter, so a
replica started later registers it on first use; several ingress replicas share their
registrations (`registry`), so what one loads every one serves, refuses to load again, and unloads.
`POST /v1/unload_lora_adapter {"lora_name"}`
undoes it (404 when it was not loaded). With several base models (replica groups on several
bases), an adapter registers on the groups of one base (`GroupedDispatcher.registration_base`: its
group's base; a 409 when another base already lists the id), whose replicas check it against that
base; a refusal names the base.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lora_cluster.errors import AdapterError, ControllerOffError, LoraClusterError
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registrations import RegistrationConflict
from lora_cluster.serve.http.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from lora_cluster.serve.http_errors import ApiError, ApiException, bad_request, conflict, not_found
from lora_cluster.serve.ops import metrics_exposition
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher


def admin_router(ctx: ApiContext) -> APIRouter:
    """The operational routes of one ingress, on `ctx` (`AdminRoutes`), in the schema's order."""
    routes, router = AdminRoutes(ctx), APIRouter()
    router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                responses=openapi.ADMIN_ACTION)(routes.load_lora_adapter)
    router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                responses=openapi.ADMIN_ACTION)(routes.unload_lora_adapter)
    router.get("/health", responses=openapi.HEALTH)(routes.health)
    router.get("/metrics", response_class=PlainTextResponse)(routes.prometheus_metrics)
    router.get("/v1/cluster", responses=openapi.ADMIN_VIEW)(routes.cluster)
    router.get("/debug/replicas", responses=openapi.ADMIN_VIEW)(routes.debug_replicas)
    return router


class AdminRoutes:
    """The handlers of the operational routes over one ingress's `ApiContext` (module docstring).

    A handler's name is its OpenAPI operation's id and summary, its docstring the operation's
    description: renaming one, or editing its docstring, changes the published schema."""

    def __init__(self, ctx: ApiContext):
        self.ctx, self.dispatcher = ctx, ctx.dispatcher

    async def load_lora_adapter(self, req: LoadLoraAdapterRequest) -> Any:
        """Register on every replica. The name is reserved before the broadcast's first await (a
        concurrent load of it gets a 400) and released if the load fails."""
        name = req.lora_name
        try:
            check_adapter_id(name)
            await self.ctx.registrations.reserve_load(name)
        except AdapterError as exc:
            raise bad_request(str(exc)) from exc
        except RegistrationConflict as exc:
            raise conflict(str(exc), code=exc.code) from exc
        loaded = False
        dispatcher = self.dispatcher
        grouped = dispatcher if isinstance(dispatcher, GroupedDispatcher) else None
        try:
            base = None if grouped is None else await grouped.registration_base(name)
            if base is None:
                results = await dispatcher.broadcast("register_adapter", name, req.lora_path)
            else:  # several base models: the groups of the adapter's base only
                results = await grouped.broadcast_base(base, "register_adapter", name, req.lora_path)
            await self._undo_if_refused(name, results, base)
            await self.ctx.registrations.complete_load(name, req.lora_path, base)
            if base is not None:
                grouped.catalog.register(base, name)
            loaded = True
        finally:
            if not loaded:
                await self.ctx.registrations.release(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, req: UnloadLoraAdapterRequest) -> Any:
        """Unregister at once (new requests for it get a 404); the name stays reserved until every
        replica has dropped it, so that a load of the same name cannot interleave."""
        name = req.lora_name
        if not await self.ctx.registrations.reserve_unload(name):
            raise not_found(f"the LoRA adapter {name!r} cannot be found", code="adapter_not_found")
        try:
            await self.dispatcher.broadcast("unregister_adapter", name)
            if isinstance(self.dispatcher, GroupedDispatcher):
                self.dispatcher.catalog.unregister(name)
        finally:
            await self.ctx.registrations.release(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

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

    async def debug_replicas(self, fresh: bool = True) -> dict[str, Any]:
        """Every replica's engine state: fresh from each replica, or the router's last reports."""
        if fresh:
            stats = await self.dispatcher.broadcast("stats")
        else:
            stats = {rid: s.to_dict() for rid, s in (self.dispatcher.replica_stats() or {}).items()}
        registered = self.ctx.registrations.snapshot()
        return {"time": time.time(), "replicas": stats, "registered_adapters": registered}

    async def _undo_if_refused(self, name: str, results: dict[str, Any], base: str | None) -> None:
        """When a replica refused the adapter: unregister it from those that took it and raise the
        first refusal (naming the base that refused it, with several bases)."""
        failed = [r["error"] for r in results.values() if "error" in r]
        if not failed:
            return
        for rid, r in results.items():
            if "error" not in r:
                await self.dispatcher.call(rid, "unregister_adapter", name)
        error = ApiError.from_dict(failed[0])
        if base is not None:  # which base refused it, by its API name
            error = dataclasses.replace(error, message=f"{error.message} (registering on base model "
                                        f"{base!r})")
        raise ApiException(error)

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

Versions (`adapter_versions`): the first load of a name is its version 1; a load of a loaded name
with vLLM's `load_inplace: true` registers its next version `name@N` (the bare name moves to it) and
retires the oldest versions beyond `release_versions_kept`. Without `load_inplace` a loaded name is a
409 as in vLLM. An unload of `name` unloads every version of it, of `name@N` that version only.

With several base models (replica groups on several bases), an adapter registers on the groups of
one base (`GroupedDispatcher.registration_base`: its group's base; a 409 when another base already
lists the id), whose replicas check it against that base; a refusal names the base.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lora_cluster.errors import AdapterError, ControllerOffError, LoraClusterError
from lora_cluster.releases.catalog import parse_ref
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.adapter_versions import replica_id_of
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
        """Register on every replica, as the name's next version with `load_inplace` (module
        docstring). The name is reserved before the broadcast's first await (a concurrent load of it
        gets a 409) and released if the load fails."""
        try:
            check_adapter_id(req.lora_name)
        except AdapterError as exc:
            raise bad_request(str(exc)) from exc
        if parse_ref(req.lora_name)[1] is not None:
            raise bad_request(f"{req.lora_name!r}: a load gives the version number; load the bare name "
                              "with load_inplace to create the next version")
        kept = self.ctx.models.versions.versions(req.lora_name)
        if kept and not req.load_inplace:
            raise conflict(f"the LoRA adapter {req.lora_name!r} has already been loaded; load it with "
                           "load_inplace to create its next version", code="already_loaded")
        number = kept[-1] + 1 if kept else 1
        await self._register(replica_id_of(req.lora_name, number), req.lora_path)
        await self._retire(req.lora_name, [*kept, number])
        version = "" if number == 1 else f" as version {number}"
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully{version}.")

    async def _retire(self, name: str, kept: list[int]) -> None:
        """Unload the oldest versions of `name` beyond `release_versions_kept`."""
        excess = len(kept) - self.ctx.config.releases.release_versions_kept
        for number in kept[:max(0, excess)]:
            await self._unregister(replica_id_of(name, number))

    async def _register(self, name: str, path: str) -> None:
        """Register `name` (a replica adapter id) with `path` on every replica of its base."""
        try:
            await self.ctx.registrations.reserve_load(name)
        except RegistrationConflict as exc:
            raise conflict(str(exc), code=exc.code) from exc
        loaded = False
        dispatcher = self.dispatcher
        grouped = dispatcher if isinstance(dispatcher, GroupedDispatcher) else None
        try:
            base = None if grouped is None else await grouped.registration_base(name)
            if base is None:
                results = await dispatcher.broadcast("register_adapter", name, path)
            else:  # several base models: the groups of the adapter's base only
                results = await grouped.broadcast_base(base, "register_adapter", name, path)
            await self._undo_if_refused(name, results, base)
            await self.ctx.registrations.complete_load(name, path, base)
            if base is not None:
                grouped.catalog.register(base, name)
            loaded = True
        finally:
            if not loaded:
                await self.ctx.registrations.release(name)

    async def unload_lora_adapter(self, req: UnloadLoraAdapterRequest) -> Any:
        """Unregister at once (new requests for it get a 404); the name stays reserved until every
        replica has dropped it, so that a load of the same name cannot interleave. A bare name
        unloads every version of it, `name@N` that version."""
        name, number = parse_ref(req.lora_name)
        kept = self.ctx.models.versions.versions(name)
        ids = [replica_id_of(name, n) for n in kept] if number is None else [replica_id_of(name, number)]
        unloaded = [await self._unregister(replica_id) for replica_id in ids]
        if not any(unloaded):
            raise not_found(f"the LoRA adapter {req.lora_name!r} cannot be found", code="adapter_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def _unregister(self, name: str) -> bool:
        """Unregister one replica adapter id from every replica; False when it was not registered."""
        if not await self.ctx.registrations.reserve_unload(name):
            return False
        try:
            await self.dispatcher.broadcast("unregister_adapter", name)
            if isinstance(self.dispatcher, GroupedDispatcher):
                self.dispatcher.catalog.unregister(name)
        finally:
            await self.ctx.registrations.release(name)
        return True

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

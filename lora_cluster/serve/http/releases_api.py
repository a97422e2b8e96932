"""Adapter release routes: `/v1/adapters/{name}/releases` (create, list), `.../{release_id}` (status),
`.../{release_id}/promote|pause|resume|rollback` (commands) and `.../{release_id}/events` (the audit
log with its evidence).

Creating a release loads `lora_path` as the name's next version (`adapter_loads`, as a load in place)
and stages it as the candidate against the version the bare name means now; the bare name keeps
its stable version until the release decides (`releases.book`). The release is registered before the
load, so no request reaches the candidate early, and rolled back if the load fails. Its eval gate
(`release_eval`) then runs the evaluation set on both versions: a candidate more than
`release_eval_margin` below the stable version is rolled back before any client sees it (the answer
says `rolled_back`, with the scores in its `eval_failed` event). With no set, the release enters its
canary at once, and its `eval_passed` event says so. The gate runs at the creating ingress under a
lease in the shared state (`release_gate`): if that ingress dies, another one takes the lease and
runs the gate again. Steps then advance and roll back on live
evidence (`release_traffic`).

Access: an admin key reaches every release; a tenant key the releases of the adapters its patterns
match (another tenant's are a 404, as its adapters are). A tenant creates releases of its own
adapters only (another tenant's name is a 403 naming it), and its candidate must be one of its
adapters in the configured sources (`tenant_candidate`): an adapter id (`fin-v2`, loaded from the
first adapter source) or a location under an adapter source whose id its patterns match; any other
server path or URI is a 403 naming it (a tenant never makes the server read a path of its choosing).

State: every call reads and writes the shared release state first (`release_state.transact`), so
with `release_state_uri` every ingress replica answers the same release, at the same step, and a
restarted ingress resumes it. Without it the state is this ingress's: with several ingress replicas
(shared registrations) a release cannot be created (409), since the others would not follow it.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

from fastapi import APIRouter

from lora_cluster.errors import (
    AdapterError,
    AdapterNotFoundError,
    ReleaseConflictError,
    ReleasePermissionError,
)
from lora_cluster.releases.book import ACTIONS, ReleaseBook
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.adapter_loads import AdapterLoads
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registry import LocalRegistrations
from lora_cluster.serve.http.release_eval import eval_set
from lora_cluster.serve.http.release_gate import ReleaseGate
from lora_cluster.serve.http.release_schemas import CreateReleaseRequest
from lora_cluster.serve.routing.auth import Caller, CallerDep

PREFIX = "/v1/adapters/{name}/releases"


def releases_router(routes: ReleaseRoutes) -> APIRouter:
    """The release routes of one ingress, on its `ReleaseRoutes`."""
    router = APIRouter()
    router.post(PREFIX, responses=openapi.RELEASE_ACTION)(routes.create_release)
    router.get(PREFIX, responses=openapi.RELEASE_VIEW)(routes.list_releases)
    router.get(PREFIX + "/{release_id}", responses=openapi.RELEASE_VIEW)(routes.release_status)
    for action in ACTIONS:
        router.post(PREFIX + "/{release_id}/" + action, responses=openapi.RELEASE_ACTION,
                    operation_id=f"{action}_release", summary=f"{action.capitalize()} release",
                    description=f"`{action}` one release (409 when its state refuses it).",
                    )(routes.command(action))
    router.get(PREFIX + "/{release_id}/events", responses=openapi.RELEASE_VIEW)(routes.release_events)
    return router


class ReleaseRoutes:
    """The handlers of the release routes (module docstring)."""

    def __init__(self, ctx: ApiContext):
        self.ctx, self.book = ctx, ctx.releases
        self.loads = AdapterLoads(ctx)
        self.gate = ReleaseGate(ctx, self.loads)
        ctx.release_state.on_takeover(self.gate.run)  # this ingress runs the gates it takes over

    def _visible(self, name: str, caller: Caller) -> None:
        """404 unless the caller's tenant may use `name` (existence does not leak)."""
        if not caller.may_use(name):
            raise AdapterNotFoundError(name, "not accessible")

    async def create_release(self, name: str, req: CreateReleaseRequest, caller: CallerDep) -> dict[str, Any]:
        """Load `lora_path` as the next version of `name` and start its release against the version
        the bare name means now (no traffic to it before its eval gate)."""
        lora_path = req.lora_path
        if not caller.principal.admin and self.ctx.tenants is not None:  # 403 naming the adapter
            lora_path = tenant_candidate(name, lora_path, self.ctx.config.engine.adapter_source, caller)
        self._visible(name, caller)
        state = self.ctx.release_state
        if not state.durable and not isinstance(self.ctx.registrations, LocalRegistrations):
            raise ReleaseConflictError(name, "-", "releases need one ingress replica (ingress_num_replicas"
                                       "=1) or release_state_uri; the other replicas would not follow this "
                                       "one's release")
        kept = self.ctx.models.versions.versions(name)
        if not kept:  # nothing to release against: a 404 before the name's and the body's checks (400s)
            raise AdapterNotFoundError(name, "load a first version before releasing another")
        number = self.loads.next_version(name, inplace=True)
        cases = await eval_set(req.eval_set, lora_path)  # a bad set is a 400 before any load
        release_id, settings = f"rel-{uuid.uuid4().hex[:12]}", req.settings(self.book.settings)

        def start(book: ReleaseBook) -> None:
            stable = book.alias(name, kept, "")
            if stable is None:
                raise AdapterNotFoundError(name, "load a first version before releasing another")
            release = book.start(name, release_id, stable, number, caller.tenant, settings)
            lease = book.lease(state.owner, state.lease_s)
            release.stage({"lora_path": lora_path, "eval_set": req.eval_set}, lease)

        await state.transact(start)
        return await self.gate.run(name, release_id, cases, read_set=False)

    async def list_releases(self, name: str, caller: CallerDep) -> dict[str, Any]:
        """The releases of `name`, oldest first, and where they are kept (`state_store`: folder, s3,
        or memory, lost on a restart)."""
        self._visible(name, caller)
        state = self.ctx.release_state
        data = await state.transact(lambda book: [r.status() for r in book.releases(name)])
        return {"object": "list", "data": data, "state_store": state.kind}

    async def release_status(self, name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
        """One release: its state, step, share and this step's counts."""
        self._visible(name, caller)
        return await self.ctx.release_state.transact(lambda book: book.release(name, release_id).status())

    async def release_events(self, name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
        """The release's audit log: every decision with its evidence, oldest first."""
        self._visible(name, caller)
        data = await self.ctx.release_state.transact(
            lambda book: [e.to_dict() for e in book.release(name, release_id).events()])
        return {"object": "list", "data": data}

    def command(self, action: str) -> Any:
        async def handler(name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
            self._visible(name, caller)
            return await self.ctx.release_state.transact(
                lambda book: book.command(name, release_id, action).status())

        handler.__name__ = f"{action}_release"
        return handler


def tenant_candidate(name: str, lora_path: str, sources: list[str], caller: Caller) -> str:
    """Where a tenant's candidate is loaded from: an adapter of the configured sources that the
    tenant may use, as an id (from the first source) or a location under a source (module
    docstring); a ReleasePermissionError (403) naming it otherwise."""
    if not caller.may_use(name):
        raise ReleasePermissionError(caller.tenant, name, "it is not one of the tenant's adapters")
    adapter_id, location = None, lora_path
    if "://" not in lora_path and not lora_path.startswith(("/", "~")):
        adapter_id = lora_path
        location = sources[0].rstrip("/") + "/" + lora_path if sources else lora_path
    else:
        normal = lora_path if lora_path.startswith("s3://") else posixpath.normpath(
            lora_path.removeprefix("file://"))
        for source in sources:
            root = source.removeprefix("file://").rstrip("/")
            if normal.startswith(root + "/"):
                adapter_id = normal[len(root) + 1:]
                location = normal
                break
    try:
        valid = adapter_id is not None and bool(sources) and check_adapter_id(adapter_id) == adapter_id
    except AdapterError:
        valid = False
    if not valid or adapter_id is None:
        raise ReleasePermissionError(caller.tenant, name, "a tenant's candidate must be one of its adapters "
                                     "in the configured adapter sources, by id")
    if not caller.may_use(adapter_id):
        raise ReleasePermissionError(caller.tenant, name, f"the candidate {adapter_id!r} is not one of the "
                                     "tenant's adapters")
    return location

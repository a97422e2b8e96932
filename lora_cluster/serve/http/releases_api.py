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
canary at once, and its `eval_passed` event says so. Steps then advance and roll back on live
evidence (`release_traffic`).

Access: an admin key reaches every release; a tenant key the releases of the adapters its patterns
match (another tenant's are a 404, as its adapters are); creating one loads a server path, so it
needs an admin key (403). The release state is this ingress's: with several ingress replicas
(shared registrations) a release cannot be created (409), since the others would not follow it.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from lora_cluster.config.releases import MAX_STEPS, check_steps
from lora_cluster.errors import (
    AdapterNotFoundError,
    PermissionDeniedError,
    ReleaseConflictError,
    RequestError,
)
from lora_cluster.releases.book import ACTIONS
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.release import Release
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.adapter_loads import AdapterLoads
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registry import LocalRegistrations
from lora_cluster.serve.http.release_eval import MAX_EVAL_CASES, ReleaseEvaluation, eval_set
from lora_cluster.serve.http.schemas import Body
from lora_cluster.serve.routing.auth import Caller, CallerDep

PREFIX = "/v1/adapters/{name}/releases"


class CreateReleaseRequest(Body):
    lora_path: str = Field(min_length=1, description="Where the candidate version's weights are "
                           "(a folder, or a URI of the configured sources' kinds).")
    steps: list[float] | None = Field(None, min_length=1, max_length=MAX_STEPS,
                                      description="This release's canary steps, percent, increasing, "
                                      "ending at 100 (default: release_canary_steps).")
    step_min_requests: int | None = Field(None, ge=1, description="Default: release_step_min_requests.")
    step_dwell_s: float | None = Field(None, ge=0, le=86_400, description="Default: release_step_dwell_s.")
    eval_set: list[dict[str, Any]] | None = Field(
        None, min_length=1, max_length=MAX_EVAL_CASES,
        description="The evaluation set, one object a case: {prompt, expected}, run on both versions "
        "before any traffic (default: eval.jsonl beside a local candidate, else none).")

    def settings(self, defaults: ReleaseSettings) -> ReleaseSettings:
        """The release's settings: the config's, with what this request overrides (400 on bad steps)."""
        try:
            steps = defaults.steps if self.steps is None else tuple(check_steps(self.steps, "steps"))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return dataclasses.replace(
            defaults, steps=steps,
            step_min_requests=self.step_min_requests or defaults.step_min_requests,
            step_dwell_s=defaults.step_dwell_s if self.step_dwell_s is None else self.step_dwell_s)


def releases_router(ctx: ApiContext) -> APIRouter:
    """The release routes of one ingress (`ReleaseRoutes`)."""
    routes, router = ReleaseRoutes(ctx), APIRouter()
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
        self.evaluation = ReleaseEvaluation(ctx)

    def _visible(self, name: str, caller: Caller) -> None:
        """404 unless the caller's tenant may use `name` (existence does not leak)."""
        if not caller.may_use(name):
            raise AdapterNotFoundError(name, "not accessible")

    async def create_release(self, name: str, req: CreateReleaseRequest, caller: CallerDep) -> dict[str, Any]:
        """Load `lora_path` as the next version of `name` and start its release against the version
        the bare name means now (no traffic to it before its eval gate)."""
        self._visible(name, caller)
        if not caller.principal.admin and self.ctx.tenants is not None:
            raise PermissionDeniedError("creating a release loads a server path: it needs an admin key")
        if not isinstance(self.ctx.registrations, LocalRegistrations):
            raise ReleaseConflictError(name, "-", "releases need one ingress replica (ingress_num_replicas"
                                       "=1); the other replicas would not follow this one's release")
        kept = self.ctx.models.versions.versions(name)
        stable = self.book.alias(name, kept, "")
        if stable is None:
            raise AdapterNotFoundError(name, "load a first version before releasing another")
        number = self.loads.next_version(name, inplace=True)
        cases = await eval_set(req.eval_set, req.lora_path)  # a bad set is a 400 before any load
        release = self.book.start(name, f"rel-{uuid.uuid4().hex[:12]}", stable, number, caller.tenant,
                                  req.settings(self.book.settings))
        try:
            await self.loads.load(name, req.lora_path, inplace=True)
            verdict = None if cases is None else await self.evaluation.judge(cases, name, stable, number)
        except BaseException as exc:  # a failed load or evaluation, or the client went away
            release.eval_failed(f"the candidate was not evaluated ({type(exc).__name__})", {})
            raise
        if verdict is None:
            release.eval_passed({"eval_set": None, "note": "no evaluation set was given or found"})
        elif verdict.passed:
            release.eval_passed(verdict.evidence)
        else:
            release.eval_failed(verdict.reason, verdict.evidence)
        return release.status()

    async def list_releases(self, name: str, caller: CallerDep) -> dict[str, Any]:
        """The releases of `name` kept here, oldest first."""
        self._visible(name, caller)
        return {"object": "list", "data": [r.status() for r in self.book.releases(name)]}

    async def release_status(self, name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
        """One release: its state, step, share and this step's counts."""
        return self._release(name, release_id, caller).status()

    async def release_events(self, name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
        """The release's audit log: every decision with its evidence, oldest first."""
        release = self._release(name, release_id, caller)
        return {"object": "list", "data": [e.to_dict() for e in release.events()]}

    def command(self, action: str) -> Any:
        async def handler(name: str, release_id: str, caller: CallerDep) -> dict[str, Any]:
            self._release(name, release_id, caller)
            return self.book.command(name, release_id, action).status()

        handler.__name__ = f"{action}_release"
        return handler

    def _release(self, name: str, release_id: str, caller: Caller) -> Release:
        self._visible(name, caller)
        return self.book.release(name, release_id)

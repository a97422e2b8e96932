"""Who is calling: the ONE authentication dependency of the API, and the per-request `Caller`.

Without a tenants file (`tenants_file` unset) every route is open, as before. With one, every route
is in one of three kinds, by its path template (default deny: a route not listed is admin-only):

* open: the routes of the `open_routes` setting (default `/health` only, for probes), no key needed;
* tenant (`TENANT_ROUTES`): the generation routes, `/v1/models`, the release routes (a tenant's own
  adapters' releases: `serve.http.releases_api`), `/v1/usage` (its own tenant's usage:
  `serve.http.usage_api`), and the API's description (`/openapi.json`, `/docs`, `/redoc`): any
  known key (a tenant's or an admin's); a tenant reaches only the adapters its patterns match (see
  `ModelNames.adapter_for`);
* admin: everything else (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/v1/cluster`,
  `/debug/replicas`, `/metrics`, whose `adapter` and `tenant` labels name every tenant's adapters
  and tenants, ...): an admin key; a tenant key gets 403.

The description routes are the app's own routes (`serve.http.openapi.install_openapi`), so the app-wide
dependency covers them like any other; a route Starlette serves outside FastAPI's routing would
escape it, which is why FastAPI's built-in ones are turned off.

The key comes from `Authorization: Bearer <key>` (what the `openai` client sends) or `x-api-key`;
none is 401 `missing_api_key`, an unknown one 401 `invalid_api_key`. Keys are never logged or
echoed; the lookup is constant-time per stored digest (`tenancy.tenants.Directory.lookup`).

`Authenticator` is installed as an app-wide FastAPI dependency (it runs before any route's own
parameters); routes that need the caller declare a `caller: CallerDep` parameter, which reads it.
The `Caller` it returns charges the tenant's quota (`admit`, once the prompt is tokenized), tracks
the request's generations, and is closed by `CallerMiddleware` when the response has been sent in
full (streams included, and however the request ended), which reports the completion tokens and
frees the tenant's concurrency slot.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from lora_cluster.errors import AuthenticationError, PermissionDeniedError, QuotaExceededError
from lora_cluster.serve.routing.quotas import Quotas
from lora_cluster.tenancy.tenants import OPEN, Directory, Principal

log = logging.getLogger(__name__)

HEADER_API_KEY = "x-api-key"
RELEASE_ROUTES = frozenset({"/v1/adapters/{name}/releases", "/v1/adapters/{name}/releases/{release_id}",
                            *(f"/v1/adapters/{{name}}/releases/{{release_id}}/{action}"
                              for action in ("promote", "pause", "resume", "rollback", "events"))})
TENANT_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate",
                           "/generate_stream", "/", "/openapi.json", "/docs", "/redoc", "/v1/usage",
                           *RELEASE_ROUTES})
_SLOT = "lora_cluster.callers"  # ASGI scope key: CallerMiddleware's list of the request's Callers
_CALLER = "lora_cluster.caller"  # ASGI scope key: the request's Caller (set by the Authenticator)
ANONYMOUS = Principal(tenant=None, admin=False)  # an open route's caller when keys are required


class TenantsSource(Protocol):
    """The tenants file in force (`tenancy.watch.TenantsWatcher`)."""

    def current(self) -> Directory: ...


def api_key(request: Request) -> str | None:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key`; None when neither is given."""
    authorization = request.headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get(HEADER_API_KEY)
    return key.strip() if key and key.strip() else None


@dataclass
class Caller:
    """One request's caller: who it is, its quota ticket and the generations it started."""

    principal: Principal
    quotas: Quotas | None = None
    ticket: int | None = None
    prompt_tokens: int = 0  # charged with the ticket
    generations: list[Any] = field(default_factory=list)
    closed: bool = False

    @property
    def tenant(self) -> str | None:
        return self.principal.tenant_name

    def may_use(self, adapter_id: str | None) -> bool:
        return self.principal.may_use(adapter_id)

    def check(self) -> None:
        """Before the prompt is tokenized: QuotaExceededError when the tenant's requests_per_minute
        refuses one more request now (charges nothing). No-op without tenant limits."""
        tenant = self.principal.tenant
        if tenant is None or tenant.limits.unlimited or self.quotas is None or self.ticket is not None:
            return
        refused = self.quotas.check(tenant.name, tenant.limits)
        if refused is not None:
            raise QuotaExceededError(tenant.name, refused.limit or "quota", refused.limit_value or 0,
                                     refused.retry_after_s)

    async def admit(self, prompt_tokens: int) -> None:
        """Charge the tenant's quota for one request with `prompt_tokens` (once per request);
        QuotaExceededError naming the limit when it refuses. No-op without tenant limits."""
        tenant = self.principal.tenant
        if tenant is None or tenant.limits.unlimited or self.quotas is None or self.ticket is not None:
            return
        admission = await self.quotas.admit(tenant.name, tenant.limits, prompt_tokens)
        if not admission.admitted:
            raise QuotaExceededError(tenant.name, admission.limit or "quota", admission.limit_value or 0,
                                     admission.retry_after_s)
        self.ticket, self.prompt_tokens = admission.ticket, prompt_tokens

    def track(self, generations: list[Any]) -> None:
        """Generations whose completion tokens are charged when the request ends (their `tokens`)."""
        self.generations.extend(generations)

    def close(self, failed: bool = False) -> None:
        """The response is over: report its completion tokens and free the concurrency slot. A
        `failed` response (an error status, or none sent) without a single completion token is
        refunded: its request and prompt tokens are given back (nothing was served)."""
        if self.closed:
            return
        self.closed = True
        if self.ticket is not None and self.quotas is not None and self.tenant is not None:
            completion = sum(_tokens(g) for g in self.generations)
            if failed and completion == 0:
                self.quotas.refund(self.tenant, self.ticket, self.prompt_tokens)
            else:
                self.quotas.finish(self.tenant, self.ticket, completion)


def _tokens(generation: Any) -> int:
    """A generation's completion tokens: those read, at least those of its first item (the replica
    generated them whether or not anyone read them)."""
    first = getattr(generation, "first", None) or {}
    return max(int(getattr(generation, "tokens", 0) or 0), int(first.get("completion_tokens") or 0))


class Authenticator:
    """The app-wide dependency: the request's `Caller`, or 401/403 (see the module docstring)."""

    def __init__(self, tenants: TenantsSource | None, quotas: Quotas | None = None,
                 open_routes: Collection[str] = ("/health",)):
        self.tenants, self.quotas = tenants, quotas
        self.open_routes = frozenset(open_routes)

    @property
    def secured(self) -> bool:
        """Whether API keys are required (on every route but the open ones)."""
        return self.tenants is not None

    def is_open(self, path: str) -> bool:
        """Whether the route with this path template answers without a key."""
        return not self.secured or path in self.open_routes

    async def __call__(self, request: Request) -> Caller:
        caller = Caller(self._principal(request), self.quotas)
        request.scope[_CALLER] = caller
        slot = request.scope.get(_SLOT)
        if slot is not None:
            slot.append(caller)
        return caller

    def _principal(self, request: Request) -> Principal:
        if self.tenants is None:
            return OPEN
        path = getattr(request.scope.get("route"), "path", None)
        if path in self.open_routes:
            return ANONYMOUS
        key = api_key(request)
        if key is None:
            raise AuthenticationError("no API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                                      "missing_api_key")
        principal = self.tenants.current().lookup(key)
        if principal is None:
            raise AuthenticationError("invalid API key", "invalid_api_key")
        if path not in TENANT_ROUTES and not principal.admin:
            raise PermissionDeniedError("this route needs an admin API key")
        return principal


async def current_caller(request: Request) -> Caller:
    """The request's `Caller`, as the app-wide `Authenticator` found it. A coroutine: FastAPI runs a
    plain function dependency on its thread pool, a hop per request for a dictionary lookup."""
    caller = request.scope.get(_CALLER)
    if caller is None:
        raise RuntimeError("no Authenticator ran for this request (install it app-wide: build_fastapi)")
    return caller


CallerDep = Annotated[Caller, Depends(current_caller)]


class CallerMiddleware:
    """Closes the request's `Caller` once the response is over (see the module docstring)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slot: list[Caller] = []
        scope[_SLOT] = slot
        status: list[int] = []

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            failed = not status or status[0] >= 400  # no response (an exception, a disconnect) or an error
            for caller in slot:
                caller.close(failed)

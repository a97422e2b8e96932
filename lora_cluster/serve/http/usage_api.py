"""`GET /v1/usage`: sums of the usage store (docs/metering.md) per group, for chargeback.

Query: `since`, `until` (Unix seconds), `tenant`, `adapter`, `version`, `class`, and `group_by`
(comma-separated: tenant, adapter, version, class, hour, day; default tenant). A tenant's key sees
only its own tenant's usage: its query is scoped to it, and a `tenant` naming another tenant is a 403.
An admin key, or any caller on a server without tenants file, sees every tenant's. The store is read
through the `UsageSink` deployment (`serve.ops.usage_sink`); without one (`usage_db_path` and
`usage_store_uri` empty) or when it cannot be reached, 503. Grouped by adapter alone and not filtered
by tenant, version or class, an admin's (or a tenantless server's) rows also carry `slot_s` and
`load_s`, the adapter's slot residency and load time on the replicas: the store keeps them per adapter,
not per tenant, so a tenant's key never sees them.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Query
from pydantic import Field

from lora_cluster.errors import LoraClusterError, PermissionDeniedError, UsageUnavailableError
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.query_values import INTEGER, NUMBER, single_values
from lora_cluster.serve.routing.auth import CallerDep
from lora_cluster.tenancy.usage_store import GROUPS

MAX_TIME = 1e11  # Unix seconds (year 5138): bounds what the store's minute arithmetic takes
_GROUP = f"({'|'.join(GROUPS)})"
GROUP_BY_PATTERN = f"^({_GROUP}(,{_GROUP})*)?$"  # comma-separated groups, or none (one total)
# the typed query values, in JSON's spelling (http.query_values)
Time = Annotated[float | None, Query(), Field(ge=0, le=MAX_TIME), NUMBER]
Version = Annotated[int | None, Query(), Field(ge=0, le=999_999_999), INTEGER]


class UsageReader(Protocol):
    async def query(self, **filters: Any) -> list[dict[str, object]]: ...


class RemoteUsage:
    """The `UsageSink` deployment's `query` through its handle."""

    def __init__(self, handle: Any):
        self._handle = handle

    async def query(self, **filters: Any) -> list[dict[str, object]]:
        return await self._handle.query.remote(**filters)


def usage_router(reader: UsageReader | None) -> APIRouter:
    """The usage route over `reader` (None: usage is not recorded)."""
    router = APIRouter()

    async def usage(caller: CallerDep, since: Time = None, until: Time = None,
                    tenant: str | None = Query(None, max_length=256),
                    adapter: str | None = Query(None, max_length=256),
                    version: Version = None,
                    sla_class: str | None = Query(None, alias="class", max_length=256),
                    group_by: str = Query("tenant", max_length=256, pattern=GROUP_BY_PATTERN),
                    ) -> dict[str, Any]:
        """Sums of requests, tokens, device- and queue-seconds per group (docs/metering.md); a
        tenant's key sees only its own tenant's."""
        own = caller.tenant
        if own is not None and not caller.principal.admin:
            if tenant is not None and tenant != own:
                raise PermissionDeniedError("a tenant's key reads only its own tenant's usage")
            tenant = own
        groups = tuple(g for g in group_by.split(",") if g)
        if reader is None:
            raise UsageUnavailableError("usage is not recorded on this server (usage_db_path and "
                                        "usage_store_uri are empty)")
        try:
            rows = await reader.query(group_by=groups, tenant=tenant, adapter=adapter, version=version,
                                      sla_class=sla_class, since=since, until=until,
                                      residency=caller.principal.admin or own is None)
        except LoraClusterError:
            raise
        except Exception as exc:
            raise UsageUnavailableError(f"the usage store cannot be reached: {type(exc).__name__}") from exc
        return {"object": "list", "group_by": list(groups), "data": rows}

    router.get("/v1/usage", responses=openapi.ADMIN_VIEW, dependencies=[Depends(single_values)])(usage)
    return router


__all__ = ["GROUP_BY_PATTERN", "MAX_TIME", "RemoteUsage", "UsageReader", "usage_router"]

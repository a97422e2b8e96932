"""Request policy at the ingress: who the caller is (`authenticate`, the one API-key dependency) and
which SLA class a request runs in (`priority_class`).
"""

from __future__ import annotations

from lora_cluster.cluster.sla import SlaClass, build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.errors import RequestError
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.routing.auth import Authenticator, Caller, TenantsSource
from lora_cluster.serve.routing.quotas import Quotas

HEADER_PRIORITY = "x-lora-priority"  # request: the SLA class's name


class RequestPolicy:
    """The SLA classes and the authenticator of one ingress."""

    def __init__(self, config: ServeConfig, tenants: TenantsSource | None = None,
                 quotas: Quotas | None = None):
        self.sla = build_sla_classes(config)
        self.authenticate = Authenticator(tenants, quotas, config.tenancy.open_routes)  # THE auth dependency

    def priority_class(self, header: str | None, priority: int | None = None,
                       caller: Caller | None = None) -> SlaClass:
        """The request's SLA class: the `x-lora-priority` header's class (400 naming the known classes
        when there is no such class), else the class of the body's integer `priority`, else the
        caller's tenant's `priority_class`, else the default. A tenant's class is also the most urgent
        it gets: a more urgent class asked for is lowered to the tenant's (the response's
        `x-lora-priority-class` says which class served)."""
        tenant = None if caller is None else caller.principal.tenant
        floor = None if tenant is None else self.sla.by_name.get(tenant.priority_class or "")
        try:
            asked = self.sla.resolve(name=None if header is None else header.strip(), priority=priority)
        except RequestError as exc:
            raise ApiException(describe(RequestError(f"{HEADER_PRIORITY}: {exc}"))) from exc
        if floor is None:
            return asked
        if header is None and priority is None:
            return floor
        return floor if asked.priority < floor.priority else asked

"""The ingress's budget check: tenants' monthly budgets against their usage in the usage store.

`BudgetGuard.check` runs on the request path (with the tenant's quota check): it reads only its
`BudgetBook` (a dictionary lookup, no I/O on the event loop). A tenant at or past 100% of a limit
of a budget whose action is `refuse` gets `BudgetExceededError` (429 `budget_exceeded`, naming the
budget, with Retry-After at the month's end); with `warn` the request is served, `warning` gives
the `x-lora-budget-warning` header, and one log line per tenant, budget and month says so.

A background task started on the first check reads every tenant's sums since the start of the UTC
month from the store (one `query(group_by=("tenant",))` through the `UsageSink`'s handle) every
`refresh_s` (`usage_budget_refresh_s`), within `timeout_s`. A reading that fails keeps the last one
(logged once per outage): the check never waits for the store, and a store that cannot be read
refuses nobody. `collect` is the `lora_cluster_usage_budget_used_ratio` gauge of every budget of the
tenants file in force, for the 80% alert (deploy/k8s/usage-budgets.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import Metric

from lora_cluster.errors import BudgetExceededError
from lora_cluster.serve.ops.background import within
from lora_cluster.serve.ops.metrics import USAGE_BUDGET_USED
from lora_cluster.serve.ops.usage_metrics import TenantsInForce
from lora_cluster.tenancy.budget import BudgetAction, BudgetBook, month_start, next_month_start
from lora_cluster.tenancy.tenants import Tenant

log = logging.getLogger(__name__)
HEADER_BUDGET_WARNING = "x-lora-budget-warning"  # response: a `warn` budget is used up
READ_TIMEOUT_S = 10.0


class UsageSums(Protocol):
    """The usage store's sums (`UsageStore.query`'s keywords), e.g. through the `UsageSink`'s handle."""

    async def query(self, **filters: Any) -> list[dict[str, object]]: ...


class BudgetGuard:
    """Budget checks over a periodically refreshed reading of the store (see the module docstring).
    `clock` gives Unix seconds (budgets are per UTC month)."""

    def __init__(self, reader: UsageSums, tenants: TenantsInForce, refresh_s: float, *,
                 clock: Callable[[], float] = time.time, timeout_s: float = READ_TIMEOUT_S):
        self._reader, self._tenants, self.refresh_s = reader, tenants, refresh_s
        self._clock, self.timeout_s = clock, timeout_s
        self.book = BudgetBook()
        self._task: asyncio.Task[None] | None = None
        self._warned: set[tuple[str, str, float]] = set()  # (tenant, budget, month): logged once
        self._failing = False

    def check(self, tenant: Tenant | None) -> None:
        """Raise `BudgetExceededError` when `tenant` used up a `refuse` budget; log a used-up `warn`
        budget once a month. Starts the refresher on the running loop if it does not run."""
        self._start()
        if tenant is None or tenant.budget is None:
            return
        now = self._clock()
        use = self.book.verdict(tenant.name, tenant.budget, now)
        if use is None:
            return
        if tenant.budget.action is BudgetAction.REFUSE:
            raise BudgetExceededError(tenant.name, use.budget, use.limit, use.used,
                                      next_month_start(now) - now)
        key = (tenant.name, use.budget, month_start(now))
        if key not in self._warned:
            self._warned = {k for k in self._warned if k[2] == key[2]} | {key}  # this month's only
            log.warning("tenant %s has used its monthly budget %s=%g (used %g); serving on (action: warn)",
                        tenant.name, use.budget, use.limit, use.used)

    def warning(self, tenant: Tenant | None) -> dict[str, str]:
        """The `x-lora-budget-warning` header when `tenant` used up a `warn` budget, else nothing."""
        if tenant is None or tenant.budget is None or tenant.budget.action is not BudgetAction.WARN:
            return {}
        use = self.book.verdict(tenant.name, tenant.budget, self._clock())
        if use is None:
            return {}
        return {HEADER_BUDGET_WARNING: f"{use.budget}={use.limit:g} used ({use.used:g} this month)"}

    async def refresh(self) -> None:
        """Read every tenant's usage this month from the store (keeps the last reading on failure)."""
        now = self._clock()
        try:
            rows = await within(self._reader.query(group_by=("tenant",), since=month_start(now)),
                                self.timeout_s)
        except Exception as exc:
            if not self._failing:
                log.warning("budgets: the usage store cannot be read (%s); the last reading stays",
                            type(exc).__name__)
            self._failing = True
            return
        self._failing = False
        self.book.update(rows, now)

    def collect(self) -> Iterable[Metric]:
        """The budget-use gauge of every budget in the tenants file in force."""
        family = USAGE_BUDGET_USED.family()
        now = self._clock()
        for tenant in self._tenants.current().tenants.values():
            if tenant.budget is not None:
                for use in self.book.uses(tenant.name, tenant.budget, now):
                    family.add_metric([tenant.name, use.budget], use.ratio)
        yield family

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)


__all__ = ["HEADER_BUDGET_WARNING", "BudgetGuard", "UsageSums"]

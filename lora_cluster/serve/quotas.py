"""The quota ledger shared by every ingress replica, and the ingress's two ways to reach it.

One `QuotaBook` (`lora_cluster.tenancy.quota`) for the whole cluster lives in the `QuotaLedger`
deployment (one replica, like the cluster controller). Each ingress holds a lease per tenant
(`lora_cluster.tenancy.lease`): credit granted by the ledger in batches of `lease_s` seconds of the
tenant's rates, so that most requests are admitted without a ledger call; the unused part goes back
every `lease_s`. All ingresses together never exceed a limit (the ledger never grants more than the
buckets hold); one ingress may refuse while another holds unused credit, for at most `lease_s`.
Requests of tenants without limits, of admins, and of a server without tenants file never reach
this module. If the ledger cannot be reached when a lease runs out, the request is refused with
503 (fail closed). If the ledger's actor restarts, its buckets start full and it has forgotten the
held slots: for a moment a tenant can exceed its quota by what was in flight. The cost of a ledger
call and the share of requests that need one: `benchmarks/bench_quota.py` (docs/bench_quota.md).

`LocalQuotas` holds the book in the ingress process itself (one ingress: tests, a single process),
exact per request; `RemoteQuotas` is the leased client of the `QuotaLedger` deployment.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from ray import serve

from lora_cluster.errors import QuotaUnavailableError
from lora_cluster.tenancy.lease import TenantLease
from lora_cluster.tenancy.quota import Admission, Amounts, Grant, QuotaBook, QuotaLimits

log = logging.getLogger(__name__)
LEDGER_TIMEOUT_S = 10.0
HEARTBEAT_S = 60.0  # a holder of slots tells the ledger it is alive at least this often


class Quotas(Protocol):
    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission: ...

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None: ...


class LocalQuotas:
    """The book in this process (one ingress)."""

    def __init__(self, book: QuotaBook):
        self.book = book

    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission:
        return self.book.admit(tenant, limits, prompt_tokens)

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        self.book.finish(tenant, ticket, completion_tokens)


class RemoteQuotas:
    """The `QuotaLedger` deployment through its handle, with a lease per tenant (`tenancy.lease`):
    most requests are admitted from the lease without a call. A background task gives back, every
    `lease_s`, what the leases did not use (and says that this ingress is alive while it holds slots).
    At most MAX_PENDING_FINISHES give-backs are in flight."""

    def __init__(self, handle: Any, lease_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self._handle, self.lease_s, self._clock = handle, lease_s, clock
        self.holder = f"ingress-{uuid.uuid4().hex[:12]}"
        self._leases: dict[str, tuple[TenantLease, QuotaLimits]] = {}  # tenants of the file: bounded
        self._tickets = itertools.count(1)
        self._flusher: asyncio.Task[None] | None = None
        self._heard: dict[str, float] = {}  # tenant -> when the ledger last heard of this holder
        self.ledger_calls = 0

    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission:
        self._ensure_flusher()
        lease = self._leases.get(tenant, (TenantLease(), limits))[0]
        self._leases[tenant] = (lease, limits)
        for _ in range(3):  # another request may take what a grant brought while this one waited
            now = self._clock()
            refused = lease.blocked(now)
            if refused is not None:
                return Admission(None, refused.limit, refused.limit_value, refused.retry_after_s)
            if lease.take(limits, prompt_tokens):
                return Admission(next(self._tickets))
            grant = await self._call("grant", self.holder, tenant, limits, lease.need(limits, prompt_tokens),
                                     lease.extra(limits, self.lease_s))
            self._heard[tenant] = self._clock()
            if not grant.granted:
                lease.block(grant, self._clock())
                return Admission(None, grant.limit, grant.limit_value, grant.retry_after_s)
            lease.add(grant, self._clock())
        return Admission(None, "max_concurrent", limits.max_concurrent, 1.0)

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        entry = self._leases.get(tenant)
        if entry is not None:
            entry[0].finish(entry[1], completion_tokens)

    async def _call(self, method: str, *args: Any) -> Any:
        self.ledger_calls += 1
        response = getattr(self._handle, method).remote(*args)
        try:
            return await asyncio.wait_for(response, LEDGER_TIMEOUT_S)
        except Exception as exc:
            response.cancel()
            raise QuotaUnavailableError(f"the quota ledger cannot be reached ({type(exc).__name__})") from exc

    def _ensure_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s)
            try:
                await self.flush()
            except Exception as exc:  # the next round gives it back; the ledger's ttl is the backstop
                log.warning("quota ledger: giving back unused quota failed (%s)", type(exc).__name__)

    async def flush(self) -> None:
        """Give back what the leases did not use; tell the ledger this holder is alive."""
        now = self._clock()
        for tenant, (lease, _) in list(self._leases.items()):
            returned = lease.returnable(now, self.lease_s)
            alive = lease.slots and now - self._heard.get(tenant, now) > HEARTBEAT_S
            if returned is None and not alive:
                continue
            unused, debt = returned or (Amounts(), 0)
            await self._call("give_back", self.holder, tenant, unused, debt)
            self._heard[tenant] = now


@serve.deployment(name="QuotaLedger", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=100_000, health_check_period_s=2.0)
class QuotaLedger:
    """Every tenant's quota for the whole cluster (one replica; all calls run on its event loop)."""

    def __init__(self, ticket_ttl_s: float):
        self.book = QuotaBook(time.monotonic, ticket_ttl_s=ticket_ttl_s)

    def grant(self, holder: str, tenant: str, limits: QuotaLimits, need: Amounts, extra: Amounts) -> Grant:
        return self.book.grant(holder, tenant, limits, need, extra)

    def give_back(self, holder: str, tenant: str, unused: Amounts, debt_tokens: int) -> None:
        self.book.give_back(holder, tenant, unused, debt_tokens)

    def usage(self, tenant: str) -> dict[str, Any]:
        return self.book.usage(tenant)

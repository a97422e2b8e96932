"""The quota ledger shared by every ingress replica, and the ingress's two ways to reach it.

One `QuotaBook` (`lora_cluster.tenancy.quota`) for the whole cluster lives in the `QuotaLedger`
deployment (one replica, like the cluster controller). Each ingress holds a lease per tenant
(`lora_cluster.tenancy.lease`): credit granted by the ledger in batches of `lease_s` seconds of the
tenant's rates, so that most requests are admitted without a ledger call; the unused part goes back
every `lease_s`. All ingresses together never exceed a limit (the ledger never grants more than the
buckets hold); one ingress may refuse while another holds unused credit, for at most `lease_s`.
Requests of tenants without limits, of admins, and of a server without tenants file never reach
this module. If the ledger cannot be reached when a lease runs out, the request is refused with
503 (fail closed). The leases and the ledger reconcile (`tenancy.lease`): every reply carries the
ledger's account for this ingress, so a grant whose reply never arrived (the client went away, the
wait timed out) is given back at the next flush, and a failed give-back is sent again. A grant runs
to its end even when the request that asked for it goes away (what it brought stays in the lease).
If the ledger's actor restarts, its buckets start full and the leases' credit from before is gone;
the requests in flight ask for their slots again with the next grant. The cost of a ledger call and
the share of requests that need one: `benchmarks/bench_quota.py` (docs/bench_quota.md).

A request that fails before its first token is refunded (`refund`): its request and prompt tokens
are not charged. The `requests_per_minute` limit is checked (`check`, no ledger call) before a
request's prompt is tokenized.

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
from lora_cluster.serve.ops.background import within
from lora_cluster.tenancy.lease import TenantLease
from lora_cluster.tenancy.quota import Account, Admission, Amounts, Grant, QuotaBook, QuotaLimits

log = logging.getLogger(__name__)
LEDGER_TIMEOUT_S = 10.0
HEARTBEAT_S = 60.0  # a holder of slots tells the ledger it is alive at least this often


class Quotas(Protocol):
    def check(self, tenant: str, limits: QuotaLimits) -> Admission | None: ...

    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission: ...

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None: ...

    def refund(self, tenant: str, ticket: int, prompt_tokens: int) -> None: ...


class LocalQuotas:
    """The book in this process (one ingress)."""

    def __init__(self, book: QuotaBook):
        self.book = book

    def check(self, tenant: str, limits: QuotaLimits) -> Admission | None:
        return self.book.check(tenant, limits)

    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission:
        return self.book.admit(tenant, limits, prompt_tokens)

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        self.book.finish(tenant, ticket, completion_tokens)

    def refund(self, tenant: str, ticket: int, prompt_tokens: int) -> None:
        self.book.refund(tenant, ticket)


class RemoteQuotas:
    """The `QuotaLedger` deployment through its handle, with a lease per tenant (`tenancy.lease`):
    most requests are admitted from the lease without a call. A background task gives back, every
    `lease_s`, what the leases did not use (and says that this ingress is alive while it holds slots).
    A ledger call that has not answered within `timeout_s` is given up on (503). With
    `background=False` nothing runs in the background: the owner calls `flush` (tests, benchmarks)."""

    def __init__(self, handle: Any, lease_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = LEDGER_TIMEOUT_S, background: bool = True):
        self._handle, self.lease_s, self._clock, self.timeout_s = handle, lease_s, clock, timeout_s
        self.background = background
        self.holder = f"ingress-{uuid.uuid4().hex[:12]}"
        self._leases: dict[str, tuple[TenantLease, QuotaLimits]] = {}  # tenants of the file: bounded
        self._tickets = itertools.count(1)
        self._admitted: dict[int, str] = {}  # ticket -> the account it was charged to (requests in flight)
        self._granting: dict[str, set[asyncio.Future]] = {}  # tenant -> its grant calls in flight
        self._flusher: asyncio.Task[None] | None = None
        self._heard: dict[str, float] = {}  # tenant -> when the ledger last heard this holder settle
        self.ledger_calls = 0

    def check(self, tenant: str, limits: QuotaLimits) -> Admission | None:
        entry = self._leases.get(tenant)
        refused = None if entry is None else entry[0].blocked(self._clock())
        if refused is None:
            return None
        return Admission(None, refused.limit, refused.limit_value, refused.retry_after_s)

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
                ticket = next(self._tickets)
                self._admitted[ticket] = lease.account.id
                return Admission(ticket)
            call = asyncio.ensure_future(self._grant(tenant, lease, limits, prompt_tokens))
            calls = self._granting.setdefault(tenant, set())
            calls.add(call)
            call.add_done_callback(calls.discard)
            call.add_done_callback(_retrieve)
            grant = await asyncio.shield(call)  # the request may go away: the grant still lands in the lease
            if not grant.granted:
                lease.block(grant, self._clock())
                return Admission(None, grant.limit, grant.limit_value, grant.retry_after_s)
        return Admission(None, "max_concurrent", limits.max_concurrent, 1.0)

    async def _grant(self, tenant: str, lease: TenantLease, limits: QuotaLimits, prompt_tokens: int) -> Grant:
        need, extra = lease.need(limits, prompt_tokens), lease.extra(limits, self.lease_s)
        seq, floor = lease.open_call()
        replied = False
        try:
            grant = await self._call("grant", self.holder, tenant, limits, need, extra, seq, floor)
            replied = True
        finally:
            lease.close_call(seq, floor, replied)
        now = self._clock()
        lease.add(grant, now)
        self._heard.setdefault(tenant, now)
        return grant

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        self._admitted.pop(ticket, None)
        entry = self._leases.get(tenant)
        if entry is not None:
            entry[0].finish(entry[1], completion_tokens)

    def refund(self, tenant: str, ticket: int, prompt_tokens: int) -> None:
        account = self._admitted.pop(ticket, None)
        entry = self._leases.get(tenant)
        if entry is not None:
            entry[0].refund(entry[1], prompt_tokens, same_account=account == entry[0].account.id)

    async def _call(self, method: str, *args: Any) -> Any:
        self.ledger_calls += 1
        response = getattr(self._handle, method).remote(*args)
        try:
            return await within(response, self.timeout_s)
        except Exception as exc:
            response.cancel()
            raise QuotaUnavailableError(f"the quota ledger cannot be reached ({type(exc).__name__})") from exc

    def _ensure_flusher(self) -> None:
        if not self.background:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_forever())

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s)
            try:
                await self.flush()
            except Exception as exc:  # the next round settles it; the ledger's ttl is the backstop
                log.warning("quota ledger: giving back unused quota failed (%s)", type(exc).__name__)

    async def flush(self) -> None:
        """Give back what the leases did not use, settle what is in doubt, tell the ledger this
        holder is alive. A tenant whose give-back fails is settled at the next flush (nothing is
        lost: see `tenancy.lease`); the others are settled meanwhile."""
        for tenant in list(self._leases):
            try:
                await self._settle(tenant)
            except QuotaUnavailableError as exc:
                log.warning("quota ledger: settling tenant %r failed (%s); the next round sends it again",
                            tenant, exc)

    async def _settle(self, tenant: str) -> None:
        lease, limits = self._leases[tenant]
        granting = self._granting.get(tenant)
        if granting:  # what the grants in flight bring (each ends within timeout_s) goes back with the rest
            await asyncio.wait(list(granting))
        for _ in range(2):  # a reply may show grants whose replies were lost: they go back in a second call
            now = self._clock()
            totals = lease.returnable(now, self.lease_s)
            alive = lease.slots > 0 and now - self._heard.get(tenant, now) >= HEARTBEAT_S
            if totals is None and not alive and not lease.unsettled:
                return
            totals = totals or lease.report()
            lease.sending(totals)
            seq, floor = lease.open_call()
            replied = False
            try:
                account = await self._call("give_back", self.holder, tenant, limits, totals, seq, floor)
                replied = True
            finally:
                lease.close_call(seq, floor, replied)
            lease.reconcile(account)
            self._heard[tenant] = now


def _retrieve(task: asyncio.Future) -> None:
    """A grant whose request went away: its error (if any) is logged, not left unretrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("quota ledger: a grant for a request that went away failed (%s)", task.exception())


@serve.deployment(name="QuotaLedger", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=100_000, health_check_period_s=2.0)
class QuotaLedger:
    """Every tenant's quota for the whole cluster (one replica; all calls run on its event loop)."""

    def __init__(self, ticket_ttl_s: float):
        self.book = QuotaBook(time.monotonic, ticket_ttl_s=ticket_ttl_s)

    def grant(self, holder: str, tenant: str, limits: QuotaLimits, need: Amounts, extra: Amounts,
              seq: int = 0, floor: int = 0) -> Grant:
        return self.book.grant(holder, tenant, limits, need, extra, seq, floor)

    def give_back(self, holder: str, tenant: str, limits: QuotaLimits, totals: Account, seq: int = 0,
                  floor: int = 0) -> Account:
        return self.book.give_back(holder, tenant, limits, totals, seq, floor)

    def usage(self, tenant: str) -> dict[str, Any]:
        return self.book.usage(tenant)

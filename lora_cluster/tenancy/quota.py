"""Per-tenant quotas: token buckets for requests and tokens per minute, and a concurrency count.

Semantics (one `QuotaBook` holds them for the whole cluster, see `lora_cluster.serve.routing.quotas`):

* `requests_per_minute`: a bucket of that many requests, refilled at limit/60 per second. A request
  takes one when it is admitted. A full bucket lets an idle tenant burst one minute's worth at once.
* `tokens_per_minute`: a bucket of that many tokens, refilled the same way. A request is admitted
  when the bucket holds its prompt tokens, which are taken then; its completion tokens are charged
  when the request ends (they are not known before), and may take the bucket below zero: the
  tenant's next requests wait until it has refilled. A prompt larger than the whole bucket is
  admitted when the bucket is full (so that it is not refused forever) and empties it below zero.
* `max_concurrent`: requests of the tenant admitted and not yet finished.

A request is admitted only when every limit allows it, and then charged on every limit at once; a
refused request is charged nothing. The refusal names the limit that makes the request wait longest
and says when a retry may succeed (`retry_after_s`; 1 s for `max_concurrent`, whose requests end at
unknown times). Admitted requests hold a ticket; a ticket whose `finish` never comes (its ingress
died) is reclaimed after `ticket_ttl_s`. A request that fails before its first token is `refund`ed:
its request, prompt tokens and slot go back. Tenants are kept in LRU order, at most `max_tenants`.

Holders (an ingress's leases, `tenancy.lease`) take credit in bulk with `grant` and settle with
`give_back`. The ledger keeps an `Account` per holder and tenant: running totals of what it granted
and what the holder gave back or paid, each of which only grows. Every reply carries the account,
and a give-back states totals, not amounts: a reply that never arrived (the caller went away, the
call timed out after the ledger granted) shows in the next reply's account, and a give-back sent
twice takes nothing twice. Every call carries the holder's sequence number and its `floor` (every
call of that holder numbered below it has ended or was given up on), which the ledger records with
every call it answers; a grant numbered below it is a call its holder no longer waits for, and grants
nothing. A holder's slots are
reclaimed after `ticket_ttl_s` without a give-back from it (grants do not count: a holder that keeps
taking and never settles is reclaimed even while its tenant has traffic). A new ledger (a restart) or
a reclaimed account opens accounts with new ids; totals meant for another account are never applied.

Pure: the clock is injected, no Ray, no I/O.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_TENANTS = 10_000
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class QuotaLimits:
    """A tenant's limits from the tenants file (None: no limit)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def unlimited(self) -> bool:
        return all(v is None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuotaLimits:
        return cls(**{k: (None if d.get(k) is None else int(d[k])) for k in asdict(cls())})


class TokenBucket:
    """`per_minute` units, refilled continuously at per_minute/60 per second; may go below zero."""

    def __init__(self, per_minute: int, now: float):
        self.capacity, self.level, self.updated = float(per_minute), float(per_minute), now

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def resize(self, per_minute: int, now: float) -> None:
        """A new limit (the tenants file changed): keeps the level, capped by the new capacity."""
        self.refill(now)
        self.capacity = float(per_minute)
        self.level = min(self.level, self.capacity)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now). A full bucket admits any amount."""
        self.refill(now)
        if self.level >= amount or self.level >= self.capacity:
            return 0.0
        return (min(amount, self.capacity) - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount


@dataclass(frozen=True)
class Admission:
    """`ticket` when admitted; else the `limit` that refused (its name and value) and `retry_after_s`."""

    ticket: int | None
    limit: str | None = None
    limit_value: int | None = None
    retry_after_s: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.ticket is not None


@dataclass(frozen=True)
class Amounts:
    """Requests, tokens and concurrency slots, asked for or given back."""

    requests: int = 0
    tokens: int = 0
    slots: int = 0


def _plus(a: Amounts, b: Amounts) -> Amounts:
    return Amounts(a.requests + b.requests, a.tokens + b.tokens, a.slots + b.slots)


def _most(a: Amounts, b: Amounts) -> Amounts:
    return Amounts(max(a.requests, b.requests), max(a.tokens, b.tokens), max(a.slots, b.slots))


@dataclass(frozen=True)
class Account:
    """One holder's account for one tenant at the ledger, as running totals since it was opened (each
    only grows): what the ledger `granted`, what the holder gave back (`returned`) and the completion
    tokens it `paid` beyond its credit. `id` names the account ("": none yet)."""

    id: str = ""
    granted: Amounts = Amounts()
    returned: Amounts = Amounts()
    paid: int = 0

    @property
    def slots(self) -> int:
        """Slots the holder holds."""
        return self.granted.slots - self.returned.slots

    def merged(self, other: Account) -> Account:
        """The later knowledge of the same account (replies may arrive out of order)."""
        return Account(self.id, _most(self.granted, other.granted), _most(self.returned, other.returned),
                       max(self.paid, other.paid))

    def exceeds(self, other: Account) -> bool:
        """Whether these totals go beyond `other`'s (a give-back not yet confirmed by it)."""
        return self.merged(other) != other


@dataclass(frozen=True)
class Grant:
    """What `grant` gave (all zero and the refusing `limit` when the need could not be met), and the
    holder's account after it (None: the holder has none)."""

    requests: int = 0
    tokens: int = 0
    slots: int = 0
    limit: str | None = None
    limit_value: int | None = None
    retry_after_s: float = 0.0
    account: Account | None = None

    @property
    def granted(self) -> bool:
        return self.limit is None


@dataclass
class _Holder:
    id: str
    seen: float  # when the holder last settled (a give-back; its grant when opened)
    ticket: bool = False  # one request's slot: closed when the request ends
    granted: Amounts = Amounts()
    returned: Amounts = Amounts()
    paid: int = 0
    floor: int = 0

    @property
    def slots(self) -> int:
        return self.granted.slots - self.returned.slots

    def account(self) -> Account:
        return Account(self.id, self.granted, self.returned, self.paid)


@dataclass
class _Tenant:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    held: dict[str, _Holder] = field(default_factory=dict)  # holder -> its account
    requests_charged: int = 0  # since the ledger started: taken minus given back
    tokens_charged: int = 0

    def configure(self, limits: QuotaLimits, now: float) -> None:
        self.requests = _bucket(self.requests, limits.requests_per_minute, now)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, now)

    @property
    def slots_in_use(self) -> int:
        return sum(h.slots for h in self.held.values())


def _bucket(bucket: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, now)
    if bucket.capacity != per_minute:
        bucket.resize(per_minute, now)
    return bucket


class QuotaBook:
    """Every tenant's buckets and concurrency slots (see the module docstring).

    Two ways in: `admit`/`finish`/`refund` charge one request exactly (a ticket per request), and
    `grant`/`give_back` hand out and take back credit in bulk to a holder (an ingress's lease, see
    `tenancy.lease`). Slots are held by holders (a ticket is a holder of one slot); a holder that has
    not settled for `ticket_ttl_s` loses its slots and its account."""

    def __init__(self, clock: Callable[[], float], ticket_ttl_s: float = 900.0,
                 max_tenants: int = MAX_TENANTS):
        self._clock, self.ticket_ttl_s, self.max_tenants = clock, ticket_ttl_s, max_tenants
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._tickets = itertools.count(1)
        self._accounts = itertools.count(1)
        self.epoch = uuid.uuid4().hex[:12]  # accounts of another ledger never match this one's

    def __len__(self) -> int:
        """Tenants remembered (at most `max_tenants`, unless more have requests in flight)."""
        return len(self._tenants)

    def _state(self, tenant: str, limits: QuotaLimits, now: float) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            self._evict()
            state = self._tenants[tenant] = _Tenant()
        self._tenants.move_to_end(tenant)
        state.configure(limits, now)
        for holder, entry in list(state.held.items()):
            if now - entry.seen > self.ticket_ttl_s:
                del state.held[holder]
        return state

    def _evict(self) -> None:
        """Make room for one more tenant: forget the least recently used ones holding no slot
        (tenants with requests in flight are kept: the tenants file bounds them)."""
        excess = len(self._tenants) + 1 - self.max_tenants
        for name in [n for n, s in self._tenants.items() if not s.slots_in_use][:max(excess, 0)]:
            del self._tenants[name]

    def _open(self, state: _Tenant, holder: str, now: float, ticket: bool = False) -> _Holder:
        entry = state.held[holder] = _Holder(f"{self.epoch}-{next(self._accounts)}", now, ticket)
        return entry

    def grant(self, holder: str, tenant: str, limits: QuotaLimits, need: Amounts,
              extra: Amounts = Amounts(), seq: int = 0, floor: int = 0) -> Grant:
        """Give `holder` at least `need` (all of it, or nothing and the limit that refuses) and up
        to `extra` more of each, as far as the buckets and `max_concurrent` allow. `seq`, `floor`:
        the call's number and the holder's floor (see the module docstring; 0: not numbered)."""
        return self._grant(holder, tenant, limits, need, extra, seq, floor)

    def _grant(self, holder: str, tenant: str, limits: QuotaLimits, need: Amounts, extra: Amounts,
               seq: int, floor: int, ticket: bool = False) -> Grant:
        now = self._clock()
        state = self._state(tenant, limits, now)
        entry = state.held.get(holder)
        if entry is None and not ticket:  # opened even to refuse: the reply's floor is recorded
            entry = self._open(state, holder, now)
        if entry is not None:
            stale = seq < entry.floor
            entry.floor = max(entry.floor, floor)
            if stale:  # its holder gave up on this call: granting would strand the credit
                return Grant(account=entry.account())
        account = None if entry is None else entry.account()
        waits: list[tuple[float, str, int]] = []
        in_use = state.slots_in_use
        if limits.max_concurrent is not None and need.slots and in_use + need.slots > limits.max_concurrent:
            waits.append((CONCURRENCY_RETRY_S, "max_concurrent", limits.max_concurrent))
        if state.requests is not None and limits.requests_per_minute is not None and need.requests:
            waits.append((state.requests.wait_s(need.requests, now), "requests_per_minute",
                          limits.requests_per_minute))
        if state.tokens is not None and limits.tokens_per_minute is not None and need.tokens:
            waits.append((state.tokens.wait_s(need.tokens, now), "tokens_per_minute",
                          limits.tokens_per_minute))
        refusals = [w for w in waits if w[0] > 0]
        if refusals:
            wait, name, value = max(refusals)
            return Grant(limit=name, limit_value=value, retry_after_s=wait, account=account)
        requests = tokens = 0
        if state.requests is not None:
            requests = need.requests + min(extra.requests, max(0, int(state.requests.level) - need.requests))
            state.requests.take(requests, now)
            state.requests_charged += requests
        if state.tokens is not None:
            tokens = need.tokens + min(extra.tokens, max(0, int(state.tokens.level) - need.tokens))
            state.tokens.take(tokens, now)
            state.tokens_charged += tokens
        slots = 0
        if limits.max_concurrent is not None or ticket:
            cap = limits.max_concurrent
            room = extra.slots if cap is None else cap - in_use - need.slots
            slots = need.slots + max(0, min(extra.slots, room))
        if entry is None:
            entry = self._open(state, holder, now, ticket)
        entry.granted = _plus(entry.granted, Amounts(requests, tokens, slots))
        return Grant(requests, tokens, slots, account=entry.account())

    def give_back(self, holder: str, tenant: str, limits: QuotaLimits, totals: Account, seq: int = 0,
                  floor: int = 0) -> Account:
        """`holder` states its account's totals: what it has given back (unused credit, slots it no
        longer needs) and paid (completion tokens charged after the fact). What goes beyond the
        account's totals is applied, no more than was granted; the rest was applied before. Also says
        the holder is alive. Totals of another account are not applied (that account was reclaimed,
        or belongs to an earlier ledger). Returns the holder's account (a new, empty one if it had
        none)."""
        now = self._clock()
        state = self._state(tenant, limits, now)
        entry = state.held.get(holder)
        if entry is None:
            entry = self._open(state, holder, now)
        if seq < entry.floor:
            return entry.account()
        entry.floor = max(entry.floor, floor)  # recorded with every reply (see the module docstring)
        if totals.id != entry.id:
            return entry.account()
        entry.seen = now
        self._settle(state, entry, totals, now)
        return entry.account()

    def _settle(self, state: _Tenant, entry: _Holder, totals: Account, now: float) -> None:
        paid = max(0, totals.paid - entry.paid)
        g, r = entry.granted, entry.returned
        back = Amounts(
            max(0, min(totals.returned.requests, g.requests) - r.requests),
            max(0, min(totals.returned.tokens, g.tokens + entry.paid + paid) - r.tokens),
            max(0, min(totals.returned.slots, g.slots) - r.slots))
        entry.paid += paid
        entry.returned = _plus(r, back)
        if state.requests is not None:
            state.requests_charged -= back.requests
        if state.tokens is not None:
            state.tokens_charged += paid - back.tokens
        for bucket, amount in ((state.requests, back.requests), (state.tokens, back.tokens - paid)):
            if bucket is not None and amount:
                bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level + amount)

    def check(self, tenant: str, limits: QuotaLimits) -> Admission | None:
        """The `requests_per_minute` refusal one more request of `tenant` would get now (None: it
        may go on). A query: charges nothing (a request is cheap to refuse before its prompt is
        tokenized)."""
        state = self._tenants.get(tenant)
        if state is None or limits.requests_per_minute is None or state.requests is None:
            return None
        wait = state.requests.wait_s(1, self._clock())
        if wait <= 0:
            return None
        return Admission(None, "requests_per_minute", limits.requests_per_minute, wait)

    def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission:
        """Admit one request of `tenant` with `prompt_tokens` (charged now), or say which limit refuses."""
        ticket = next(self._tickets)
        need = Amounts(1 if limits.requests_per_minute else 0, prompt_tokens, 1)
        grant = self._grant(f"#{ticket}", tenant, limits, need, Amounts(), 0, 0, ticket=True)
        if not grant.granted:
            return Admission(None, grant.limit, grant.limit_value, grant.retry_after_s)
        return Admission(ticket)

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        """The request holding `ticket` ended after `completion_tokens`: charge them, free its slot."""
        self._close(tenant, ticket, lambda e: Account(e.id, e.granted, Amounts(slots=e.granted.slots),
                                                      max(completion_tokens, 0)))

    def refund(self, tenant: str, ticket: int) -> None:
        """The request holding `ticket` failed before its first token: give back its request, its
        prompt tokens and its slot (nothing was served)."""
        self._close(tenant, ticket, lambda e: Account(e.id, e.granted, e.granted))

    def _close(self, tenant: str, ticket: int, totals: Callable[[_Holder], Account]) -> None:
        state = self._tenants.get(tenant)
        entry = None if state is None else state.held.pop(f"#{ticket}", None)
        if state is not None and entry is not None:
            self._settle(state, entry, totals(entry), self._clock())

    def usage(self, tenant: str) -> dict[str, float | int | None]:
        """What `tenant` has left now (for tests and inspection): bucket levels, slots in use, and the
        requests and tokens charged since this ledger started (taken, less what was given back)."""
        state = self._tenants.get(tenant)
        if state is None:
            return {"requests_left": None, "tokens_left": None, "active": 0, "requests_charged": 0,
                    "tokens_charged": 0}
        now = self._clock()
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        return {"requests_left": None if state.requests is None else state.requests.level,
                "tokens_left": None if state.tokens is None else state.tokens.level,
                "active": state.slots_in_use, "requests_charged": state.requests_charged,
                "tokens_charged": state.tokens_charged}

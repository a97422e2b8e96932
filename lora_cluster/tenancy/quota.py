"""Per-tenant quotas: token buckets for requests and tokens per minute, and a concurrency count.

Semantics (one `QuotaBook` holds them for the whole cluster, see `lora_cluster.serve.quotas`):

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
died) is reclaimed after `ticket_ttl_s`. Tenants are kept in LRU order, at most `max_tenants`.

Pure: the clock is injected, no Ray, no I/O.
"""

from __future__ import annotations

import itertools
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


@dataclass(frozen=True)
class Grant:
    """What `grant` gave (all zero and the refusing `limit` when the need could not be met)."""

    requests: int = 0
    tokens: int = 0
    slots: int = 0
    limit: str | None = None
    limit_value: int | None = None
    retry_after_s: float = 0.0

    @property
    def granted(self) -> bool:
        return self.limit is None


@dataclass
class _Tenant:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    held: dict[str, list[float]] = field(default_factory=dict)  # holder -> [slots, last heard of]

    def configure(self, limits: QuotaLimits, now: float) -> None:
        self.requests = _bucket(self.requests, limits.requests_per_minute, now)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, now)

    @property
    def slots_in_use(self) -> int:
        return int(sum(h[0] for h in self.held.values()))


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

    Two ways in: `admit`/`finish` charge one request exactly (a ticket per request), and
    `grant`/`give_back` hand out and take back credit in bulk to a holder (an ingress's lease, see
    `tenancy.lease`). Slots are held by holders (a ticket is a holder of one slot); a holder not
    heard of for `ticket_ttl_s` loses its slots."""

    def __init__(self, clock: Callable[[], float], ticket_ttl_s: float = 900.0,
                 max_tenants: int = MAX_TENANTS):
        self._clock, self.ticket_ttl_s, self.max_tenants = clock, ticket_ttl_s, max_tenants
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._tickets = itertools.count(1)

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
        for holder, (_, seen) in list(state.held.items()):
            if now - seen > self.ticket_ttl_s:
                del state.held[holder]
        return state

    def _evict(self) -> None:
        """Make room for one more tenant: forget the least recently used ones holding no slot
        (tenants with requests in flight are kept: the tenants file bounds them)."""
        excess = len(self._tenants) + 1 - self.max_tenants
        for name in [n for n, s in self._tenants.items() if not s.held][:max(excess, 0)]:
            del self._tenants[name]

    def grant(self, holder: str, tenant: str, limits: QuotaLimits, need: Amounts,
              extra: Amounts = Amounts()) -> Grant:
        """Give `holder` at least `need` (all of it, or nothing and the limit that refuses) and up
        to `extra` more of each, as far as the buckets and `max_concurrent` allow."""
        now = self._clock()
        state = self._state(tenant, limits, now)
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
            return Grant(limit=name, limit_value=value, retry_after_s=wait)
        requests = tokens = 0
        if state.requests is not None:
            requests = need.requests + min(extra.requests, max(0, int(state.requests.level) - need.requests))
            state.requests.take(requests, now)
        if state.tokens is not None:
            tokens = need.tokens + min(extra.tokens, max(0, int(state.tokens.level) - need.tokens))
            state.tokens.take(tokens, now)
        room = extra.slots if limits.max_concurrent is None else limits.max_concurrent - in_use - need.slots
        slots = need.slots + max(0, min(extra.slots, room))
        entry = state.held.setdefault(holder, [0, now])
        entry[0], entry[1] = entry[0] + slots, now
        return Grant(requests, tokens, slots)

    def give_back(self, holder: str, tenant: str, unused: Amounts, debt_tokens: int = 0) -> None:
        """`holder` returns credit it did not use and slots it no longer needs, and pays
        `debt_tokens` (completion tokens charged after the fact). Also says the holder is alive."""
        state = self._tenants.get(tenant)
        if state is None:
            return
        now = self._clock()
        returns = ((state.requests, unused.requests), (state.tokens, unused.tokens - debt_tokens))
        for bucket, amount in returns:
            if bucket is not None and amount:
                bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level + amount)
        entry = state.held.get(holder)
        if entry is not None:
            entry[0], entry[1] = max(0, entry[0] - unused.slots), now
            if not entry[0]:
                del state.held[holder]

    def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Admission:
        """Admit one request of `tenant` with `prompt_tokens` (charged now), or say which limit refuses."""
        ticket = next(self._tickets)
        need = Amounts(1 if limits.requests_per_minute else 0, prompt_tokens, 1)
        grant = self.grant(f"#{ticket}", tenant, limits, need)
        if not grant.granted:
            return Admission(None, grant.limit, grant.limit_value, grant.retry_after_s)
        return Admission(ticket)

    def finish(self, tenant: str, ticket: int, completion_tokens: int) -> None:
        """The request holding `ticket` ended after `completion_tokens`: charge them, free its slot."""
        self.give_back(f"#{ticket}", tenant, Amounts(slots=1), max(completion_tokens, 0))

    def usage(self, tenant: str) -> dict[str, float | int | None]:
        """What `tenant` has left now (for tests and inspection): bucket levels and slots in use."""
        state = self._tenants.get(tenant)
        if state is None:
            return {"requests_left": None, "tokens_left": None, "active": 0}
        now = self._clock()
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        return {"requests_left": None if state.requests is None else state.requests.level,
                "tokens_left": None if state.tokens is None else state.tokens.level,
                "active": state.slots_in_use}

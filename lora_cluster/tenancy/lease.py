"""An ingress's lease on a tenant's quota: credit taken from the cluster's `QuotaBook` in batches, so
that most requests are admitted without a call to the ledger.

Each ingress keeps, per tenant, the requests, tokens and concurrency slots the ledger granted it.
A request is admitted locally when the lease covers it (one request, its prompt tokens, one free
slot); otherwise the ingress asks the ledger for what is missing (`need`) plus one lease's worth
more (`extra`: `lease_s` seconds of the limit, e.g. 10 requests of a 600/min tenant for 1 s), all
or nothing for the need. Completion tokens are charged to the lease when a request ends, and may
take it below zero (a debt the next grant or give-back pays). Every `lease_s` the ingress gives back
what a lease did not use since the last grant, the slots not in use, and its debt
(`returnable`), so credit is never stranded on an idle ingress for longer than that.

What the cluster sees: the ledger never hands out more than the buckets hold, so all ingresses
together never exceed a limit; an ingress may refuse (429) while another still holds unused credit,
for at most `lease_s`. A refusal on `requests_per_minute` is remembered until its Retry-After, so a
tenant far over its quota is refused without a ledger call per request.

Pure: the clock is passed in, the ledger is called by `lora_cluster.serve.quotas.LeasedQuotas`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_cluster.tenancy.quota import Amounts, Grant, QuotaLimits


@dataclass
class TenantLease:
    """One tenant's credit at one ingress."""

    requests: int = 0
    tokens: int = 0  # may be negative: completion tokens owed
    slots: int = 0
    active: int = 0
    granted_at: float = -math.inf
    blocked_until: float = -math.inf
    blocked_by: Grant | None = None

    def covers(self, limits: QuotaLimits, prompt_tokens: int) -> bool:
        return ((limits.requests_per_minute is None or self.requests >= 1)
                and (limits.tokens_per_minute is None or self.tokens >= prompt_tokens)
                and (limits.max_concurrent is None or self.active < self.slots))

    def take(self, limits: QuotaLimits, prompt_tokens: int) -> bool:
        """Admit one request from the lease (False: it does not cover it)."""
        if not self.covers(limits, prompt_tokens):
            return False
        if limits.requests_per_minute is not None:
            self.requests -= 1
        if limits.tokens_per_minute is not None:
            self.tokens -= prompt_tokens
        self.active += 1
        return True

    def need(self, limits: QuotaLimits, prompt_tokens: int) -> Amounts:
        """What the lease lacks for one request (debt included)."""
        return Amounts(
            requests=1 if limits.requests_per_minute is not None and self.requests < 1 else 0,
            tokens=max(0, prompt_tokens - self.tokens) if limits.tokens_per_minute is not None else 0,
            slots=1 if limits.max_concurrent is not None and self.active >= self.slots else 0)

    @staticmethod
    def extra(limits: QuotaLimits, lease_s: float) -> Amounts:
        """One lease's worth beyond the need: `lease_s` seconds of each rate (slots: none)."""
        def worth(per_minute: int | None) -> int:
            return 0 if per_minute is None else math.ceil(per_minute * lease_s / 60.0)
        return Amounts(worth(limits.requests_per_minute), worth(limits.tokens_per_minute), 0)

    def add(self, grant: Grant, now: float) -> None:
        self.requests += grant.requests
        self.tokens += grant.tokens
        self.slots += grant.slots
        self.granted_at = now

    def block(self, grant: Grant, now: float) -> None:
        """Remember a requests_per_minute refusal until its Retry-After (the others depend on the
        request: a smaller prompt may pass, a slot may free up)."""
        if grant.limit == "requests_per_minute":
            self.blocked_until, self.blocked_by = now + grant.retry_after_s, grant

    def blocked(self, now: float) -> Grant | None:
        """The remembered refusal with its Retry-After left, or None."""
        if self.blocked_by is None or now >= self.blocked_until:
            return None
        return Grant(limit=self.blocked_by.limit, limit_value=self.blocked_by.limit_value,
                     retry_after_s=self.blocked_until - now)

    def finish(self, limits: QuotaLimits, completion_tokens: int) -> None:
        """A request admitted from this lease ended after `completion_tokens`."""
        self.active = max(0, self.active - 1)
        if limits.tokens_per_minute is not None:
            self.tokens -= completion_tokens

    def returnable(self, now: float, lease_s: float) -> tuple[Amounts, int] | None:
        """(unused credit and free slots to give back, debt to pay), taken out of the lease; None
        when there is nothing to return (credit granted less than `lease_s` ago is kept)."""
        stale = now - self.granted_at >= lease_s
        unused = Amounts(self.requests if stale else 0, max(self.tokens, 0) if stale else 0,
                         self.slots - self.active)
        debt = max(-self.tokens, 0)
        if not (unused.requests or unused.tokens or unused.slots or debt):
            return None
        self.requests -= unused.requests
        self.tokens += debt - unused.tokens
        self.slots -= unused.slots
        return unused, debt

"""An ingress's lease on a tenant's quota: credit taken from the cluster's `QuotaBook` in batches, so
that most requests are admitted without a call to the ledger.

Each ingress keeps, per tenant, the requests, tokens and concurrency slots the ledger granted it.
A request is admitted locally when the lease covers it (one request, its prompt tokens, one free
slot); otherwise the ingress asks the ledger for what is missing (`need`) plus one lease's worth
more (`extra`: `lease_s` seconds of the limit, e.g. 10 requests of a 600/min tenant for 1 s), all
or nothing for the need. Completion tokens are charged to the lease when a request ends, and may
take it below zero (a debt the next grant or give-back pays); a request that failed before its
first token is `refund`ed. Every `lease_s` the ingress gives back what a lease did not use since the
last grant, the slots not in use, and its debt (`returnable`), so credit is never stranded on an
idle ingress for longer than that.

The lease and the ledger reconcile. What the lease holds is derived from the ledger's `Account` for
this holder (running totals of what was granted, given back and paid, carried by every reply) and
what the lease used since that account opened. So a grant whose reply never arrived still shows in
the next reply's account (and goes back at the next give-back), and nothing leaves the lease before
the ledger confirmed it: a give-back states totals, and what it gives back is held aside, unusable
and still sent with every later give-back, until an account shows it (a failed give-back loses
nothing, and one applied twice takes nothing twice). An account with another id (the ledger
restarted, or reclaimed the account after its ttl) replaces the lease's: the credit of the old one
is gone with it, the requests in flight stay, and their slots are asked for again with the next one.

What the cluster sees: the ledger never hands out more than the buckets hold, so all ingresses
together never exceed a limit; an ingress may refuse (429) while another still holds unused credit,
for at most `lease_s`. A refusal on `requests_per_minute` is remembered until its Retry-After, so a
tenant far over its quota is refused without a ledger call per request.

Pure: the clock is passed in, the ledger is called by `lora_cluster.serve.routing.quotas.RemoteQuotas`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from lora_cluster.tenancy.quota import Account, Amounts, Grant, QuotaLimits

REPLACED_ACCOUNTS = 8  # ids of replaced accounts remembered, so that their late replies are ignored


@dataclass
class TenantLease:
    """One tenant's credit at one ingress."""

    account: Account = field(default_factory=Account)  # the ledger's, as last heard
    sent: Account = field(default_factory=Account)  # the totals of the last give-back sent
    used_requests: int = 0  # admitted from this account (refunds taken off)
    used_tokens: int = 0  # prompt and completion tokens charged to this account
    active: int = 0
    granted_at: float = -math.inf
    blocked_until: float = -math.inf
    blocked_by: Grant | None = None
    next_seq: int = 1
    awaited: set[int] = field(default_factory=set)  # calls whose reply is awaited
    abandoned: int = 0  # the latest call given up on whose outcome no reply has shown yet (0: none)
    replaced: deque[str] = field(default_factory=lambda: deque(maxlen=REPLACED_ACCOUNTS))

    # ----- what the lease holds, derived from the account --------------------------------------------

    @property
    def returned(self) -> Amounts:
        """Given back: what the account shows, or more when a give-back is not confirmed yet."""
        totals = self.sent.merged(self.account) if self.sent.id == self.account.id else self.account
        return totals.returned

    @property
    def requests(self) -> int:
        return self.account.granted.requests - self.returned.requests - self.used_requests

    @property
    def tokens(self) -> int:
        """May be negative: completion tokens owed."""
        return self.account.granted.tokens - self.returned.tokens + self.account.paid - self.used_tokens

    @property
    def slots(self) -> int:
        return self.account.granted.slots - self.returned.slots

    @property
    def unsettled(self) -> bool:
        """A call was given up on and no reply has shown its outcome yet."""
        return self.abandoned > 0

    # ----- admission -----------------------------------------------------------------------------------

    def covers(self, limits: QuotaLimits, prompt_tokens: int) -> bool:
        return ((limits.requests_per_minute is None or self.requests >= 1)
                and (limits.tokens_per_minute is None or self.tokens >= prompt_tokens)
                and (limits.max_concurrent is None or self.active < self.slots))

    def take(self, limits: QuotaLimits, prompt_tokens: int) -> bool:
        """Admit one request from the lease (False: it does not cover it)."""
        if not self.covers(limits, prompt_tokens):
            return False
        if limits.requests_per_minute is not None:
            self.used_requests += 1
        if limits.tokens_per_minute is not None:
            self.used_tokens += prompt_tokens
        self.active += 1
        return True

    def need(self, limits: QuotaLimits, prompt_tokens: int) -> Amounts:
        """What the lease lacks for one more request (debt included; slots: one for it and one for
        each request in flight the account does not hold a slot for)."""
        return Amounts(
            requests=1 if limits.requests_per_minute is not None and self.requests < 1 else 0,
            tokens=max(0, prompt_tokens - self.tokens) if limits.tokens_per_minute is not None else 0,
            slots=max(0, self.active + 1 - self.slots) if limits.max_concurrent is not None else 0)

    @staticmethod
    def extra(limits: QuotaLimits, lease_s: float) -> Amounts:
        """One lease's worth beyond the need: `lease_s` seconds of each rate (slots: none)."""
        def worth(per_minute: int | None) -> int:
            return 0 if per_minute is None else math.ceil(per_minute * lease_s / 60.0)
        return Amounts(worth(limits.requests_per_minute), worth(limits.tokens_per_minute), 0)

    def add(self, grant: Grant, now: float) -> None:
        """A grant's reply: the account it carries (which holds what it gave)."""
        if grant.account is not None:
            self.reconcile(grant.account)
        if grant.granted:
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
            self.used_tokens += completion_tokens

    def refund(self, limits: QuotaLimits, prompt_tokens: int, same_account: bool = True) -> None:
        """A request admitted from this lease failed before its first token: its request and prompt
        tokens come back to the lease (when the account it was charged to is still this one)."""
        self.active = max(0, self.active - 1)
        if not same_account:
            return
        if limits.requests_per_minute is not None:
            self.used_requests -= 1
        if limits.tokens_per_minute is not None:
            self.used_tokens -= prompt_tokens

    # ----- settling with the ledger --------------------------------------------------------------------

    def reconcile(self, account: Account) -> None:
        """The ledger's account for this holder, from any reply: the same account's totals are
        merged (replies may come out of order); another account replaces this one (see the module
        docstring), unless it is one this lease already replaced (a late reply)."""
        if account.id == self.account.id:
            self.account = self.account.merged(account)
        elif account.id not in self.replaced:
            if self.account.id:
                self.replaced.append(self.account.id)
            self.account, self.sent = account, Account()
            self.used_requests = self.used_tokens = 0

    def returnable(self, now: float, lease_s: float) -> Account | None:
        """The totals to state in a give-back: what the account shows given back and paid, plus the
        credit unused since the last grant (credit granted less than `lease_s` ago is kept), the free
        slots and the debt. None when there is nothing to give back and no give-back is in doubt.
        Takes nothing out of the lease: `sending` does, until the ledger confirms."""
        stale = now - self.granted_at >= lease_s
        tokens = self.tokens
        unused = Amounts(max(self.requests, 0) if stale else 0, max(tokens, 0) if stale else 0,
                         max(self.slots - self.active, 0))
        debt = max(-tokens, 0)
        in_doubt = self.sent.id == self.account.id and self.sent.exceeds(self.account)
        if not (unused.requests or unused.tokens or unused.slots or debt or in_doubt):
            return None
        returned = self.returned
        return Account(self.account.id, self.account.granted,
                       Amounts(returned.requests + unused.requests, returned.tokens + unused.tokens,
                               returned.slots + unused.slots),
                       self.account.paid + debt)

    def report(self) -> Account:
        """The totals as they stand (a give-back that only says the holder is alive)."""
        return Account(self.account.id, self.account.granted, self.returned, self.account.paid)

    def sending(self, totals: Account) -> None:
        """A give-back of `totals` is being sent: what it gives back is held aside from now on."""
        if totals.id == self.account.id:
            self.sent = totals.merged(self.sent) if self.sent.id == totals.id else totals

    def open_call(self) -> tuple[int, int]:
        """A ledger call starts: its number and the floor it carries (every call numbered below the
        floor has ended or was given up on)."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        floor = min(self.awaited, default=seq)
        self.awaited.add(seq)
        return seq, floor

    def close_call(self, seq: int, floor: int, replied: bool) -> None:
        """A ledger call ended: with its reply, or given up on (timed out, failed)."""
        self.awaited.discard(seq)
        if not replied:
            self.abandoned = max(self.abandoned, seq)
        elif floor > self.abandoned:  # the ledger saw the floor first: the given-up calls are settled
            self.abandoned = 0

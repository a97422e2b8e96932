"""The quota ledger and the ingresses' leases reconcile: no slot or token is lost or charged twice
when replies never arrive, give-backs fail, clients go away or the ledger restarts; and a request
that fails before its first token is not charged.

The ledger is the real `QuotaLedger` class (its `QuotaBook`) called in process through a double of
its Ray Serve handle that can lose replies, fail calls, run them after their caller gave up on them,
and restart the ledger (a new book: Ray restarts the actor with none of its state)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from helpers import FakeClock

from lora_cluster.errors import (
    AdapterNotFoundError,
    ClusterOverloadedError,
    ClusterQueueTimeoutError,
    EngineStepError,
    QuotaUnavailableError,
)
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.routing.quotas import LocalQuotas, QuotaLedger, RemoteQuotas
from lora_cluster.tenancy.quota import Amounts, QuotaBook, QuotaLimits
from lora_cluster.tenancy.tenants import hash_key
from lora_cluster.tenancy.watch import TenantsWatcher

OK, LOST_BEFORE, LOST_AFTER, LATE = "ok", "lost before", "lost after", "late"


class LedgerHandle:
    """A `QuotaLedger` behind the shape of its Serve handle (`handle.grant.remote(...)`).

    Each call runs on the event loop a few steps after it was sent. `fate(method)` says what
    happens to it: OK (the reply arrives), LOST_BEFORE (the call fails before the ledger ran it),
    LOST_AFTER (the ledger ran it, its reply is lost), LATE (the caller gives up at once; the ledger
    runs it later). `hold`, when set, keeps every call from running until it is set. `restart()`
    replaces the ledger by a new one; calls not run yet run on the new one."""

    def __init__(self, clock: FakeClock, fate: Any = None, rng: random.Random | None = None):
        self.clock, self.fate, self.rng = clock, fate or (lambda method: OK), rng or random.Random(0)
        self.ledger = self._new()
        self.books = [self.ledger.book]
        self.hold: asyncio.Event | None = None
        self.calls: list[str] = []
        self.running: set[asyncio.Task] = set()

    def _new(self) -> Any:
        ledger = QuotaLedger.func_or_class(900.0)
        ledger.book = QuotaBook(self.clock, ticket_ttl_s=900.0)
        return ledger

    @property
    def book(self) -> QuotaBook:
        return self.ledger.book

    def restart(self) -> None:
        self.ledger = self._new()
        self.books.append(self.ledger.book)

    async def drained(self) -> None:
        """Every call sent has run (those run late included)."""
        while self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        handle = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future:
                return handle._send(method, args)
        return Method()

    def _send(self, method: str, args: tuple[Any, ...]) -> asyncio.Future:
        self.calls.append(method)
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        fate = self.fate(method)
        if fate in (LOST_BEFORE, LATE):
            reply.set_exception(TimeoutError())
        if fate != LOST_BEFORE:
            task = asyncio.ensure_future(self._run(method, args, reply, fate, self.rng.randint(0, 3)))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
        return reply

    async def _run(self, method: str, args: tuple[Any, ...], reply: asyncio.Future, fate: str,
                   steps: int) -> None:
        for _ in range(steps + (4 if fate == LATE else 0)):
            await asyncio.sleep(0)
        if self.hold is not None:
            await self.hold.wait()
        result = getattr(self.ledger, method)(*args)
        if reply.done():  # given up on (or cancelled by its caller): the ledger ran it all the same
            return
        if fate == LOST_AFTER:
            reply.set_exception(TimeoutError())
        else:
            reply.set_result(result)


async def steps(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def ingresses(handle: LedgerHandle, clock: FakeClock) -> tuple[RemoteQuotas, RemoteQuotas]:
    return (RemoteQuotas(handle, lease_s=1.0, clock=clock, background=False),
            RemoteQuotas(handle, lease_s=1.0, clock=clock, background=False))


# ----- slots leak: replies that never arrive, give-backs that fail ---------------------------------------


async def test_a_grant_whose_client_went_away_is_given_back_at_the_next_flush():
    clock = FakeClock()
    handle = LedgerHandle(clock)
    a, b = ingresses(handle, clock)
    limits = QuotaLimits(max_concurrent=1)
    handle.hold = asyncio.Event()
    request = asyncio.ensure_future(a.admit("fin", limits, 5))
    await steps(5)
    assert handle.calls == ["grant"], f"the request waits for a grant of the ledger: {handle.calls}"
    request.cancel()  # the client goes away while the grant is out
    handle.hold.set()  # ... and the ledger grants it
    await handle.drained()
    await steps(5)
    clock.now += 1.0
    await a.flush()
    assert handle.book.usage("fin")["active"] == 0, "the slot granted for the request that went away is back"
    assert (await b.admit("fin", limits, 5)).admitted, (
        "the tenant (max_concurrent=1) is not locked out: another ingress admits its next request")


async def test_a_grant_whose_reply_timed_out_is_given_back_at_the_next_flush():
    clock = FakeClock()
    fates = iter([LOST_AFTER])
    handle = LedgerHandle(clock, fate=lambda method: next(fates, OK))
    a, b = ingresses(handle, clock)
    limits = QuotaLimits(max_concurrent=1, tokens_per_minute=600)
    with pytest.raises(QuotaUnavailableError):
        await a.admit("fin", limits, 5)  # the ledger granted; the reply never came (503)
    await handle.drained()
    clock.now += 1.0
    await a.flush()
    usage = handle.book.usage("fin")
    assert usage["active"] == 0, f"the slot the ledger granted without a reply is given back: {usage}"
    assert (await b.admit("fin", limits, 5)).admitted, "the tenant (max_concurrent=1) is admitted again"


@pytest.mark.parametrize("fate", [LOST_BEFORE, LOST_AFTER])
async def test_a_failed_give_back_loses_neither_the_slots_nor_the_debt(fate):
    clock = FakeClock()
    fates = iter([OK, fate])  # the grant, then the first give-back
    handle = LedgerHandle(clock, fate=lambda method: next(fates, OK))
    a, b = ingresses(handle, clock)
    limits = QuotaLimits(max_concurrent=1, tokens_per_minute=600)
    admitted = await a.admit("fin", limits, 5)  # granted 5 + 10 tokens (one lease's worth) and a slot
    a.finish("fin", admitted.ticket, 20)  # owes 10: the debt and the slot go back at once (time stands still)
    with contextlib.suppress(QuotaUnavailableError):
        await a.flush()  # the give-back fails (the ledger ran it, or not)
    await handle.drained()
    await a.flush()
    usage = handle.book.usage("fin")
    assert usage["active"] == 0, f"the slot went back with the next flush ({fate})"
    assert usage["tokens_left"] == pytest.approx(600 - 25), (
        f"the ledger charged the prompt (5) and the completion (20), once: {usage} ({fate})")
    assert (await b.admit("fin", limits, 5)).admitted, "the tenant is admitted again"


def test_the_ttl_reclaims_a_holder_that_never_settles_even_while_it_takes_more():
    clock = FakeClock()
    book = QuotaBook(clock, ticket_ttl_s=60.0)
    limits = QuotaLimits(max_concurrent=2, requests_per_minute=6000)
    book.grant("ingress-a", "fin", limits, Amounts(slots=1))  # a slot the holder lost track of
    for _ in range(12):  # the tenant's traffic: the holder keeps taking requests, never gives back
        clock.now += 10.0
        assert book.grant("ingress-a", "fin", limits, Amounts(requests=1)).granted, "its traffic is served"
    assert book.usage("fin")["active"] == 0, "after the ttl (60 s) without a give-back, its slot is reclaimed"


async def test_without_max_concurrent_no_slot_is_given_back_or_recorded():
    clock = FakeClock()
    handle = LedgerHandle(clock)
    a, _ = ingresses(handle, clock)
    limits = QuotaLimits(requests_per_minute=600)  # no max_concurrent
    for _ in range(3):
        assert (await a.admit("fin", limits, 5)).admitted, "admitted from the lease"
    clock.now += 1.0
    await a.flush()
    usage = handle.book.usage("fin")
    assert usage["active"] == 0, f"the ledger records no slot for a tenant without the limit: {usage}"


# ----- randomized: two ingresses, several tenants, every kind of failure ---------------------------------

TENANTS = {
    "fin": QuotaLimits(requests_per_minute=600, tokens_per_minute=6000, max_concurrent=3),
    "hr": QuotaLimits(tokens_per_minute=2400, max_concurrent=2),
    "ops": QuotaLimits(requests_per_minute=300, tokens_per_minute=9000),  # no max_concurrent
}


@dataclass
class Served:
    """What the requests of one round were charged for, by what they did."""

    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANTS, 0))


async def one_request(quotas: RemoteQuotas, tenant: str, rng: random.Random, served: Served) -> None:
    """A request as the API runs it: admitted, then served (completion tokens), or failed before
    its first token (refunded); its client may go away at any point (the task is cancelled)."""
    limits = TENANTS[tenant]
    prompt = rng.randint(1, 40)
    try:
        admission = await quotas.admit(tenant, limits, prompt)
    except QuotaUnavailableError:  # 503: the ledger did not answer
        return
    if not admission.admitted:
        return
    try:
        await steps(rng.randint(0, 6))
        if rng.random() < 0.2:
            raise ApiException(describe(ClusterQueueTimeoutError("waited too long")))
    except (ApiException, asyncio.CancelledError):
        quotas.refund(tenant, admission.ticket, prompt)  # failed, or the client left, before a token
        return
    completion = rng.randint(0, 30)
    quotas.finish(tenant, admission.ticket, completion)
    served.requests[tenant] += 1
    served.tokens[tenant] += prompt + completion


async def one_round(handle: LedgerHandle, clock: FakeClock, quotas: tuple[RemoteQuotas, RemoteQuotas],
                    rng: random.Random, restart: bool) -> Served:
    served = Served()
    tasks = []
    for _ in range(60):
        tenant = rng.choice(list(TENANTS))
        task = asyncio.ensure_future(one_request(rng.choice(quotas), tenant, rng, served))
        tasks.append(task)
        if rng.random() < 0.5:
            await steps(rng.randint(0, 3))
        if rng.random() < 0.15:  # a client goes away: during its grant, its work, or after it ended
            rng.choice(tasks).cancel()
        if rng.random() < 0.1:  # the background flush of one ingress
            clock.now += 0.4
            await rng.choice(quotas).flush()
        if restart and len(tasks) == 30:
            handle.restart()
    await asyncio.gather(*tasks, return_exceptions=True)
    await handle.drained()
    return served


@pytest.mark.parametrize("seed", range(48))
async def test_randomized_the_ledger_holds_nothing_and_charged_exactly_what_was_served(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    failing = {"on": True}

    def fate(method: str) -> str:
        if not failing["on"]:
            return OK
        odds = {"grant": (0.06, 0.06, 0.06), "give_back": (0.12, 0.12, 0.12)}[method]
        draw = rng.random()
        for name, share in zip((LOST_BEFORE, LOST_AFTER, LATE), odds, strict=True):
            if draw < share:
                return name
            draw -= share
        return OK

    handle = LedgerHandle(clock, fate, rng)
    quotas = ingresses(handle, clock)
    for number in range(6):
        restart = number in (2, 4)
        failing["on"] = True
        book = handle.book
        before = {t: book.usage(t) for t in TENANTS}
        served = await one_round(handle, clock, quotas, rng, restart)
        failing["on"] = False
        clock.now += 2.0  # the leases' credit is over a lease old: one flush round gives it all back
        for ingress in quotas:
            await ingress.flush()
        await handle.drained()
        book = handle.book
        for tenant, limits in TENANTS.items():
            usage = book.usage(tenant)
            assert usage["active"] == 0, (
                f"seed {seed} round {number}: every request ended, {tenant} holds no slot: {usage}")
            start = before[tenant] if not restart else {"requests_charged": 0, "tokens_charged": 0}
            for limit, kind, served_of in (("tokens_per_minute", "tokens", served.tokens),
                                           ("requests_per_minute", "requests", served.requests)):
                if getattr(limits, limit) is None:
                    continue
                charged = usage[f"{kind}_charged"] - start[f"{kind}_charged"]
                if restart:  # the new ledger counts what each ingress charged after learning of it
                    assert 0 <= charged <= served_of[tenant], (
                        f"seed {seed} round {number}: the restarted ledger charged {tenant} {charged} "
                        f"{kind}, at most the {served_of[tenant]} served this round")
                else:
                    assert charged == served_of[tenant], (
                        f"seed {seed} round {number}: {tenant} was charged {charged} {kind} for "
                        f"{served_of[tenant]} served")


# ----- quota charged for work never done ------------------------------------------------------------------

FIN_KEY = "sk-fin-refund"
LIMITS = {"requests_per_minute": 6, "tokens_per_minute": 1000, "max_concurrent": 4}


class FailingDispatcher(FakeDispatcher):
    """Every job fails before its first token with `error`."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    async def start(self, job: Any, route: str) -> Any:
        raise ApiException(describe(self.error))

    async def start_all(self, jobs: list[Any], route: str, on_started: Any = None) -> list[Any]:
        raise ApiException(describe(self.error))


class CountingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded += 1
        return super().encode(text, add_special_tokens)


@contextlib.asynccontextmanager
async def app(tmp_path: Path, quotas: Any, dispatcher: Any = None,
              tokenizer: Any = None) -> AsyncIterator[httpx.AsyncClient]:
    path = tmp_path / "tenants.yaml"
    limits = "".join(f"\n    {k}: {v}" for k, v in LIMITS.items())
    path.write_text(f"""
tenants:
  - name: finance
    api_keys: ["{hash_key(FIN_KEY)}"]
    adapters: ["*"]{limits}
""")
    async with serving(tokenizer or FakeTokenizer(), dispatcher or FakeDispatcher(),
                       tenants=TenantsWatcher(str(path), start=False), quotas=quotas) as client:
        yield client


FAILURES = [
    (AdapterNotFoundError("a1", "no source has it"), 404),
    (ClusterOverloadedError("the cluster queue is full", 2.0), 429),
    (ClusterQueueTimeoutError("waited 30 s in the cluster queue"), 503),
    (EngineStepError("the forward pass failed"), 500),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
@pytest.mark.parametrize(("error", "status"), FAILURES, ids=[str(s) for _, s in FAILURES])
async def test_a_request_failing_before_its_first_token_is_not_charged(tmp_path, route, error, status):
    book = QuotaBook(FakeClock())
    body = ({"model": "a1", "prompt": "hello", "max_tokens": 3} if route == "/v1/completions"
            else {"inputs": "hello", "parameters": {"adapter_id": "a1", "max_new_tokens": 3}})
    async with app(tmp_path, LocalQuotas(book), FailingDispatcher(error)) as client:
        responses = [await client.post(route, json=body, headers={"x-api-key": FIN_KEY}) for _ in range(8)]
    assert [r.status_code for r in responses] == [status] * 8, (
        f"every request fails with {status}, none is refused by the quota (6/min): "
        f"{[r.status_code for r in responses]}")
    usage = book.usage("finance")  # time stands still: the buckets do not refill
    assert usage["requests_left"] == LIMITS["requests_per_minute"], f"no request was charged: {usage}"
    assert usage["tokens_left"] == LIMITS["tokens_per_minute"], f"no prompt token was charged: {usage}"
    assert usage["active"] == 0, f"no slot is held: {usage}"


async def test_a_served_request_is_charged_its_prompt_and_completion(tmp_path):
    book = QuotaBook(FakeClock())
    async with app(tmp_path, LocalQuotas(book)) as client:
        ok = await client.post("/v1/completions", headers={"x-api-key": FIN_KEY},
                               json={"model": "a1", "prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    usage = book.usage("finance")
    assert (usage["requests_left"], usage["tokens_left"]) == (6 - 1, 1000 - 5 - 3), (
        f"one request, its 5 prompt and 3 completion tokens: {usage}")


class SecondChoiceFails(FakeDispatcher):
    """A fan-out whose first choice starts (its first item carries a token) and whose second fails."""

    async def start_all(self, jobs: list[Any], route: str, on_started: Any = None) -> list[Any]:
        first = await self.start(jobs[0], route)
        if on_started is not None:
            on_started(first)
        raise ApiException(describe(ClusterOverloadedError("the cluster queue is full", 2.0)))


async def test_a_failed_fan_out_whose_first_choice_produced_a_token_is_charged(tmp_path):
    book = QuotaBook(FakeClock())
    async with app(tmp_path, LocalQuotas(book), SecondChoiceFails()) as client:
        failed = await client.post("/v1/completions", headers={"x-api-key": FIN_KEY},
                                   json={"model": "a1", "prompt": "hello", "max_tokens": 3, "n": 2})
    assert failed.status_code == 429, failed.text
    usage = book.usage("finance")
    assert (usage["requests_left"], usage["tokens_left"]) == (6 - 1, 1000 - 5 - 1), (
        f"work was done (a token of the first choice): the request, its prompt and that token are "
        f"charged: {usage}")


@pytest.mark.parametrize("kind", ["local", "remote"])
async def test_a_request_over_its_requests_per_minute_is_refused_before_its_prompt_is_tokenized(
        tmp_path, kind):
    clock = FakeClock()
    quotas = (LocalQuotas(QuotaBook(clock)) if kind == "local"
              else RemoteQuotas(LedgerHandle(clock), clock=clock, background=False))
    tokenizer = CountingTokenizer()
    body = {"model": "a1", "prompt": "hello", "max_tokens": 1}
    async with app(tmp_path, quotas, tokenizer=tokenizer) as client:
        responses = [await client.post("/v1/completions", json=body, headers={"x-api-key": FIN_KEY})
                     for _ in range(8)]
        statuses = [r.status_code for r in responses]
        encoded = tokenizer.encoded
        refused = await client.post("/v1/completions", json=body, headers={"x-api-key": FIN_KEY})
        chat = await client.post("/v1/chat/completions", headers={"x-api-key": FIN_KEY},
                                 json={"model": "a1", "messages": [{"role": "user", "content": "hi"}]})
        lorax = await client.post("/generate", headers={"x-api-key": FIN_KEY},
                                  json={"inputs": "hello", "parameters": {"adapter_id": "a1"}})
    assert statuses[:6] == [200] * 6 and 429 in statuses, f"6 requests per minute pass: {statuses}"
    assert [r.status_code for r in (refused, chat, lorax)] == [429] * 3, "the next ones are refused"
    assert "requests_per_minute=6" in refused.json()["error"]["message"], "the refusal names the limit"
    assert refused.headers.get("retry-after"), "with Retry-After"
    assert tokenizer.encoded == encoded, (
        f"a request refused by requests_per_minute is refused before its prompt is tokenized ({kind})")

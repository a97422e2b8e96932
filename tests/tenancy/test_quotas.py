"""Tenant quotas: the token buckets and concurrency count (pure, injected clock) and the 429s of the HTTP
app in process (several ingress replicas sharing one ledger on a real Ray Serve app: test_quotas_e2e.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from helpers import FakeClock

from lora_cluster.serve.routing.quotas import LocalQuotas, QuotaLedger, RemoteQuotas
from lora_cluster.tenancy.lease import TenantLease
from lora_cluster.tenancy.quota import Amounts, QuotaBook, QuotaLimits, TokenBucket
from lora_cluster.tenancy.tenants import hash_key
from lora_cluster.tenancy.watch import TenantsWatcher

# ----- pure: buckets and the book -------------------------------------------------------------------------


def test_a_bucket_holds_one_minute_and_refills_continuously():
    bucket = TokenBucket(60, now=0.0)
    bucket.take(60, now=0.0)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(1.0), "an empty 60/min bucket has one unit in 1 s"
    assert bucket.wait_s(1, now=0.5) == pytest.approx(0.5), "half a second later: half a second to wait"
    assert bucket.wait_s(1, now=1.0) == 0.0, "after a second a unit is there"
    bucket.refill(now=1000.0)
    assert bucket.level == 60, "it never holds more than its capacity"


def test_requests_per_minute_refuses_beyond_the_limit_and_says_when_to_retry():
    clock = FakeClock()
    book = QuotaBook(clock)
    limits = QuotaLimits(requests_per_minute=6)
    admitted = [book.admit("fin", limits, 1) for _ in range(6)]
    refused = book.admit("fin", limits, 1)
    assert all(a.admitted for a in admitted), "a full bucket admits one minute's worth at once"
    assert not refused.admitted, "the 7th request within the minute is refused"
    assert refused.limit == "requests_per_minute" and refused.limit_value == 6, "the refusal names the limit"
    assert refused.retry_after_s == pytest.approx(10.0), "one request refills in 60/6 = 10 s"
    clock.now += 10.0
    assert book.admit("fin", limits, 1).admitted, "after Retry-After the request is admitted"
    assert book.admit("hr", limits, 1).admitted, "another tenant has its own bucket"


def test_tokens_are_charged_for_the_prompt_at_admission_and_the_completion_when_it_ends():
    clock = FakeClock()
    book = QuotaBook(clock)
    limits = QuotaLimits(tokens_per_minute=600)  # 10 tokens per second
    first = book.admit("fin", limits, 100)
    assert book.usage("fin")["tokens_left"] == pytest.approx(500), "the prompt is charged at admission"
    book.finish("fin", first.ticket, 550)
    assert book.usage("fin")["tokens_left"] == pytest.approx(-50), "the completion may take it below zero"
    refused = book.admit("fin", limits, 20)
    assert not refused.admitted, "an empty bucket refuses"
    assert refused.limit == "tokens_per_minute", "the refusal names tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(7.0), "50 owed + 20 asked at 10 tokens/s: 7 s"
    assert book.usage("fin")["tokens_left"] == pytest.approx(-50), "a refused request is charged nothing"
    clock.now += 7.0
    assert book.admit("fin", limits, 20).admitted, "after Retry-After it is admitted"


def test_a_prompt_larger_than_the_whole_bucket_passes_when_the_bucket_is_full():
    book = QuotaBook(FakeClock())
    limits = QuotaLimits(tokens_per_minute=100)
    assert book.admit("fin", limits, 500).admitted, "a full bucket admits even an oversized prompt"
    assert not book.admit("fin", limits, 1).admitted, "then the tenant waits for the debt to refill"


def test_max_concurrent_counts_requests_until_they_finish():
    clock = FakeClock()
    book = QuotaBook(clock, ticket_ttl_s=60.0)
    limits = QuotaLimits(max_concurrent=2)
    a, b = book.admit("fin", limits, 1), book.admit("fin", limits, 1)
    refused = book.admit("fin", limits, 1)
    assert not refused.admitted and refused.limit == "max_concurrent", "a third concurrent request is refused"
    assert refused.retry_after_s == pytest.approx(1.0), "Retry-After: 1 s (requests end at unknown times)"
    book.finish("fin", a.ticket, 0)
    assert book.admit("fin", limits, 1).admitted, "a finished request frees its slot"
    clock.now += 61.0
    assert book.admit("fin", limits, 1).admitted, "slots whose finish never came are reclaimed after the ttl"
    assert b.admitted, "the second request had been admitted"


def test_a_refusal_names_the_limit_that_makes_the_request_wait_longest():
    book = QuotaBook(FakeClock())
    limits = QuotaLimits(requests_per_minute=1, tokens_per_minute=60)
    book.admit("fin", limits, 60)
    refused = book.admit("fin", limits, 60)
    assert refused.limit == "tokens_per_minute", "60 tokens at 1/s (60 s) outwait 1 request at 1/min (60 s)"
    assert refused.retry_after_s == pytest.approx(60.0), "and Retry-After is that limit's wait"


def test_a_lowered_limit_takes_effect_at_once_and_tenants_are_bounded():
    book = QuotaBook(FakeClock(), max_tenants=3)
    book.admit("fin", QuotaLimits(requests_per_minute=100), 1)
    lowered = QuotaLimits(requests_per_minute=1)
    assert book.admit("fin", lowered, 1).admitted, "the bucket, capped at the new capacity, holds one"
    assert not book.admit("fin", lowered, 1).admitted, "the lowered limit refuses the next request"
    for i in range(10):
        admitted = book.admit(f"t{i}", QuotaLimits(requests_per_minute=5), 1)
        book.finish(f"t{i}", admitted.ticket, 0)
    assert len(book) == 3, "at most max_tenants tenants are remembered"


# ----- leases: each ingress admits from credit granted in batches by the one ledger ----------------------


def test_a_lease_admits_from_its_credit_and_gives_back_what_it_did_not_use():
    clock = FakeClock()
    book = QuotaBook(clock)
    limits = QuotaLimits(requests_per_minute=600, tokens_per_minute=6000, max_concurrent=4)
    lease = TenantLease()
    assert lease.need(limits, 50) == Amounts(1, 50, 1), "an empty lease lacks a request, a prompt, a slot"
    assert lease.extra(limits, 1.0) == Amounts(10, 100, 0), "one lease's worth: 1 s of each rate, no slot"
    lease.add(book.grant("ingress", "fin", limits, Amounts(1, 50, 1), Amounts(10, 100, 0)), now=0.0)
    assert (lease.requests, lease.tokens, lease.slots) == (11, 150, 1), "the grant's account fills the lease"
    assert lease.take(limits, 50), "the lease covers one request"
    assert not lease.take(limits, 50), "the second needs a slot the lease does not hold"
    lease.finish(limits, 200)
    assert lease.tokens == -100, "completion tokens are charged to the lease (a debt of 100)"
    early = lease.returnable(0.5, lease_s=1.0)
    assert (early.returned, early.paid) == (Amounts(0, 0, 1), 100), (
        "before a lease's time: the free slot and the debt go back, the fresh credit stays")
    lease.sending(early)
    lease.reconcile(book.give_back("ingress", "fin", limits, early))
    late = lease.returnable(1.0, lease_s=1.0)
    assert (late.returned, late.paid) == (Amounts(10, 0, 1), 100), (
        "after it: the unused requests go back too (no tokens were left)")
    lease.sending(late)
    lease.reconcile(book.give_back("ingress", "fin", limits, late))
    assert lease.returnable(2.0, lease_s=1.0) is None, "then nothing is left to give back"
    usage = book.usage("fin")
    assert (usage["active"], usage["requests_charged"], usage["tokens_charged"]) == (0, 1, 250), (
        f"the ledger charged one request and its 250 tokens, and holds no slot: {usage}")


class InProcessHandle:
    """The ledger deployment's class called in process (its handle's `.method.remote(...)` shape)."""

    def __init__(self, ledger: Any):
        self.ledger, self.calls = ledger, 0

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                handle.calls += 1

                async def run() -> Any:
                    return getattr(handle.ledger, method)(*args)

                return asyncio.ensure_future(run())  # awaitable and cancellable, as a response
        return Call()


def ledger_of(clock: FakeClock) -> Any:
    ledger = QuotaLedger.func_or_class(900.0)
    ledger.book = QuotaBook(clock, ticket_ttl_s=900.0)
    return ledger


async def test_two_ingresses_on_one_ledger_never_exceed_a_limit_and_rarely_call_it():
    clock = FakeClock()
    handle = InProcessHandle(ledger_of(clock))
    a, b = RemoteQuotas(handle, lease_s=1.0, clock=clock), RemoteQuotas(handle, lease_s=1.0, clock=clock)
    limits = QuotaLimits(requests_per_minute=600)
    results = [await (a if i % 2 else b).admit("fin", limits, 1) for i in range(900)]
    admitted = sum(r.admitted for r in results)
    assert admitted == 600, f"both ingresses together admit the bucket's 600, no more: {admitted}"
    assert handle.calls <= 600 // 10 + 4, f"leases of 10 requests: about one call per 10 ({handle.calls})"
    refused = results[-1]
    assert refused.limit == "requests_per_minute" and refused.retry_after_s > 0, "a refusal names the limit"
    calls = handle.calls
    await a.admit("fin", limits, 1)
    assert handle.calls == calls, "a refusal is remembered until its Retry-After: no call for the next one"


async def test_unused_credit_and_free_slots_go_back_so_another_ingress_can_use_them():
    clock = FakeClock()
    handle = InProcessHandle(ledger_of(clock))
    a, b = RemoteQuotas(handle, lease_s=1.0, clock=clock), RemoteQuotas(handle, lease_s=1.0, clock=clock)
    limits = QuotaLimits(max_concurrent=2, tokens_per_minute=6000)
    first, second = await a.admit("fin", limits, 10), await a.admit("fin", limits, 10)
    refused = await b.admit("fin", limits, 10)
    assert first.admitted and second.admitted, "ingress a admits two concurrent requests"
    assert refused.limit == "max_concurrent", "a third one, on ingress b, is refused: max_concurrent=2"
    a.finish("fin", first.ticket, 500)
    clock.now += 1.0
    await a.flush()
    again = await b.admit("fin", limits, 10)
    assert again.admitted, "once a gave back the finished request's slot, b admits"
    usage = handle.ledger.book.usage("fin")
    assert usage["tokens_left"] <= 6000 + 100 - 10 * 3 - 500, (
        "the prompts and the completion tokens (a's debt, paid at its give-back) were charged")


# ----- HTTP in process: 429 with Retry-After for one tenant, the other one served -------------------------

FIN_KEY, HR_KEY = "sk-fin-quota", "sk-hr-quota"


@contextlib.asynccontextmanager
async def quota_app(tmp_path: Path, book: QuotaBook) -> AsyncIterator[httpx.AsyncClient]:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - name: finance
    api_keys: ["{hash_key(FIN_KEY)}"]
    adapters: ["*"]
    requests_per_minute: 6
    tokens_per_minute: 100000
    max_concurrent: 4
  - name: hr
    api_keys: ["{hash_key(HR_KEY)}"]
    adapters: ["*"]
""")
    watcher = TenantsWatcher(str(path), start=False)
    quotas = LocalQuotas(book)
    async with serving(FakeTokenizer(), FakeDispatcher(), tenants=watcher, quotas=quotas) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tenant_at_3x_its_quota_gets_429s_while_another_is_served(tmp_path, stream):
    book = QuotaBook(FakeClock())  # time stands still: 6 requests per minute are 6 requests in this test
    body = {"model": "a1", "prompt": "hello", "max_tokens": 3, "stream": stream}
    async with quota_app(tmp_path, book) as client:
        fin, hr = [], []
        for _ in range(18):  # 3x the tenant's requests_per_minute
            fin.append(await client.post("/v1/completions", json=body, headers={"x-api-key": FIN_KEY}))
            hr.append(await client.post("/v1/completions", json=body, headers={"x-api-key": HR_KEY}))
    statuses = [r.status_code for r in fin]
    assert statuses == [200] * 6 + [429] * 12, f"6 requests pass, the 12 beyond the quota are 429: {statuses}"
    refused = fin[-1]
    assert refused.headers["retry-after"] == "10", "Retry-After says when one request has refilled (60/6 s)"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error", "an OpenAI rate-limit error"
    assert "requests_per_minute=6" in error["message"], f"the message names the limit: {error['message']}"
    assert "'finance'" in error["message"], "and the tenant"
    assert [r.status_code for r in hr] == [200] * 18, "the other tenant is served throughout"
    usage = book.usage("finance")
    assert usage["active"] == 0, "every admitted request released its concurrency slot when it ended"
    assert usage["tokens_left"] == pytest.approx(100000 - 6 * (5 + 3)), (
        "each admitted request was charged its prompt (5) and completion (3) tokens")


async def test_a_request_refused_before_it_runs_releases_its_slot(tmp_path):
    book = QuotaBook(FakeClock())
    async with quota_app(tmp_path, book) as client:
        bad = await client.post("/v1/completions", headers={"x-api-key": FIN_KEY},
                                json={"model": "a1", "prompt": "hello", "max_tokens": 100_000})
    assert bad.status_code == 400, f"the request is refused: {bad.text}"
    assert book.usage("finance")["active"] == 0, "no slot is held by a refused request"

"""Tenants' monthly budgets at the ingress (`serve.ops.usage_budgets`), in process over a real usage
store file (`UsageSinkCore`): a used-up `refuse` budget is a 429 naming the budget (and a refused usage
record), a used-up `warn` budget is served with a warning header, the budget-use gauge is in the
scrape, and a store that cannot be read refuses nobody."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from tenant_app import ADMIN_KEY, FIN_KEY, HR_KEY, bearer

from lora_cluster.config import ServeConfig
from lora_cluster.serve.ops.usage_budgets import HEADER_BUDGET_WARNING, BudgetGuard
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.serve.ops.usage_sink import UsageSinkCore
from lora_cluster.tenancy.tenants import hash_key
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch, UsageRecord
from lora_cluster.tenancy.watch import TenantsWatcher

BODY = {"model": "fin-a", "prompt": "hi", "max_tokens": 2}
HR_BODY = {"model": "hr-a", "prompt": "hi", "max_tokens": 2}


def budgets_yaml() -> str:
    return f"""
admin_api_keys: ["{hash_key(ADMIN_KEY)}"]
tenants:
  - name: finance
    api_keys: ["{hash_key(FIN_KEY)}"]
    adapters: ["fin-*"]
    budget: {{tokens_per_month: 100, action: refuse}}
  - name: hr
    api_keys: ["{hash_key(HR_KEY)}"]
    adapters: ["hr-*"]
    budget: {{device_seconds_per_month: 1.0}}
"""


def used(rid: str, tenant: str, tokens: int, device_s: float) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant=tenant, adapter="a", version=0, sla_class="standard",
                       base_model="base", replica="r0", prompt_tokens=tokens, cached_tokens=0,
                       output_tokens=0, device_s=device_s, queue_s=0.0, outcome=Outcome.COMPLETED,
                       ended_at=time.time())


@pytest.fixture
async def store(tmp_path) -> AsyncIterator[UsageSinkCore]:
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=86400.0)
    yield sink
    sink.close()


async def until_status(client: httpx.AsyncClient, status: int, body: dict, key: str) -> httpx.Response:
    """Ask until the answer has `status` (the guard's first reading of the store lands within a few
    refresh periods), at most 100 times."""
    for _ in range(100):
        reply = await client.post("/v1/completions", json=body, headers=bearer(key))
        if reply.status_code == status:
            return reply
        await asyncio.sleep(0.02)
    return reply


async def test_a_used_up_refuse_budget_is_a_429_naming_the_budget(tmp_path, store):
    (tmp_path / "tenants.yaml").write_text(budgets_yaml())
    watcher = TenantsWatcher(str(tmp_path / "tenants.yaml"), start=False)
    await store.record(UsageBatch("seed", 1, (used("old-1", "finance", 150, 0.1),)))
    shipper = UsageShipper(store.record, background=False)
    config = ServeConfig(model="base", usage_budget_refresh_s=0.02)
    async with serving(FakeTokenizer(), FakeDispatcher(), config, tenants=watcher, usage=store,
                       refusals=RefusalMeter(shipper, "base")) as client:
        reply = await until_status(client, 429, BODY, FIN_KEY)
        scrape = (await client.get("/metrics", headers=bearer(ADMIN_KEY))).text
    assert reply.status_code == 429, f"finance used 150 of its 100 tokens this month: {reply.text}"
    error = reply.json()["error"]
    assert error["code"] == "budget_exceeded", f"the code says which limit: {error}"
    assert "finance" in error["message"] and "tokens_per_month=100" in error["message"], \
        f"the message names the tenant and the budget: {error['message']}"
    assert int(reply.headers["retry-after"]) > 0, "Retry-After: when the month ends"
    assert [r.outcome for r in shipper.buffer.take()][-1] is Outcome.REFUSED, "the refusal is a usage record"
    assert 'lora_cluster_usage_budget_used_ratio{budget="tokens_per_month",tenant="finance"} 1.5' in scrape, \
        "the gauge says finance used 150% of its tokens budget"


async def test_a_used_up_warn_budget_is_served_with_a_warning(tmp_path, store):
    (tmp_path / "tenants.yaml").write_text(budgets_yaml())
    watcher = TenantsWatcher(str(tmp_path / "tenants.yaml"), start=False)
    await store.record(UsageBatch("seed", 1, (used("old-2", "hr", 10, 1.5),)))
    config = ServeConfig(model="base", usage_budget_refresh_s=0.02)
    async with serving(FakeTokenizer(), FakeDispatcher(), config, tenants=watcher, usage=store) as client:
        for _ in range(100):
            reply = await client.post("/v1/completions", json=HR_BODY, headers=bearer(HR_KEY))
            if HEADER_BUDGET_WARNING in reply.headers:
                break
            await asyncio.sleep(0.02)
    assert reply.status_code == 200, f"a warn budget never refuses: {reply.text}"
    assert "device_seconds_per_month=1" in reply.headers.get(HEADER_BUDGET_WARNING, ""), \
        f"the header names the used-up budget: {dict(reply.headers)}"


class DownStore:
    async def query(self, **filters):
        raise ConnectionError("the usage store is down")


async def test_a_store_that_cannot_be_read_refuses_nobody(tmp_path):
    (tmp_path / "tenants.yaml").write_text(budgets_yaml())
    watcher = TenantsWatcher(str(tmp_path / "tenants.yaml"), start=False)
    guard = BudgetGuard(DownStore(), watcher, refresh_s=60.0)
    await guard.refresh()
    guard.check(watcher.current().tenants["finance"])  # no reading: within budget
    guard.close()

"""Adapter residency on GET /v1/usage (issue 48): the slot-seconds and load seconds a replica shipped
appear per adapter when grouped by adapter, for an admin; a tenant's key never sees them (the store
keeps them per adapter, not per tenant). Real SQLite store, the real route, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from lora_cluster.serve.http.usage_api import usage_router
from lora_cluster.serve.ops.usage_sink import UsageSinkCore
from lora_cluster.serve.routing.auth import Caller, current_caller
from lora_cluster.tenancy.tenants import ADMIN, Principal
from lora_cluster.tenancy.usage_record import Outcome, Residency, UsageBatch, UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore


def _app(core: UsageSinkCore, principal: Principal) -> TestClient:
    app = FastAPI()
    app.include_router(usage_router(core))
    app.dependency_overrides[current_caller] = lambda: Caller(principal)
    return TestClient(app)


def test_usage_grouped_by_adapter_shows_slot_and_load_seconds_to_an_admin_only(tmp_path):
    core = UsageSinkCore(str(tmp_path / "usage.db"), 365 * 86400.0)
    record = UsageRecord(request_id="q1", tenant="acme", adapter="a1", version=1, sla_class="standard",
                         base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=0, output_tokens=5,
                         device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=1_795_995_601.0)
    core.store.record_batch(UsageBatch("r0-x", 1, (record,), (
        Residency(29_933_260, "a1@1", "r0", 12.0, 0.5), Residency(29_933_260, "b2@3", "r0", 4.0, 0.25))))
    admin = _app(core, ADMIN).get("/v1/usage", params={"group_by": "adapter"})
    assert admin.status_code == 200, admin.text
    rows = {r["adapter"]: r for r in admin.json()["data"]}
    assert (rows["a1"]["requests"], rows["a1"]["slot_s"], rows["a1"]["load_s"]) == (1, 12.0, 0.5)
    assert (rows["b2"]["requests"], rows["b2"]["slot_s"], rows["b2"]["load_s"]) == (0, 4.0, 0.25), \
        "an adapter resident without requests has a row of its own"
    tenant = Principal(tenant=SimpleNamespace(name="acme"), admin=False)  # type: ignore[arg-type]
    own = _app(core, tenant).get("/v1/usage", params={"group_by": "adapter"}).json()["data"]
    assert [r["adapter"] for r in own] == ["a1"] and "slot_s" not in own[0]
    core.close()


def test_a_store_from_before_load_seconds_gets_the_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE usage_residency (minute BIGINT, adapter TEXT, replica TEXT, "
               "slot_s DOUBLE PRECISION, PRIMARY KEY (minute, adapter, replica))")
    db.execute("INSERT INTO usage_residency VALUES (1, 'a1@1', 'r0', 2.0)")
    db.commit()
    db.close()
    store = UsageStore(path)
    store.record_residency(1, "r0", {"a1@1": 1.0}, {"a1@1": 0.5})
    assert store.residency() == {"a1@1": 3.0} and store.loads() == {"a1@1": 0.5}
    store.close()

"""Usage records from the LoRA replicas to the usage store on a real Ray Serve app (conftest's
`tenants_app`, this module's tenants `usage-a` and `usage-b`; the store is the session's
`LORA_CLUSTER_USAGE_DB_PATH` file): one record per request with the tokens the client received,
`GET /v1/usage` scoped to the caller's tenant (and `lora-cluster usage --url`), nothing lost
when the usage-store deployment's actor is killed and Serve starts it again, and a used-up monthly
budget (tenant `usage-capped`, action refuse) refused with a 429 naming it and recorded as refused,
exactly one record per request under random client disconnects (tenant `usage-chaos`), and the
adapters' slot-seconds and load time shipped by the replicas, read by an admin."""

from __future__ import annotations

import json
import os
import random
import time

import httpx
import pytest
from shared_apps import QUOTA_ADMIN, USAGE_A, USAGE_B, USAGE_CAPPED, USAGE_CHAOS

from lora_cluster.cli import main
from lora_cluster.tenancy.usage_store import UsageStore

TENANTS = {"usage-a": USAGE_A, "usage-b": USAGE_B}


def complete(url: str, key: str) -> int:
    """One completion; the output tokens the client received."""
    body = {"model": "a1", "prompt": "the river", "max_tokens": 3, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                       timeout=60)
    assert reply.status_code == 200, f"the request is served: {reply.text}"
    return reply.json()["usage"]["completion_tokens"]


def stored(tenant: str) -> dict[str, object]:
    store = UsageStore(os.environ["LORA_CLUSTER_USAGE_DB_PATH"])
    try:
        rows = store.query(group_by=(), tenant=tenant)
    finally:
        store.close()
    return rows[0] if rows else {"requests": 0, "output_tokens": 0}


def wait_for(tenant: str, requests: int, timeout_s: float = 30.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    row = stored(tenant)
    while row["requests"] < requests and time.monotonic() < deadline:
        time.sleep(0.2)
        row = stored(tenant)
    time.sleep(0.5)  # a second record of the same request would land within a few flushes
    return stored(tenant)


@pytest.mark.e2e
def test_each_request_is_one_record_with_the_tokens_the_client_received(tenants_app):
    sent = {"usage-a": [complete(tenants_app, USAGE_A) for _ in range(3)],
            "usage-b": [complete(tenants_app, USAGE_B) for _ in range(2)]}
    for tenant, tokens in sent.items():
        row = wait_for(tenant, len(tokens))
        assert row["requests"] == len(tokens), f"{tenant}: one record per request, no more: {row}"
        assert row["output_tokens"] == sum(tokens), f"{tenant}: the output tokens the client received: {row}"
        assert row["device_s"] > 0, f"{tenant}: device time is charged: {row}"


def over_http(url: str, key: str, **params: object) -> httpx.Response:
    return httpx.get(f"{url}/v1/usage", params=params, headers={"authorization": f"Bearer {key}"},
                     timeout=30)


@pytest.mark.e2e
def test_a_tenant_reads_only_its_own_usage_and_an_admin_reads_any(tenants_app, capsys):
    wait_for("usage-b", 1)
    own = over_http(tenants_app, USAGE_A, group_by="tenant")
    assert own.status_code == 200, f"a tenant reads its usage: {own.text}"
    assert [r["tenant"] for r in own.json()["data"]] == ["usage-a"], f"only its own tenant: {own.json()}"
    assert own.json()["data"][0]["requests"] == stored("usage-a")["requests"], "the store's sums"
    other = over_http(tenants_app, USAGE_A, tenant="usage-b")
    assert other.status_code == 403, f"another tenant's usage is refused: {other.text}"
    admin = over_http(tenants_app, QUOTA_ADMIN, tenant="usage-b")
    assert admin.json()["data"][0]["requests"] == stored("usage-b")["requests"], \
        f"an admin reads any tenant's usage: {admin.text}"
    status = main(["usage", "--url", tenants_app, "--api-key", USAGE_B, "--format", "csv"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0, "lora-cluster usage --url succeeds"
    assert [line.split(",")[0] for line in lines[1:]] == ["usage-b"], f"the CLI reads the route: {lines}"


@pytest.mark.e2e
def test_an_admin_reads_the_residency_and_load_time_the_replicas_shipped(tenants_app):
    complete(tenants_app, USAGE_A)  # a1 is resident on a replica, loaded there at least once
    deadline, row = time.monotonic() + 30.0, {}
    while time.monotonic() < deadline:
        rows = over_http(tenants_app, QUOTA_ADMIN, group_by="adapter").json()["data"]
        row = next((r for r in rows if r["adapter"] == "a1"), {})
        if row.get("slot_s", 0) > 0 and row.get("load_s", 0) > 0:
            break
        time.sleep(0.5)
    assert row.get("slot_s", 0) > 0, f"a1's slot-seconds reached the store through the replicas: {row}"
    assert row.get("load_s", 0) > 0, f"a1's load time reached the store through the replicas: {row}"
    own = over_http(tenants_app, USAGE_A, group_by="adapter").json()["data"]
    assert all("slot_s" not in r for r in own), f"a tenant's key gets no residency columns: {own}"


@pytest.mark.e2e
def test_usage_survives_a_kill_of_the_usage_store_actor(tenants_app):
    import ray

    before = wait_for("usage-a", 1)["requests"]
    sinks = [a for a in ray.util.list_named_actors(all_namespaces=True) if "UsageSink" in a["name"]]
    assert len(sinks) == 1, f"one usage-store replica runs: {sinks}"
    ray.kill(ray.get_actor(sinks[0]["name"], namespace=sinks[0]["namespace"]), no_restart=True)
    complete(tenants_app, USAGE_A)  # its record waits in the replica's buffer until the store is back
    row = wait_for("usage-a", before + 1, timeout_s=60.0)
    assert row["requests"] == before + 1, f"the usage before the kill is kept and the new record lands: {row}"
    reply = over_http(tenants_app, USAGE_A)
    assert reply.json()["data"][0]["requests"] == before + 1, \
        f"the restarted usage store reports the usage from before the kill: {reply.text}"


@pytest.mark.e2e
def test_a_used_up_budget_is_refused_and_recorded(tenants_app):
    served = [complete(tenants_app, USAGE_CAPPED)]  # within budget: nothing used yet this month
    wait_for("usage-capped", 1)
    body = {"model": "a1", "prompt": "the river", "max_tokens": 3, "temperature": 0}
    deadline = time.monotonic() + 30.0  # every ingress reads the store every 0.5 s (usage_budget_refresh_s)
    reply = None
    while time.monotonic() < deadline:
        reply = httpx.post(f"{tenants_app}/v1/completions", json=body, timeout=60,
                           headers={"authorization": f"Bearer {USAGE_CAPPED}"})
        if reply.status_code != 200:
            break
        served.append(reply.json()["usage"]["completion_tokens"])  # an ingress whose reading was older
        time.sleep(0.2)
    assert reply is not None and reply.status_code == 429, f"the budget refuses: {reply and reply.text}"
    error = reply.json()["error"]
    assert error["code"] == "budget_exceeded", f"a budget refusal: {error}"
    assert "tokens_per_month=1" in error["message"], f"the message names the budget: {error['message']}"
    row = wait_for("usage-capped", len(served) + 1)
    assert row["requests"] == len(served) + 1, f"each served request and the refusal, one record each: {row}"
    assert row["output_tokens"] == sum(served), f"the tokens the client received; a refusal adds none: {row}"


def stream_until(url: str, max_tokens: int, stop_after: int | None) -> tuple[str, int, bool]:
    """A streamed completion read to its end, or dropped (the connection closed) once `stop_after`
    chunks came: (its id, tokens received: the final usage's, or for a dropped stream the chunks
    received, each of at least one token; whether it was read to the end)."""
    body = {"model": "a1", "prompt": "the river", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    rid, chunks, tokens = "", 0, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {USAGE_CHAOS}"}) as reply:
        assert reply.status_code == 200, "precondition: the stream is accepted"
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            rid = chunk["id"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return rid, chunks, False
    return rid, tokens, True


@pytest.mark.e2e
def test_random_client_disconnects_leave_exactly_one_record_per_request(tenants_app):
    rng = random.Random(48)
    sent = []
    for _ in range(10):  # bounded: 10 short streams, about a second each
        stop_after = rng.choice([None, 1, 2])
        sent.append(stream_until(tenants_app, rng.choice([4, 24]), stop_after))
    assert any(not whole for _, _, whole in sent), "precondition: some clients went away mid-stream"
    row = wait_for("usage-chaos", len(sent))
    assert row["requests"] == len(sent), f"one record per request, disconnected or not: {row}"
    store = UsageStore(os.environ["LORA_CLUSTER_USAGE_DB_PATH"])
    try:
        for rid, received, whole in sent:
            record = store.get(f"{rid}-0")  # the request's one choice (job `<id>-0`)
            assert record is not None, f"{rid}: its record"
            if whole:
                assert record.output_tokens == received, f"{rid}: the tokens the client received: {record}"
            else:
                assert record.output_tokens >= received, f"{rid}: at least what was sent before the drop"
    finally:
        store.close()

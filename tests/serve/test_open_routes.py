"""Which routes answer without an API key while a tenants file is in force: only the `open_routes`
setting's (default /health). The schema and its pages need a key, /metrics (whose labels name every
tenant's adapters and tenants) an admin key; the schema declares exactly that. The app is built in
process around the tenants' fake replica (`tenant_app.ZooDispatcher`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_client import FakeTokenizer, serving
from tenant_app import ADMIN_KEY, FIN_KEY, ZooDispatcher, bearer

from lora_cluster.config import ServeConfig
from lora_cluster.errors import ConfigError
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.ingress import build_fastapi
from lora_cluster.tenancy.watch import TenantsWatcher

DESCRIPTION = ["/openapi.json", "/docs", "/redoc"]


@contextlib.asynccontextmanager
async def app_client(config: ServeConfig, tenants_file: Path | None) -> AsyncIterator[httpx.AsyncClient]:
    watcher = None if tenants_file is None else TenantsWatcher(str(tenants_file), start=False)
    async with serving(FakeTokenizer(), ZooDispatcher(), config, tenants=watcher) as client:
        yield client


async def _statuses(client: httpx.AsyncClient, paths: list[str], headers: dict[str, str]) -> dict[str, int]:
    return {path: (await client.get(path, headers=headers)).status_code for path in paths}


async def test_the_schema_and_its_pages_need_a_key_by_default(tenants_file):
    async with app_client(ServeConfig(model="base"), tenants_file) as client:
        anonymous = await _statuses(client, DESCRIPTION, {})
        tenant = await _statuses(client, DESCRIPTION, bearer(FIN_KEY))
    assert anonymous == dict.fromkeys(DESCRIPTION, 401), f"no key: 401 on the schema and pages: {anonymous}"
    assert tenant == dict.fromkeys(DESCRIPTION, 200), f"a tenant's key reads the API's description: {tenant}"


async def test_metrics_needs_an_admin_key_by_default(tenants_file):
    async with app_client(ServeConfig(model="base"), tenants_file) as client:
        await client.post("/v1/completions", json={"model": "hr-a", "prompt": "hi", "max_tokens": 2},
                          headers=bearer("sk-hr-0123456789"))
        anonymous = await client.get("/metrics")
        tenant = await client.get("/metrics", headers=bearer(FIN_KEY))
        admin = await client.get("/metrics", headers=bearer(ADMIN_KEY))
    assert anonymous.status_code == 401, f"no key: /metrics is refused: {anonymous.text}"
    assert tenant.status_code == 403, f"a tenant may not read other tenants' labels: {tenant.text}"
    assert "hr" not in tenant.text, "the refusal names no other tenant"
    assert admin.status_code == 200, f"an admin key scrapes /metrics: {admin.text}"
    assert "lora_cluster_requests_total" in admin.text, "the admin's scrape is the metrics"


async def test_health_stays_open_by_default(tenants_file):
    async with app_client(ServeConfig(model="base"), tenants_file) as client:
        health = await client.get("/health")
    assert health.status_code == 200, f"/health answers probes without a key: {health.text}"


async def test_open_routes_opens_exactly_the_routes_it_lists(tenants_file, monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_OPEN_ROUTES", '["/health", "/metrics", "/openapi.json"]')
    config = ServeConfig(model="base")
    async with app_client(config, tenants_file) as client:
        opened = await _statuses(client, ["/metrics", "/openapi.json"], {})
        closed = await _statuses(client, ["/docs", "/v1/models"], {})
    assert config.tenancy.open_routes == ["/health", "/metrics", "/openapi.json"], (
        "LORA_CLUSTER_OPEN_ROUTES sets it")
    assert opened == {"/metrics": 200, "/openapi.json": 200}, f"the listed routes need no key: {opened}"
    assert closed == {"/docs": 401, "/v1/models": 401}, f"the others still do: {closed}"


def test_an_open_route_that_is_not_a_route_stops_the_app_from_starting(tenants_file):
    ctx = ApiContext(config=ServeConfig(model="base", open_routes=["/health", "/metric"]),
                     tokenizer=FakeTokenizer(), dispatcher=ZooDispatcher(),
                     tenants=TenantsWatcher(str(tenants_file), start=False))
    try:
        with pytest.raises(ConfigError) as raised:
            build_fastapi(ctx)
    finally:
        ctx.close()
    assert "/metric" in str(raised.value), f"the error names the unknown route: {raised.value}"


def test_an_open_route_must_be_a_path():
    with pytest.raises(ValueError) as raised:
        ServeConfig(model="base", open_routes=["health"])
    assert "open_routes" in str(raised.value), f"the error names the setting: {raised.value}"


def _security(schema: dict[str, Any], path: str, method: str = "get") -> Any:
    return schema["paths"][path][method].get("security")


async def test_the_schema_says_which_routes_need_a_key(tenants_file):
    async with app_client(ServeConfig(model="base"), tenants_file) as client:
        secured = (await client.get("/openapi.json", headers=bearer(FIN_KEY))).json()
    async with app_client(ServeConfig(model="base"), None) as client:
        open_ = (await client.get("/openapi.json")).json()
    schemes = secured["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}, f"both key headers: {schemes}"
    assert _security(secured, "/health") is None, "/health declares no key"
    assert _security(secured, "/metrics"), "/metrics declares a key"
    assert _security(secured, "/v1/completions", "post"), "the generation routes declare a key"
    assert "401" in secured["paths"]["/metrics"]["get"]["responses"], "/metrics declares its 401"
    assert "securitySchemes" not in open_.get("components", {}), "without a tenants file no key is declared"
    assert _security(open_, "/v1/completions", "post") is None, "nor required"

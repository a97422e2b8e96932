"""Query parameters are read as the schema declares them (serve.http.query_values): one value each, in
JSON's spelling. The schemathesis CLI found `GET /v1/usage?adapter=a&adapter=b` answered 200 (FastAPI
took the last `adapter`) where the schema's single string says it is invalid; pydantic alone also read
`version=1_0`, `00` or ` 1` as integers and `fresh=yes` as true. An integer is any JSON number without
a fraction, as JSON Schema's `integer` (schemathesis sends `version=15.0` as a valid one). The real
usage route over a real SQLite store, and the real ingress app for `/debug/replicas`; no Ray."""

from __future__ import annotations

import asyncio

import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lora_cluster.serve.http.usage_api import usage_router
from lora_cluster.serve.ops.usage_sink import UsageSinkCore
from lora_cluster.serve.routing.auth import Caller, current_caller
from lora_cluster.tenancy.tenants import ADMIN


@pytest.fixture
def usage(tmp_path) -> TestClient:
    core = UsageSinkCore(str(tmp_path / "usage.db"), 86400.0)
    app = FastAPI()
    app.include_router(usage_router(core))
    app.dependency_overrides[current_caller] = lambda: Caller(ADMIN)
    yield TestClient(app)
    core.close()


@pytest.mark.parametrize("query", ["adapter=a&adapter=b", "version=1&version=2", "since=1&since=2",
                                   "group_by=tenant&group_by=adapter", "tenant=x&tenant=x"])
def test_a_parameter_given_twice_is_refused_by_name(usage, query):
    name = query.split("=")[0]
    answer = usage.get(f"/v1/usage?{query}")
    assert answer.status_code == 422, f"{query}: {answer.status_code} {answer.text}"
    assert answer.json()["detail"][0]["loc"] == ["query", name], f"the error names {name!r}: {answer.text}"


@pytest.mark.parametrize("value", ["1.5", "1e-1", "1_0", " 1", "00", "true", "0x1", "",
                                   "1e99999999999999999999"])
def test_an_integer_parameter_takes_only_a_json_number_without_a_fraction(usage, value):
    answer = usage.get("/v1/usage", params={"version": value})
    assert answer.status_code == 422, f"version={value!r}: {answer.status_code} {answer.text}"


@pytest.mark.parametrize("value", ["1_700_000_000", " 1", "+1", "1.", ".5", "01", "nan", "Infinity"])
def test_a_number_parameter_takes_only_a_number_as_json_writes_it(usage, value):
    answer = usage.get("/v1/usage", params={"since": value})
    assert answer.status_code == 422, f"since={value!r}: {answer.status_code} {answer.text}"


@pytest.mark.parametrize("query", ["version=0", "version=999999999", "version=15.0", "version=1.5e1",
                                   "version=-0", "since=0&until=1e10",
                                   "since=1796000000.25&until=1796003600", "adapter=a&tenant=t&class=batch"])
def test_values_as_json_writes_them_are_served(usage, query):
    answer = usage.get(f"/v1/usage?{query}")
    assert answer.status_code == 200, f"{query}: {answer.status_code} {answer.text}"


def test_bounds_still_hold_and_the_schema_still_states_them(usage):
    for over in ("1000000000", "1e9", "9223372036854775808"):
        answer = usage.get("/v1/usage", params={"version": over})
        assert answer.status_code == 422, f"version={over} is over the version bound: {answer.text}"
    assert usage.get("/v1/usage", params={"since": "-1"}).status_code == 422, "under the time bound"
    params = {p["name"]: p["schema"]["anyOf"][0] for p in usage.app.openapi()["paths"]["/v1/usage"]["get"]
              ["parameters"] if p["name"] in ("version", "since")}
    assert params["version"] == {"type": "integer", "minimum": 0, "maximum": 999_999_999}, params
    assert params["since"] == {"type": "number", "minimum": 0, "maximum": 1e11}, params


def test_a_boolean_parameter_takes_true_or_false_once():
    async def answers() -> dict[str, int]:
        async with serving(FakeTokenizer(), FakeDispatcher()) as client:
            queries = ["", "?fresh=false", "?fresh=true", "?fresh=yes", "?fresh=1", "?fresh=true&fresh=false"]
            return {q: (await client.get(f"/debug/replicas{q}")).status_code for q in queries}

    codes = asyncio.run(answers())
    assert codes == {"": 200, "?fresh=false": 200, "?fresh=true": 200, "?fresh=yes": 400, "?fresh=1": 400,
                     "?fresh=true&fresh=false": 400}, f"the ingress answers 400 for an invalid query: {codes}"

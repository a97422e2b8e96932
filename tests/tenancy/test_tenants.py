"""Tenants and API keys: the tenants file, key lookup, adapter isolation, listing, admin routes, reloads.

The pure parts (parsing, lookup, globs, the watcher) are tested directly; the HTTP behaviour through
the ingress's FastAPI app in process (`build_fastapi` around the fake replica of tests/tenant_app.py,
which refuses unknown adapters exactly as a replica does: through `describe`).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from app_client import BOUND_S, FakeTokenizer, serving
from helpers import wait_until_async
from tenant_app import ADMIN_KEY, FIN_KEY, HR_KEY, ZOO, ZooDispatcher, bearer, tenant_app, tenants_yaml

from lora_cluster.tenancy.tenants import TenantsFileError, hash_key, parse_tenants
from lora_cluster.tenancy.watch import TenantsWatcher

# ----- the file: parsing, errors naming the field, lookup, globs ------------------------------------------


def test_keys_are_looked_up_by_their_hash_and_globs_pick_the_adapters():
    directory = parse_tenants(tenants_yaml())
    finance, admin = directory.lookup(FIN_KEY), directory.lookup(ADMIN_KEY)
    assert finance is not None and finance.tenant_name == "finance", "a tenant's key finds the tenant"
    assert not finance.admin, "a tenant key is not an admin key"
    assert admin is not None and admin.admin, "an admin key is an admin"
    assert directory.lookup("sk-unknown") is None, "an unknown key finds nobody"
    assert directory.lookup(hash_key(FIN_KEY)) is None, "the stored hash itself is not a key"
    assert finance.may_use("fin-a") and finance.may_use("shared-x"), "the tenant's patterns match"
    assert not finance.may_use("hr-a"), "another tenant's adapter does not match"
    assert not finance.may_use("FIN-a"), "patterns are case-sensitive"
    assert finance.may_use(None), "base_model defaults to true"
    assert not directory.lookup(HR_KEY).may_use(None), "base_model: false refuses the base model"


@pytest.mark.parametrize(("text", "field"), [
    ("tenants: [{name: a, api_keys: ['sk-in-clear-secret']}]", "tenants[0].api_keys[0]"),
    (f"tenants: [{{name: a, api_keys: ['{hash_key('k')}'], adaptors: ['x']}}]", "tenants[0].adaptors"),
    (f"tenants: [{{name: a, api_keys: ['{hash_key('k')}'], requests_per_minute: 0}}]",
     "tenants[0].requests_per_minute"),
    (f"tenants: [{{name: a, api_keys: ['{hash_key('k')}']}}, {{name: a, api_keys: ['{hash_key('j')}']}}]",
     "tenants[1].name"),
    (f"admin_api_keys: ['{hash_key('k')}']\ntenants: [{{name: a, api_keys: ['{hash_key('k')}']}}]",
     "tenants[0].api_keys[0]"),
    (f"tenants: [{{name: a, api_keys: ['{hash_key('k')}'], priority_class: gold}}]",
     "tenants[0].priority_class"),
    ("tenants: [", "not valid YAML"),
])
def test_a_bad_tenants_file_is_refused_naming_the_field_and_never_echoing_a_key(text, field):
    with pytest.raises(TenantsFileError) as info:
        parse_tenants(text, ("interactive", "standard", "batch"))
    message = str(info.value)
    assert field in message, f"the error names {field}: {message}"
    assert "sk-in-clear-secret" not in message, f"the error does not echo a key: {message}"
    assert hash_key("k").removeprefix("sha256:") not in message, f"no key hash either: {message}"


def test_the_watcher_rereads_a_changed_file_and_keeps_the_old_one_when_the_new_is_broken(tenants_file):
    watcher = TenantsWatcher(str(tenants_file), start=False)
    tenants_file.write_text(tenants_yaml(fin_key="sk-fin-rotated"))
    assert not watcher.check(), "a file that just changed may still be being written: not taken yet"
    assert watcher.check(), "a changed file is re-read once it settled"
    assert watcher.current().lookup("sk-fin-rotated") is not None, "the new key is in force"
    assert watcher.current().lookup(FIN_KEY) is None, "the old key is gone"
    tenants_file.write_text("tenants: [{name: broken")
    assert not watcher.check() and not watcher.check(), "a broken file is not taken"
    assert watcher.errors == 1, "the broken file was reported"
    assert watcher.current().lookup("sk-fin-rotated") is not None, "the last good file stays in force"


def test_a_file_caught_while_it_is_written_is_never_in_force(tenants_file):
    watcher = TenantsWatcher(str(tenants_file), start=False)
    full = tenants_yaml(fin_key="sk-fin-rotated")
    tenants_file.write_text("")  # an editor truncates the file, then writes it
    watcher.check()
    assert watcher.current().lookup(FIN_KEY) is not None, "an emptied file does not lock the tenants out"
    tenants_file.write_text(full[: full.index("  - name: hr")])  # cut short, valid YAML without hr
    watcher.check()
    assert watcher.current().lookup(HR_KEY) is not None, "a file cut short is not taken"
    tenants_file.write_text(full)
    watcher.check()
    watcher.check()
    assert watcher.current().lookup("sk-fin-rotated") is not None, "the file as it settled is in force"
    assert watcher.current().lookup(HR_KEY) is not None, "with every tenant it lists"
    assert watcher.reloads == 1, f"one reload, of the settled file: {watcher.reloads}"


def test_a_broken_tenants_file_at_start_is_an_error(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("admin_api_keys: [nope]")
    with pytest.raises(TenantsFileError, match=r"admin_api_keys\[0\]"):
        TenantsWatcher(str(path), start=False)
    with pytest.raises(TenantsFileError, match="cannot read"):
        TenantsWatcher(str(tmp_path / "missing.yaml"), start=False)


# ----- HTTP: keys, isolation on every endpoint, listing, admin routes ------------------------------------

COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LORAX = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}


def request_for(endpoint: str, adapter: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of a generation for `adapter` through `endpoint`."""
    lorax = {**LORAX, "parameters": {**LORAX["parameters"], "adapter_id": adapter}}
    return {
        "completions": ("/v1/completions", {**COMPLETION, "model": adapter}),
        "completions-stream": ("/v1/completions", {**COMPLETION, "model": adapter, "stream": True}),
        "chat": ("/v1/chat/completions", {**CHAT, "model": adapter}),
        "chat-stream": ("/v1/chat/completions", {**CHAT, "model": adapter, "stream": True}),
        "generate": ("/generate", lorax),
        "generate_stream": ("/generate_stream", lorax),
        "compat": ("/", lorax),
        "compat-stream": ("/", {**lorax, "stream": True}),
    }[endpoint]


ENDPOINTS = ["completions", "completions-stream", "chat", "chat-stream", "generate", "generate_stream",
             "compat", "compat-stream"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_tenant_never_reaches_another_tenants_adapter(tenants_file, endpoint):
    dispatcher = ZooDispatcher()
    async with tenant_app(tenants_file, dispatcher) as client:
        path, body = request_for(endpoint, "hr-secret")
        forbidden = await client.post(path, json=body, headers=bearer(FIN_KEY))
        path, body = request_for(endpoint, "fin-nope")
        unknown = await client.post(path, json=body, headers=bearer(FIN_KEY))
        path, body = request_for(endpoint, "fin-a")
        own = await client.post(path, json=body, headers=bearer(FIN_KEY))
    assert forbidden.status_code == 404, f"{endpoint}: another tenant's adapter is a 404: {forbidden.text}"
    assert unknown.status_code == 404, f"{endpoint}: an unknown adapter is a 404: {unknown.text}"
    forbidden_body = forbidden.json()["error"]
    unknown_body = unknown.json()["error"]
    assert forbidden_body["message"] == unknown_body["message"].replace("fin-nope", "hr-secret"), (
        f"{endpoint}: the refusal reads as an unknown adapter's: {forbidden_body} vs {unknown_body}")
    assert forbidden_body["code"] == unknown_body["code"] == "adapter_not_found", (
        f"{endpoint}: same error code as an unknown adapter")
    assert own.status_code == 200, f"{endpoint}: the tenant's own adapter is served: {own.text}"
    assert all(j.adapter_id != "hr-secret" for j in dispatcher.jobs), (
        f"{endpoint}: nothing was sent to a replica for the other tenant's adapter")


async def test_a_tenant_without_base_model_cannot_call_it(tenants_file):
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        base = {**COMPLETION, "model": "base"}
        hr = await client.post("/v1/completions", json=base, headers=bearer(HR_KEY))
        fin = await client.post("/v1/completions", json=base, headers=bearer(FIN_KEY))
    assert hr.status_code == 404, f"base_model: false makes the base model a 404: {hr.text}"
    assert fin.status_code == 200, f"base_model: true (the default) serves it: {fin.text}"


async def test_missing_and_unknown_keys_are_401_and_both_key_headers_work(tenants_file, caplog):
    caplog.set_level(logging.DEBUG)
    body = {**COMPLETION, "model": "fin-a"}
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        missing = await client.post("/v1/completions", json=body)
        unknown = await client.post("/v1/completions", json=body, headers=bearer("sk-guess"))
        by_bearer = await client.post("/v1/completions", json=body, headers=bearer(FIN_KEY))
        by_header = await client.post("/v1/completions", json=body, headers={"x-api-key": FIN_KEY})
        models = await client.get("/v1/models")
    assert missing.status_code == 401, f"no key is a 401: {missing.text}"
    assert missing.json()["error"]["code"] == "missing_api_key", "the code says the key is missing"
    assert unknown.status_code == 401, f"an unknown key is a 401: {unknown.text}"
    assert unknown.json()["error"]["code"] == "invalid_api_key", "the code says the key is invalid"
    assert "sk-guess" not in unknown.text, "the refused key is not echoed"
    assert by_bearer.status_code == 200, f"Authorization: Bearer works: {by_bearer.text}"
    assert by_header.status_code == 200, f"x-api-key works: {by_header.text}"
    assert models.status_code == 401, "/v1/models needs a key too"
    for key in (FIN_KEY, "sk-guess"):
        assert key not in caplog.text, f"the key {key} is never logged"


async def test_models_lists_only_what_the_tenant_may_use(tenants_file):
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        fin = await client.get("/v1/models", headers=bearer(FIN_KEY))
        hr = await client.get("/v1/models", headers=bearer(HR_KEY))
        admin = await client.get("/v1/models", headers=bearer(ADMIN_KEY))
    ids = {name: [m["id"] for m in r.json()["data"]]
           for name, r in [("fin", fin), ("hr", hr), ("admin", admin)]}
    assert ids["fin"] == ["base", "fin-a", "fin-b", "shared-x"], f"finance sees its adapters: {ids['fin']}"
    assert ids["hr"] == ["hr-a", "hr-secret"], f"hr sees its adapters and no base model: {ids['hr']}"
    assert ids["admin"] == ["base", *ZOO], f"an admin sees everything: {ids['admin']}"


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/load_lora_adapter", {"lora_name": "fin-new", "lora_path": "/adapters/fin-new"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "fin-a"}),
    ("GET", "/v1/cluster", None),
    ("GET", "/debug/replicas", None),
])
async def test_admin_routes_need_an_admin_key(tenants_file, method, path, body):
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        as_tenant = await client.request(method, path, json=body, headers=bearer(FIN_KEY))
        anonymous = await client.request(method, path, json=body)
        as_admin = await client.request(method, path, json=body, headers=bearer(ADMIN_KEY))
    assert as_tenant.status_code == 403, f"{path}: a tenant key is a 403: {as_tenant.text}"
    assert as_tenant.json()["error"]["type"] == "permission_error", f"{path}: a permission error"
    assert anonymous.status_code == 401, f"{path}: no key is a 401: {anonymous.text}"
    assert as_admin.status_code not in (401, 403), f"{path}: an admin key passes: {as_admin.text}"


async def test_health_needs_no_key_and_an_admin_can_load(tenants_file):
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        health = await client.get("/health")
        loaded = await client.post("/v1/load_lora_adapter", headers=bearer(ADMIN_KEY),
                                   json={"lora_name": "fin-new", "lora_path": "/adapters/fin-new"})
    assert health.status_code == 200, f"/health is open (probes): {health.text}"
    assert loaded.status_code == 200, f"an admin loads an adapter: {loaded.text}"


async def test_the_tenants_class_is_its_default_and_its_most_urgent(tenants_file):
    dispatcher = ZooDispatcher()
    async with tenant_app(tenants_file, dispatcher) as client:
        hr_body = {**COMPLETION, "model": "hr-a"}
        default = await client.post("/v1/completions", json=hr_body, headers=bearer(HR_KEY))
        urgent = await client.post("/v1/completions", json=hr_body,
                                   headers={**bearer(HR_KEY), "x-lora-priority": "interactive"})
        fin_batch = await client.post("/generate", json=request_for("generate", "fin-a")[1],
                                      headers={**bearer(FIN_KEY), "x-lora-priority": "batch"})
    assert default.headers["x-lora-priority-class"] == "batch", "no class asked: the tenant's class"
    assert urgent.headers["x-lora-priority-class"] == "batch", (
        "a class more urgent than the tenant's is lowered to the tenant's")
    assert fin_batch.headers["x-lora-priority-class"] == "batch", "a less urgent class may be chosen"
    assert [j.priority_class for j in dispatcher.jobs] == ["batch", "batch", "batch"], (
        "the jobs run in those classes")
    assert [j.tenant for j in dispatcher.jobs] == ["hr", "hr", "finance"], (
        "each job carries its tenant's name (metrics labels, replica groups)")


async def test_a_key_rotated_by_editing_the_file_takes_effect_without_a_restart(tenants_file):
    body = {**COMPLETION, "model": "fin-a"}
    watcher = TenantsWatcher(str(tenants_file), ("interactive", "standard", "batch"), 0.05)
    async with tenant_app(tenants_file, ZooDispatcher(), watcher=watcher) as client:
        before = await client.post("/v1/completions", json=body, headers=bearer(FIN_KEY))
        tenants_file.write_text(tenants_yaml(fin_key="sk-fin-rotated"))
        answers: list[httpx.Response] = []

        async def rotated_key_taken() -> bool:
            answers.append(await client.post("/v1/completions", json=body, headers=bearer("sk-fin-rotated")))
            return answers[-1].status_code != 401

        await wait_until_async(rotated_key_taken, BOUND_S, "the watcher to take the rotated key", 0.05)
        rotated = answers[-1]
        old = await client.post("/v1/completions", json=body, headers=bearer(FIN_KEY))
        tenants_file.write_text("tenants: [{broken")  # a broken edit keeps the last good file
        await wait_until_async(lambda: watcher.errors, BOUND_S, "the watcher to read the broken file", 0.05)
        still = await client.post("/v1/completions", json=body, headers=bearer("sk-fin-rotated"))
    assert before.status_code == 200, f"the first key works: {before.text}"
    assert rotated.status_code == 200, f"the new key works once the file changed: {rotated.text}"
    assert old.status_code == 401, f"the old key no longer works: {old.text}"
    assert (watcher.reloads, watcher.errors) == (1, 1), (
        f"the watcher took the rotated file and refused the broken one: {watcher.reloads} reloads, "
        f"{watcher.errors} errors")
    assert still.status_code == 200, f"a broken edit leaves the last good file in force: {still.text}"


async def test_without_a_tenants_file_the_server_is_open():
    async with serving(FakeTokenizer(), ZooDispatcher()) as c:
        generated = await c.post("/v1/completions", json={**COMPLETION, "model": "hr-secret"})
        loaded = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})
    assert generated.status_code == 200, f"no key needed without a tenants file: {generated.text}"
    assert loaded.status_code == 200, f"admin routes are open too: {loaded.text}"


async def test_models_shows_where_a_loaded_adapter_lives_to_an_admin_only(tenants_file):
    async with tenant_app(tenants_file, ZooDispatcher()) as client:
        loaded = await client.post("/v1/load_lora_adapter", headers=bearer(ADMIN_KEY),
                                   json={"lora_name": "fin-new", "lora_path": "/srv/adapters/fin-new"})
        fin = await client.get("/v1/models", headers=bearer(FIN_KEY))
        admin = await client.get("/v1/models", headers=bearer(ADMIN_KEY))
    assert loaded.status_code == 200, f"an admin loads an adapter: {loaded.text}"
    roots = {name: {m["id"]: m["root"] for m in r.json()["data"]}
             for name, r in [("fin", fin), ("admin", admin)]}
    assert roots["fin"]["fin-new"] == "fin-new", f"a tenant never sees a server path: {roots['fin']}"
    assert "/srv/adapters" not in fin.text, "no server path anywhere in a tenant's listing"
    assert roots["admin"]["fin-new"] == "/srv/adapters/fin-new", "an admin sees where it was loaded from"

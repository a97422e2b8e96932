"""Releases kept in the durable release state (`release_state_uri`, `serve.http.release_state`): two
ingresses follow one release and add up their live evidence, a restarted ingress resumes a release
at its step with its events and serves its versions again, and a tenant releases only its own
adapters, with a candidate from the configured sources (no Ray: the ingress app in process)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from tenant_app import ADMIN_KEY, FIN_KEY, HR_KEY, bearer, tenants_yaml

from lora_cluster.config import ServeConfig
from lora_cluster.errors import ReleaseStateUnavailableError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.state_store import FolderStateStore, StateConflict
from lora_cluster.serve.http.adapter_versions import VERSION_HEADER
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registry import LocalRegistrations
from lora_cluster.serve.http.release_state import SharedReleases
from lora_cluster.tenancy.watch import TenantsWatcher

RELEASES = "/v1/adapters/fin/releases"
MAX_REQUESTS = 200
SETTINGS = ReleaseSettings(steps=(25.0, 50.0, 100.0), step_min_requests=10, step_dwell_s=0,
                           gate_min_requests=10)


def config(state: Path, **extra: Any) -> ServeConfig:
    return ServeConfig(model="base", release_canary_steps=[25, 50, 100], release_step_min_requests=8,
                       release_step_dwell_s=0, release_gate_min_requests=8, release_state_uri=str(state),
                       **extra)


def ingress(store: FolderStateStore) -> SharedReleases:
    return SharedReleases(ReleaseBook(SETTINGS, time.time), store, LocalRegistrations(), sync_s=60)


async def test_two_ingresses_follow_one_release_and_add_up_their_evidence(tmp_path):
    store = FolderStateStore(tmp_path)
    a, b = ingress(store), ingress(store)

    def start(book: ReleaseBook) -> None:
        book.start("fin", "r1", 1, 2).eval_passed({})

    await a.transact(start)
    await b.sync()
    seen_by_b = b.book.release("fin", "r1").status()
    for state in (a, b):  # 5 candidate answers each: neither alone reaches the step's 10
        for _ in range(5):
            state.book.record("fin", 2, ok=True)
    await a.sync()
    await b.sync()
    await a.sync()
    merged = a.book.release("fin", "r1").status()
    events = [e.kind for e in a.book.release("fin", "r1").events()]
    assert seen_by_b["state"] == "canary", f"the other ingress sees the release: {seen_by_b}"
    assert merged["step"] == 1, f"the step advanced on both ingresses' evidence together: {merged}"
    assert merged["candidate_answered"] == 10, "each answer is counted once, whichever ingress had it"
    assert events.count("step_advanced") == 1, f"one advance in the shared audit log: {events}"


async def test_an_ingress_that_has_not_read_a_release_never_sends_the_bare_name_to_its_candidate(tmp_path):
    store = FolderStateStore(tmp_path)
    a, b = ingress(store), ingress(store)
    versions = {"fin": "/zoo/fin-1"}
    await a.transact(lambda book: None, versions=versions)
    await b.sync()

    def start(book: ReleaseBook) -> None:
        book.start("fin", "r1", 1, 2).eval_passed({})

    await a.transact(start)
    await a.transact(lambda book: None, versions={**versions, "fin@2": "/zoo/fin-2"})
    users = [f"user-{i}" for i in range(100)]
    unread = {b.book.alias("fin", [1, 2], user) for user in users}  # B's registrations already have v2
    await b.sync()
    read = {b.book.alias("fin", [1, 2], user) for user in users}
    assert unread == {1}, "before it reads the release, the other ingress keeps every user on version 1"
    assert read == {1, 2}, "once it has read it, the release's split sends its share to version 2"


async def drive(client: Any, release_id: str, until_step: int) -> dict[str, Any]:
    """Requests of distinct users until the release reaches `until_step` (bounded). Each request is a
    new user: the split is sticky per user and hashed with the release's random id, so a fixed set of
    users can all fall in the stable share (20 users at 25%: 0.75**20, about 1 release id in 300)."""
    status: dict[str, Any] = {}
    for i in range(MAX_REQUESTS):
        answer = await client.post("/v1/completions", json={"model": "fin", "prompt": "hi", "max_tokens": 2,
                                                            "user": f"user-{i}"})
        assert answer.status_code == 200, answer.text
        status = (await client.get(f"{RELEASES}/{release_id}")).json()
        if status["step"] >= until_step or status["state"] != "canary":
            break
    return status


async def test_a_restarted_ingress_resumes_the_release_at_its_step_with_its_events(tmp_path):
    async with serving(FakeTokenizer(), FakeDispatcher(), config(tmp_path)) as client:
        first = {"lora_name": "fin", "lora_path": "/zoo/fin-1"}
        loaded = await client.post("/v1/load_lora_adapter", json=first)
        assert loaded.status_code == 200, loaded.text
        release = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})).json()
        before = await drive(client, release["id"], until_step=1)
        events_before = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
    # a new ingress process on the same state: nothing of the first one's memory
    async with serving(FakeTokenizer(), FakeDispatcher(), config(tmp_path)) as client:
        after = (await client.get(f"{RELEASES}/{release['id']}")).json()
        events_after = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
        pinned = await client.post("/v1/completions",
                                   json={"model": "fin@2", "prompt": "hi", "max_tokens": 2})
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        final = await drive(client, release["id"], until_step=99)
    assert (before["state"], before["step"]) == ("canary", 1), f"the release was at its second step: {before}"
    assert (after["state"], after["step"], after["percent"]) == ("canary", 1, 50.0), (
        f"the restarted ingress resumes at the same step and share: {after}")
    assert events_after == events_before, "the audit log survives the restart, every event with its evidence"
    assert pinned.status_code == 200 and pinned.headers[VERSION_HEADER] == "2", (
        f"the candidate version is registered again: {pinned.text}")
    assert {"fin", "fin@1", "fin@2"} <= set(listed), f"/v1/models lists the versions again: {listed}"
    assert final["state"] == "promoted", f"the resumed release goes on to promotion: {final}"


async def test_a_tenant_releases_its_own_adapters_from_the_sources_only(tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(tenants_yaml())
    watcher = TenantsWatcher(str(tenants_file), ("interactive", "standard", "batch"), 60.0)
    url = "/v1/adapters/fin-a/releases"
    cfg = config(tmp_path / "state", adapter_source=["/zoo"])
    try:
        async with serving(FakeTokenizer(), FakeDispatcher(), cfg, tenants=watcher) as client:
            admin, fin = bearer(ADMIN_KEY), bearer(FIN_KEY)
            for name in ("fin-a", "hr-a"):
                await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": name, "lora_path": f"/zoo/{name}"}, headers=admin)
            other = await client.post("/v1/adapters/hr-a/releases", json={"lora_path": "hr-b"}, headers=fin)
            foreign = await client.post(url, json={"lora_path": "hr-secret"}, headers=fin)
            server_path = await client.post(url, json={"lora_path": "/etc/secrets"}, headers=fin)
            escape = await client.post(url, json={"lora_path": "/zoo/fin-b/../hr-secret"}, headers=fin)
            own = await client.post(url, json={"lora_path": "fin-b"}, headers=fin)
            hr_rolls = await client.post(f"{url}/{own.json().get('id')}/rollback", headers=bearer(HR_KEY))
            own_rolls = await client.post(f"{url}/{own.json().get('id')}/rollback", headers=fin)
    finally:
        watcher.close()
    assert other.status_code == 403, f"another tenant's adapter is a 403: {other.text}"
    assert "'hr-a'" in other.json()["error"]["message"], f"the 403 names the adapter: {other.text}"
    assert foreign.status_code == 403 and "hr-secret" in foreign.text, (
        f"a candidate that is another tenant's adapter is a 403 naming it: {foreign.text}")
    assert server_path.status_code == 403, f"a server path outside the sources is a 403: {server_path.text}"
    assert escape.status_code == 403, f"a path climbing out of the tenant's adapter is a 403: {escape.text}"
    assert own.status_code == 200, f"a tenant releases its own adapter from the sources: {own.text}"
    assert own.json()["tenant"] == "finance", "the release records its tenant"
    assert hr_rolls.status_code == 404, "another tenant cannot roll it back (nor learn that it exists)"
    assert own_rolls.json()["state"] == "rolled_back", "the owning tenant rolls its release back"


class AlwaysBehind(FolderStateStore):
    """A store that another writer always beats (every write conflicts)."""

    def write(self, document: dict[str, Any], tag: str | None) -> str:
        raise StateConflict("another ingress wrote first")


async def test_a_state_that_keeps_changing_is_a_503_and_the_evidence_is_kept_for_the_next_write(tmp_path):
    store = FolderStateStore(tmp_path)
    await ingress(store).transact(lambda book: book.start("fin", "r1", 1, 2).eval_passed({}))
    behind = ingress(AlwaysBehind(tmp_path))
    await behind.transact(lambda book: None)  # reads the release (nothing to write)
    behind.book.record("fin", 2, ok=True)
    with pytest.raises(ReleaseStateUnavailableError, match="changed it"):
        await behind.sync()
    kept = behind.book.take_pending()
    assert sum(p.candidate_answered for p in kept.values()) == 1, "the unwritten evidence waits for a write"


def test_an_ingress_that_cannot_read_the_state_does_not_start(tmp_path):
    (tmp_path / "releases.json").write_text('{"releases": ')
    with pytest.raises(ReleaseStateUnavailableError, match="not a JSON document"):
        ApiContext(config=config(tmp_path), tokenizer=FakeTokenizer(), dispatcher=FakeDispatcher())

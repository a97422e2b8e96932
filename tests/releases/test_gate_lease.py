"""The lease of a release's eval gate in the shared release state (`releases.lease`,
`serve.http.release_state`): the ingress running a gate renews its lease with every sync; when it
dies, the next ingress to sync after the lease expired takes it over once and runs the gate again;
a former owner's late verdict is dropped. Injected clocks over a real folder store; the last test
runs the whole takeover through an ingress app in process (no Ray)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from app_client import FakeDispatcher, FakeTokenizer, serving
from helpers import wait_until_async

from lora_cluster.config import ServeConfig
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.state_store import FolderStateStore
from lora_cluster.serve.http.registry import LocalRegistrations
from lora_cluster.serve.http.release_state import SharedReleases

SETTINGS = ReleaseSettings(steps=(50.0, 100.0), step_min_requests=10, step_dwell_s=0, gate_min_requests=10)
LEASE_S = 30.0
GATE = {"lora_path": "/zoo/fin-2", "eval_set": None}


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Runner:
    """The gate runner an ingress wires in (`SharedReleases.on_takeover`): records what it is
    asked to run again."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str]] = []

    async def __call__(self, name: str, release_id: str) -> None:
        self.runs.append((name, release_id))


def ingress(store: FolderStateStore, clock: Clock, owner: str) -> tuple[SharedReleases, Runner]:
    shared = SharedReleases(ReleaseBook(SETTINGS, clock), store, LocalRegistrations(), sync_s=60,
                            lease_s=LEASE_S, owner=owner)
    runner = Runner()
    shared.on_takeover(runner)
    return shared, runner


async def create(shared: SharedReleases) -> None:
    """A release evaluating at `shared`, its lease held from now (as the create route stages it)."""
    def start(book: ReleaseBook) -> None:
        book.start("fin", "r1", 1, 2).stage(GATE, book.lease(shared.owner, shared.lease_s))

    await shared.transact(start)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_an_expired_lease_is_taken_over_once_by_the_next_ingress_that_syncs(tmp_path):
    store, clock = FolderStateStore(tmp_path), Clock()
    a, _ = ingress(store, clock, "a")
    b, b_runs = ingress(store, clock, "b")
    c, c_runs = ingress(store, clock, "c")
    await create(a)  # then ingress a dies: it never syncs again
    clock.now += LEASE_S - 1
    await b.sync()
    await settle()
    early = list(b_runs.runs)
    clock.now += 2
    await b.sync()
    await c.sync()
    await settle()
    release = b.book.release("fin", "r1")
    taken = [e for e in release.events() if e.kind == "gate_taken_over"]
    assert early == [], "a lease not expired yet is left to its owner"
    assert b_runs.runs == [("fin", "r1")], "the first ingress to sync after the expiry runs the gate again"
    assert c_runs.runs == [], "the lease is taken once: the next ingress finds it held"
    assert release.state.value == "evaluating", "the release evaluates again, no traffic to its candidate"
    assert len(taken) == 1 and taken[0].evidence["previous_owner"] == "a", (
        f"the takeover is in the audit log with the dead owner: {[e.to_dict() for e in taken]}")
    assert release.gate == GATE, "the gate's input survives in the shared state for the new owner"


async def test_the_owner_renews_its_lease_while_its_gate_runs(tmp_path):
    store, clock = FolderStateStore(tmp_path), Clock()
    a, _ = ingress(store, clock, "a")
    b, b_runs = ingress(store, clock, "b")
    await create(a)
    with a.gate("r1"):  # a long evaluation: a's syncs renew the lease
        for _ in range(4):
            clock.now += LEASE_S / 2
            await a.sync()
            await b.sync()
            await settle()
    renewed = list(b_runs.runs)
    clock.now += LEASE_S + 1  # the gate ended without a verdict (a died): its lease lapses
    await b.sync()
    await settle()
    assert renewed == [], "a lease renewed by its owner's syncs is never taken"
    assert b_runs.runs == [("fin", "r1")], "once its owner stops renewing it, another ingress takes it"


async def test_a_former_owners_late_verdict_is_dropped_and_the_new_owners_counts(tmp_path):
    store, clock = FolderStateStore(tmp_path), Clock()
    a, _ = ingress(store, clock, "a")
    b, _ = ingress(store, clock, "b")
    await create(a)
    clock.now += LEASE_S + 1
    await b.sync()  # b takes the gate over
    late = await a.transact(lambda book: book.settle_eval("fin", "r1", "a", False, "late", {}).state.value)
    final = await b.transact(lambda book: book.settle_eval("fin", "r1", "b", True, "", {}).state.value)
    document, _ = store.read()
    stored = (document or {})["releases"]["fin"][-1]
    assert late == "evaluating", "the verdict of an ingress that lost the lease is not written"
    assert final == "canary", "the lease holder's verdict decides"
    assert (stored["gate"], stored["lease"]) == (None, None), "a release out of evaluating keeps no lease"


def app_config(state: Path) -> ServeConfig:
    return ServeConfig(model="base", release_state_uri=str(state), release_sync_s=0.05, release_lease_s=0.2)


async def test_an_ingress_takes_over_a_gate_whose_ingress_died_and_loads_and_judges_the_candidate(tmp_path):
    store = FolderStateStore(tmp_path)
    async with serving(FakeTokenizer(), FakeDispatcher(), app_config(tmp_path)) as client:
        first = {"lora_name": "fin", "lora_path": "/zoo/fin-1"}
        loaded = await client.post("/v1/load_lora_adapter", json=first)
        dead = SharedReleases(ReleaseBook(SETTINGS, time.time), store, LocalRegistrations(), sync_s=60,
                              lease_s=0.2, owner="dead-ingress")
        await create(dead)  # created there, which died before loading its candidate

        async def judged() -> dict[str, Any] | None:
            status = (await client.get("/v1/adapters/fin/releases/r1")).json()
            return status if status["state"] != "evaluating" else None

        status = await wait_until_async(judged, 10.0, "another ingress to run the gate", interval_s=0.05)
        events = [e["kind"] for e in (await client.get("/v1/adapters/fin/releases/r1/events")).json()["data"]]
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert loaded.status_code == 200, loaded.text
    assert status["state"] == "canary", f"the gate ran again here and passed (no evaluation set): {status}"
    assert events == ["created", "gate_taken_over", "eval_passed"], f"the audit log: {events}"
    assert "fin@2" in listed, f"the new owner loaded the candidate the dead ingress never loaded: {listed}"


async def test_a_takeover_waits_for_the_candidate_its_dead_creator_was_loading_then_loads_and_judges_it(
        tmp_path):
    store, registrations = FolderStateStore(tmp_path), LocalRegistrations()
    async with serving(FakeTokenizer(), FakeDispatcher(), app_config(tmp_path),
                       registrations=registrations) as client:
        first = {"lora_name": "fin", "lora_path": "/zoo/fin-1"}
        loaded = await client.post("/v1/load_lora_adapter", json=first)
        dead = SharedReleases(ReleaseBook(SETTINGS, time.time), store, LocalRegistrations(), sync_s=60,
                              lease_s=0.2, owner="dead-ingress")
        await create(dead)
        await registrations.reserve_load("fin@2")  # the creator died in the middle of loading its candidate

        async def events() -> list[str]:
            log = (await client.get("/v1/adapters/fin/releases/r1/events")).json()["data"]
            return [e["kind"] for e in log]

        async def taken() -> bool:
            return "gate_taken_over" in await events()

        await wait_until_async(taken, 10.0, "another ingress to take the gate over", interval_s=0.05)
        await asyncio.sleep(0.3)  # the new owner finds the candidate busy meanwhile
        busy = (await client.get("/v1/adapters/fin/releases/r1")).json()["state"]
        await registrations.release("fin@2")  # the registry frees the dead ingress's reservation

        async def judged() -> dict[str, Any] | None:
            status = (await client.get("/v1/adapters/fin/releases/r1")).json()
            return status if status["state"] != "evaluating" else None

        status = await wait_until_async(judged, 10.0, "the gate's verdict", interval_s=0.05)
        kinds = await events()
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert loaded.status_code == 200, loaded.text
    assert busy == "evaluating", "a candidate still being loaded elsewhere is waited for, not a rollback"
    assert status["state"] == "canary", f"once free, the new owner loads it and the gate passes: {status}"
    assert kinds == ["created", "gate_taken_over", "eval_passed"], f"the audit log: {kinds}"
    assert "fin@2" in listed, f"the candidate is served by the new owner's load: {listed}"

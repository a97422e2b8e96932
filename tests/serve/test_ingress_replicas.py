"""Several ingress replicas, in process: what one ingress does is what every ingress serves.

* Adapters loaded through the vLLM API live in the shared `AdapterRegistry` (`serve.http.registry`):
  a load through one ingress is listed, served with its path, a 409 to load again, and unloadable
  through another; once an unload through one ingress has answered, no ingress sends its path.
* The registry's book: versions, the subscribers a change waits for, names left busy by a dead
  ingress, a restarted registry given back what an ingress kept.
* The cluster queue: an ingress takes no fast path while another ingress has a request parked.
* The ingress's replica count: `ingress_autoscaling_config` replaces `ingress_num_replicas`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving
from helpers import CoalescedShard

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig, load_config
from lora_cluster.errors import ConfigError
from lora_cluster.serve.app import ingress_count, several_ingresses
from lora_cluster.serve.controller_actor import ClusterController
from lora_cluster.serve.http.registrations import RegistrationConflict, RegistryBook
from lora_cluster.serve.http.registry import AdapterRegistry, SharedRegistrations
from lora_cluster.serve.routing.admission import ClusterAdmission

BOUND_S = 10.0


class InProcessHandle:
    """A deployment's class called in process, in its handle's `.method.remote(...)` shape."""

    def __init__(self, target: Any):
        self.target = target

    def __getattr__(self, method: str) -> Any:
        target = self.target

        class Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                return asyncio.ensure_future(getattr(target, method)(*args))
        return Call()


async def following(handle: InProcessHandle) -> SharedRegistrations:
    """An ingress's registrations that have taken the registry's state once (as at an ingress's start)."""
    registrations = SharedRegistrations(handle)
    registrations.start()
    for _ in range(int(BOUND_S / 0.01)):
        if registrations.version >= 0:
            break
        await asyncio.sleep(0.01)
    assert registrations.version >= 0, "the ingress took the registry's state"
    return registrations


COMPLETION = {"model": "mine", "prompt": "hi", "max_tokens": 2}


async def test_a_load_through_one_ingress_holds_for_every_ingress():
    handle = InProcessHandle(AdapterRegistry.func_or_class())
    one, two = FakeDispatcher(), FakeDispatcher()
    async with serving(FakeTokenizer(), one, registrations=await following(handle)) as first, \
            serving(FakeTokenizer(), two, registrations=await following(handle)) as second:
        loaded = await first.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": "/a/mine"})
        listed = await second.get("/v1/models")
        served = await second.post("/v1/completions", json=COMPLETION)
        again = await second.post("/v1/load_lora_adapter",
                                  json={"lora_name": "mine", "lora_path": "/a/other"})
        unloaded = await second.post("/v1/unload_lora_adapter", json={"lora_name": "mine"})
        after = await first.post("/v1/completions", json=COMPLETION)
        listed_after = await first.get("/v1/models")
        reloaded = await first.post("/v1/load_lora_adapter",
                                    json={"lora_name": "mine", "lora_path": "/a/new"})
    assert loaded.status_code == 200, f"the load through the first ingress succeeds: {loaded.text}"
    assert "mine" in [m["id"] for m in listed.json()["data"]], "the second ingress lists it"
    assert served.status_code == 200, f"the second ingress serves it: {served.text}"
    assert two.jobs[-1].adapter_path == "/a/mine", "with its registered path (a new replica registers it)"
    assert again.status_code == 409, f"a second load through the second ingress is a conflict: {again.text}"
    assert again.json()["error"]["code"] == "already_loaded", "which says it is loaded already"
    assert unloaded.status_code == 200, f"the second ingress unloads what the first loaded: {unloaded.text}"
    assert after.status_code == 200, f"the first ingress serves the name as any other adapter: {after.text}"
    assert one.jobs[-1].adapter_path is None, "after the unload answered, the first ingress sends no path"
    assert "mine" not in [m["id"] for m in listed_after.json()["data"]], "nor lists it"
    assert reloaded.status_code == 200, f"the name can be loaded again: {reloaded.text}"


async def test_an_ingress_that_has_not_applied_a_load_delays_its_answer():
    registry = AdapterRegistry.func_or_class()
    handle = InProcessHandle(registry)
    registry.book.heard("silent-ingress", registry.book.version)  # polled once, never again
    loader = await following(handle)
    await loader.reserve_load("mine")
    load = asyncio.create_task(loader.complete_load("mine", "/a/mine"))
    await asyncio.sleep(0.2)
    assert not load.done(), "the load waits while a live ingress has not applied it"
    registry.book.heard("silent-ingress", registry.book.version)  # its next poll
    await registry.changes("silent-ingress", registry.book.version, registry.epoch, 0.0)
    await asyncio.wait_for(load, BOUND_S)
    assert loader.path("mine") == "/a/mine", "once every ingress has it, the load answers"


def test_the_book_counts_versions_and_waits_only_for_live_subscribers():
    now = [0.0]
    book = RegistryBook(lambda: now[0], limit=4, subscriber_ttl_s=30.0)
    book.heard("a", 0)
    book.heard("b", 0)
    book.reserve_load("x")
    version = book.complete_load("x", "/x", None)
    assert version == 1, "a load is a new version"
    assert sorted(book.lagging(version)) == ["a", "b"], "both subscribers have yet to apply it"
    book.heard("a", version)
    assert book.lagging(version) == ["b"], "a subscriber that applied it is not waited for"
    now[0] = 31.0
    assert book.lagging(version) == [], "one not heard from for subscriber_ttl_s is not waited for"
    assert book.reserve_unload("missing") is None, "unloading an unknown name changes nothing"
    assert book.reserve_unload("x") == 2, "an unload is a new version"
    assert book.entries() == {}, "and the name is gone from the entries at once"


def test_a_name_left_busy_by_a_dead_ingress_is_freed_after_its_ttl():
    now = [0.0]
    book = RegistryBook(lambda: now[0], busy_ttl_s=600.0)
    book.reserve_load("x")  # its ingress dies before completing or releasing
    with pytest.raises(RegistrationConflict) as refused:
        book.reserve_load("x")
    assert refused.value.code == "being_loaded", "meanwhile the name is busy"
    now[0] = 601.0
    book.reserve_load("x")
    assert book.complete_load("x", "/x", None) == 1, "after busy_ttl_s it can be loaded again"


def test_a_name_held_by_an_ingress_whose_long_poll_stopped_is_freed_after_the_subscriber_ttl():
    now = [0.0]
    book = RegistryBook(lambda: now[0], busy_ttl_s=600.0, subscriber_ttl_s=30.0)
    book.heard("live", 0)
    book.heard("dead", 0)
    book.reserve_load("slow", "live")  # a load that outlasts the ttl, its ingress still polling
    book.reserve_load("x", "dead")  # its ingress dies in the middle of the load
    for _ in range(3):
        now[0] += 12.0
        book.heard("live", 0)
    with pytest.raises(RegistrationConflict) as kept:
        book.reserve_load("slow", "other")
    book.reserve_load("x", "other")
    assert kept.value.code == "being_loaded", "a live holder keeps its name however long its load takes"
    assert book.complete_load("x", "/x", None) == 1, (
        "a holder silent for subscriber_ttl_s is gone: its name is loaded by another ingress")


def test_a_restarted_registry_takes_what_an_ingress_kept_only_while_untouched():
    fresh = RegistryBook(lambda: 0.0)
    assert fresh.restore({"x": ("/x", None), "y": ("/y", "qwen")}), "a fresh registry takes the entries"
    assert fresh.entries() == {"x": ("/x", None), "y": ("/y", "qwen")}, "with their paths and bases"
    assert not fresh.restore({"z": ("/z", None)}), "a second ingress's copy is not taken over the first"
    used = RegistryBook(lambda: 0.0)
    used.reserve_load("w")
    used.complete_load("w", "/w", None)
    assert not used.restore({"x": ("/x", None)}), "a registry already loaded through keeps its own state"


# ----- the cluster queue across ingresses ----------------------------------------------------------------


class SharedQueueController:
    """A controller that holds every parked request until `gate` is set, and answers `ingress_view`
    with the requests other ingresses have parked, as `ClusterController` does."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[dict] = []
        self.parked: Counter[str] = Counter()
        controller = self

        class Admit:
            @staticmethod
            def remote(ticket: dict, timeout_s: float) -> Any:
                controller.calls.append(ticket)
                return controller.wait(ticket)

        class View:
            @staticmethod
            def remote(ingress_id: str) -> Any:
                async def view() -> dict:
                    mine = controller.parked[ingress_id]
                    return {"placement": {}, "queued_elsewhere": sum(controller.parked.values()) - mine}
                return view()

        self.admit, self.ingress_view = Admit(), View()

    async def wait(self, ticket: dict) -> dict:
        self.parked[ticket["ingress_id"]] += 1
        try:
            await self.gate.wait()
        finally:
            self.parked[ticket["ingress_id"]] -= 1
        return {"replica_id": "r1", "preempt": False}


async def test_an_ingress_takes_no_fast_path_while_another_has_a_request_parked():
    controller, running, clock = SharedQueueController(), [0], [0.0]

    def stats() -> dict[str, RoutingStats]:
        return {"r1": RoutingStats(num_running=running[0], num_waiting=0, max_num_seqs=2)}

    a, b = (ClusterAdmission(CoalescedShard(controller), capacity=None, replica_stats=stats, timeout_s=30.0,
                             placement_sink=lambda table: None, placement_period_s=0.01,
                             clock=lambda: clock[0]) for _ in range(2))
    assert await b.admit(sla_class="batch", adapter_id="x", arrived_at=0.0) is None, "b: fast path while idle"
    b.started("r1", granted=False)
    b.finished("r1")
    running[0] = 2  # the replica is full
    parked = asyncio.create_task(a.admit(sla_class="interactive", adapter_id="x", arrived_at=0.0))
    await asyncio.sleep(0.1)  # b fetches the controller's view meanwhile
    assert [t["ingress_id"] for t in controller.calls] == [a.ingress_id], "ingress a parked its request"
    running[0] = 1  # a slot frees; the controller grants it to a's parked request
    second = asyncio.create_task(b.admit(sla_class="batch", adapter_id="x", arrived_at=0.0))
    await asyncio.sleep(0.05)
    assert [t["ingress_id"] for t in controller.calls] == [a.ingress_id, b.ingress_id], (
        "ingress b parks its new request behind a's instead of sending it to the freed slot")
    controller.gate.set()
    granted = await asyncio.wait_for(asyncio.gather(parked, second), BOUND_S)
    assert all(g is not None and g.replica_id == "r1" for g in granted), "both are granted, in queue order"


async def test_the_controller_tells_each_ingress_how_many_requests_other_ingresses_parked():
    actor = ClusterController.func_or_class(ServeConfig().model_dump())
    request = {"ticket_id": "t1", "ingress_id": "i1", "sla_class": "batch", "adapter_id": "a1",
               "waited_s": 0.0}
    call = asyncio.create_task(actor.admit(request, 30.0))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(actor.core.queue):
            break
    mine, other = await actor.ingress_view("i1"), await actor.ingress_view("i2")
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert mine["queued_elsewhere"] == 0, "the parking ingress counts its own requests itself"
    assert other["queued_elsewhere"] == 1, "another ingress learns that one request waits"
    gone = await actor.ingress_view("i2")
    assert gone["queued_elsewhere"] == 0, "a request that went away is not counted"


# ----- replica count ------------------------------------------------------------------------------------


def test_ingress_autoscaling_config_replaces_ingress_num_replicas(monkeypatch):
    assert ingress_count(ServeConfig(ingress_num_replicas=4)) == {"num_replicas": 4}, "a fixed count"
    assert several_ingresses(ServeConfig(ingress_num_replicas=4)), "four ingresses share a registry"
    assert not several_ingresses(ServeConfig()), "one ingress keeps its registrations itself (the default)"
    scaled = ingress_count(ServeConfig(ingress_autoscaling_config={"min_replicas": 1, "max_replicas": 4}))
    assert "num_replicas" not in scaled, "autoscaling replaces the fixed count"
    assert scaled["autoscaling_config"]["max_replicas"] == 4, "with Ray Serve's autoscaling_config"
    monkeypatch.setenv("LORA_CLUSTER_INGRESS_AUTOSCALING_CONFIG", '{"min_replicas": 2, "max_replicas": 3}')
    assert load_config({}).ingress_autoscaling_config == {"min_replicas": 2, "max_replicas": 3}, (
        "the environment sets it as JSON")
    with pytest.raises(ConfigError, match="ingress_autoscaling_config"):
        ingress_count(ServeConfig(ingress_autoscaling_config={"min_replicas": 3, "max_replicas": 1}))


def test_a_restore_skips_names_being_loaded_and_stops_at_the_bound():
    book = RegistryBook(lambda: 0.0, limit=2)
    book.reserve_load("busy")  # a load through the restarted registry is under way
    assert book.restore({"busy": ("/old", None), "x": ("/x", None), "y": ("/y", None)}), "the copy is taken"
    assert book.entries() == {"x": ("/x", None)}, "except the busy name, and within the bound of 2 names"
    assert book.complete_load("busy", "/new", None) == 2, "the load under way completes with its own path"

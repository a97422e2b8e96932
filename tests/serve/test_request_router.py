"""The request router's own clock: placement ages are monotonic, whatever the wall clock does.

The router is the real `LoraAffinityRouter`, built with the arguments Serve's handle router passes
(no Ray started); its clock is injected through `initialize_state`, and the wall clock is stepped back
an hour under it, as NTP or an operator may do on a node.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from helpers import FakeClock

from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.ray_internals import offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

APP = "router-clock-app"
TTL_S = 5.0


def replica(rid: str) -> SimpleNamespace:
    """A `RunningReplica` as the router reads it: its id, its queue bound and its last report (one
    adapter slot, free)."""
    return SimpleNamespace(replica_id=offline_replica_id(rid, APP),
                           max_ongoing_requests=8,
                           routing_stats={"max_loras": 1, "empty_adapter_slots": 1, "free_adapter_slots": 1,
                                          "max_num_seqs": 8, "num_running": 0, "num_waiting": 0})


def pending(adapter_id: str) -> SimpleNamespace:
    """A `PendingRequest` as the router reads it: its arguments and its routing context."""
    job = GenerateJob(request_id="r", prompt=[1], adapter_id=adapter_id, sampling=SamplingParams())
    return SimpleNamespace(args=(job,), routing_context=SimpleNamespace(should_backoff=False))


Clocks = tuple[LoraAffinityRouter, FakeClock, list[float], list[SimpleNamespace]]


def router_on_fake_clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    """A router whose monotonic clock (the FakeClock) and wall clock (`time.time`, read from the
    one-element list) the test moves apart; two free replicas r1 and r2."""
    router = offline_router(LoraAffinityRouter, APP)
    clock = FakeClock(100.0)
    router.initialize_state(router={"router_placement_ttl_s": TTL_S}, clock=clock)
    wall = [1_800_000_000.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    return router, clock, wall, [replica("r1"), replica("r2")]


async def test_a_wall_clock_step_back_does_not_keep_a_placement_alive(monkeypatch):
    router, clock, wall, replicas = router_on_fake_clocks(monkeypatch)

    first = await router.choose_replicas(replicas, pending("x"))
    assert first[0][0].replica_id.unique_id == "r1", "a new adapter goes to the lower id among equals"

    wall[0] -= 3600.0  # the node's clock is stepped back an hour
    clock.now += TTL_S + 1.0
    later = await router.choose_replicas(replicas, pending("z"))
    assert later[0][0].replica_id.unique_id == "r1", (
        "once the placement TTL has passed on the monotonic clock, x's placement on r1 expired (the wall "
        "clock stepping back does not keep it alive, taking r1's only adapter slot): z goes to r1")


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
async def test_placements_expire_on_the_routers_clock_only(monkeypatch, step_s):
    router, clock, wall, replicas = router_on_fake_clocks(monkeypatch)
    await router.choose_replicas(replicas, pending("x"))
    wall[0] += step_s
    clock.now += TTL_S / 2
    ranked = await router.choose_replicas(replicas, pending("y"))
    assert ranked[0][0].replica_id.unique_id == "r2", (
        f"a wall-clock step of {step_s:+.0f} s neither expires x's recent placement on r1 nor keeps it: "
        "half a TTL later on the router's clock it still counts, so y goes to r2")

"""The router's fast path (the ingress's direct choice, without the controller) reads the replicas'
host tiers: among replicas that would load a request's adapter at the same cost, one whose host tier
holds it comes first, as in the controller's miss choice (issue 46, item 2). Through the index
(`RoutingIndex`, bounded per adapter) and through the real `LoraAffinityRouter` fed the replicas'
routing-stats dicts as Serve broadcasts them."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import FakeClock

from lora_cluster.cluster.reports import MAX_REPORTED_HOST
from lora_cluster.cluster.routing_index import MAX_KEY_HOLDERS, RoutingIndex
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.ray_internals import offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

APP = "router-host-tier-app"
ROOMY = {"max_num_seqs": 8, "max_loras": 2, "empty_adapter_slots": 2, "free_adapter_slots": 2}


def stats(host: tuple[str, ...] = (), resident: tuple[str, ...] = ()) -> RoutingStats:
    """A replica's routing stats: batch room, free adapter slots, `host` in its host tier."""
    return RoutingStats.from_dict({**ROOMY, "resident": list(resident), "host_held": list(host)})


def index_of(replicas: dict[str, RoutingStats], ongoing: dict[str, int]) -> RoutingIndex:
    index = RoutingIndex(miss_cost=4.0, placement_ttl_s=5.0, clock=FakeClock(0.0),
                         ongoing=ongoing.__getitem__)
    index.replace(replicas)
    return index


def test_a_miss_goes_to_the_replica_whose_host_tier_holds_the_adapter() -> None:
    index = index_of({"r1": stats(), "r2": stats(host=("x",))}, {"r1": 0, "r2": 2})
    assert index.choose("x") == "r2", (
        "both have batch room and a free slot: the host-tier holder wins over the less busy replica")
    assert index.choose("y") == "r1", "an adapter in no host tier goes to the less busy replica"


def test_a_device_holder_and_a_shorter_queue_beyond_the_batch_come_before_the_host_tier() -> None:
    index = index_of({"r1": stats(resident=("x",)), "r2": stats(host=("x",))}, {"r1": 3, "r2": 0})
    assert index.choose("x") == "r1", (
        "a replica holding the adapter on its device beats one holding it in host memory")
    index = index_of({"r1": stats(), "r2": stats(host=("x",))}, {"r1": 0, "r2": 10})
    assert index.choose("x") == "r1", (
        "a host-tier holder whose queue runs past its batch slots costs more than a cold replica with room")


def test_the_host_index_follows_reports_and_stays_bounded() -> None:
    replicas = {f"r{i:03d}": stats(host=("x",)) for i in range(4 * MAX_KEY_HOLDERS)}
    index = index_of(replicas, dict.fromkeys(replicas, 0))
    index.settle()
    assert len(index.host_holders["x"]) == MAX_KEY_HOLDERS, (
        f"an adapter keeps at most {MAX_KEY_HOLDERS} host holders, however many replicas report it")
    assert len(index.ranked("x", spare=1)) <= MAX_KEY_HOLDERS + 1, (
        "the ranked candidates are the adapter's bounded host holders and the spare, not every replica")
    index.replace({"r000": stats()})
    index.settle()
    assert "x" not in index.host_holders, "replicas gone and a host tier emptied leave the index"


def test_routing_stats_carry_the_latest_host_adapters_within_the_bound() -> None:
    keys = [f"a{i}" for i in range(MAX_REPORTED_HOST + 5)]
    parsed = RoutingStats.from_dict({"host_held": keys})
    assert parsed.host_held == tuple(keys[5:]), "at most MAX_REPORTED_HOST, the most recently used"
    assert RoutingStats.from_dict(parsed.to_dict()) == parsed, "the wire form round-trips"
    assert RoutingStats.from_dict({}).host_set == frozenset(), "a replica that has not reported holds none"


def replica(rid: str, host: tuple[str, ...], running: int) -> SimpleNamespace:
    """A `RunningReplica` as the router reads it: its id, its queue bound and its last report."""
    return SimpleNamespace(replica_id=offline_replica_id(rid, APP), max_ongoing_requests=8,
                           routing_stats={**ROOMY, "num_running": running, "num_waiting": 0,
                                          "host_held": list(host)})


async def test_the_request_router_sends_a_miss_to_a_host_tier_holder() -> None:
    router = offline_router(LoraAffinityRouter, APP)
    router.initialize_state(clock=FakeClock(0.0))
    replicas = [replica("r1", (), 0), replica("r2", ("x",), 3)]
    router.update_replicas(replicas)
    job = GenerateJob(request_id="q", prompt=[1], adapter_id="x", sampling=SamplingParams())
    ranks = await router.choose_replicas(replicas, SimpleNamespace(
        args=(job,), routing_context=SimpleNamespace(should_backoff=False)))
    assert ranks[0][0].replica_id.unique_id == "r2", (
        "the ingress's direct choice: the replica whose host tier holds the adapter, though busier")

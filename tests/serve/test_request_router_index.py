"""The live request router ranks by index: what `choose_replicas` returns to Serve and how Serve's
queue-length changes reach the index.

The router is the real `LoraAffinityRouter`, built with the arguments Serve's handle router passes
(no Ray started); replicas are `RunningReplica`-shaped fakes; queue lengths go through the router's
real Serve cache and the methods Serve's handle router calls on it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from helpers import FakeClock

from lora_cluster.cluster.routing_score import PlacementTracker, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.ray_internals import cached_queue_len, offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.request_router import SPARE, LoraAffinityRouter

APP = "router-index-app"
MAX_ONGOING = 48


def replica(rid: str, resident: tuple[str, ...] = (), running: int = 0) -> SimpleNamespace:
    """A `RunningReplica` as the router reads it: id, queue bound, last report (8 seqs, 4 adapter slots)."""
    return SimpleNamespace(replica_id=offline_replica_id(rid, APP),
                           max_ongoing_requests=MAX_ONGOING,
                           routing_stats={"resident": list(resident), "max_loras": 4,
                                          "empty_adapter_slots": 4 - len(resident), "free_adapter_slots": 4,
                                          "max_num_seqs": 8, "num_running": running, "num_waiting": 0})


def pending(adapter_id: str) -> SimpleNamespace:
    """A `PendingRequest` as the router reads it: its arguments and its routing context."""
    job = GenerateJob(request_id="r", prompt=[1], adapter_id=adapter_id, sampling=SamplingParams())
    return SimpleNamespace(args=(job,), routing_context=SimpleNamespace(should_backoff=False))


def new_router() -> LoraAffinityRouter:
    router = offline_router(LoraAffinityRouter, APP)
    router.initialize_state(router={"router_miss_cost": 4.0, "router_placement_ttl_s": 5.0},
                            clock=FakeClock(0.0))
    return router


def full_rank(router: LoraAffinityRouter, placements: PlacementTracker, replicas: list[SimpleNamespace],
              adapter_id: str) -> list[str]:
    """The rank the router built before the index: every replica's view (its report, Serve's cached
    queue length, the router's placements), sorted."""
    views = [placements.view(r.replica_id.unique_id, RoutingStats.from_dict(r.routing_stats),
                             cached_queue_len(router, r.replica_id), 0.0) for r in replicas]
    return rank_replicas(adapter_id, views, 4.0)


def ids(ranks: list[list[SimpleNamespace]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def test_the_router_returns_the_full_ranks_prefix_then_every_replica_as_the_last_rank():
    rng = random.Random(5)
    adapters = [f"a{k}" for k in range(30)]
    replicas = [replica(f"r{i:03d}", tuple(rng.sample(adapters, 2)), rng.randint(0, 12)) for i in range(200)]
    router, placements = new_router(), PlacementTracker(ttl_s=5.0)
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, rng.randint(0, 20))
    for adapter_id in [*adapters[:10], "new"]:
        full = full_rank(router, placements, replicas, adapter_id)
        ranks = ids(await router.choose_replicas(replicas, pending(adapter_id)))
        placements.record(ranks[0][0], adapter_id, 0.0)  # the router records its choice as it makes it
        prefix = [rank[0] for rank in ranks[:-1]]
        assert all(len(rank) == 1 for rank in ranks[:-1]), "each replica of the prefix is a rank of its own"
        assert prefix == full[:len(prefix)], f"{adapter_id}: the prefix is the full rank's"
        assert len(prefix) >= SPARE, f"{adapter_id}: the prefix holds at least {SPARE} replicas"
        assert sorted(ranks[-1]) == sorted(full), (
            "the last rank is every replica: Serve finds one with room when the prefix is full")


async def test_a_queue_that_shrinks_off_the_prefix_brings_its_replica_back_through_serves_cache_updates():
    replicas = [replica(f"r{i}") for i in range(20)]
    router = new_router()
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, 30)
    far = replicas[17]
    router.on_new_queue_len_info(far.replica_id, 40)
    first = ids(await router.choose_replicas(replicas, pending("x")))
    assert "r17" not in first[0] + [rank[0] for rank in first[1:-1]], "the busiest replica is off the prefix"

    for _ in range(40):  # its requests finish: Serve decrements its cached queue length each time
        router.decrement_queue_len_cache(far.replica_id)
    assert cached_queue_len(router, far.replica_id) == 0, "Serve's cache saw every completion"
    after = ids(await router.choose_replicas(replicas, pending("y")))
    assert after[0] == ["r17"], (
        "the emptied replica ranks first for a new adapter: its completions were signalled")

    router.on_send_request(far.replica_id)
    router.on_new_queue_len_info(far.replica_id, 45)  # a rejection reports its real count
    again = ids(await router.choose_replicas(replicas, pending("z")))
    assert again[0] != ["r17"], "a reported count above the others takes it off the top again"

"""A replica reports the prompt prefixes it ran, and the live router sends the next turn of a chat there.

Real `LoraReplica`s on the tiny demo model, outside Ray Serve (Serve's and Ray's context faked, as
in tests/serve/test_dispatch_cancellation.py); their `record_routing_stats` reports go to the real
`LoraAffinityRouter` as Serve's controller would broadcast them.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import FakeClock

from lora_cluster.cluster.prefix_keys import routing_keys, summary_keys
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.ray_internals import offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

APP = "prefix-replica-app"
SYSTEM = [(7 * i) % 400 + 20 for i in range(200)]  # a 200-token system prompt (ids of the demo vocabulary)


@pytest.fixture
def make_replica(demo_zoo, monkeypatch) -> Iterator[Any]:
    from lora_cluster.serve.replica import deployment as replica_module

    monkeypatch.setattr(replica_module.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=str))
    monkeypatch.setattr(replica_module, "configure_logging", lambda *args, **kwargs: None)
    made: list[Any] = []

    def make(rid: str, **settings: Any) -> Any:
        monkeypatch.setattr(replica_module.serve, "get_replica_context",
                            lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid)))
        replica = replica_module.LoraReplica.func_or_class({
            "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "max_loras": 2,
            "max_num_seqs": 4, "lora_cpu_native": False, **settings})
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.aengine.shutdown()


def job(prompt: list[int], adapter: str = "a1") -> GenerateJob:
    return GenerateJob(request_id=f"j{len(prompt)}", prompt=prompt, adapter_id=adapter,
                       sampling=SamplingParams(max_new_tokens=2, temperature=0.0), stream=False)


async def test_a_replica_reports_the_prefixes_it_ran_and_the_next_turn_is_routed_there(make_replica) -> None:
    chat = SYSTEM + [30 + i % 50 for i in range(90)]
    r1, r2 = make_replica("r1"), make_replica("r2")
    await r1.complete(job(SYSTEM + [5] * 40))  # another chat of the same system prompt
    await r2.complete(job(SYSTEM + [6] * 40))
    await r2.complete(job(chat))  # this chat's first turn
    report = await r2.record_routing_stats()
    assert set(summary_keys(routing_keys("a1", chat))) <= set(report["prefixes"]), (
        "the report names the ladder and deepest keys of the prompt the replica ran")

    replicas = [SimpleNamespace(replica_id=offline_replica_id(rid, APP),
                                max_ongoing_requests=16, routing_stats=await r.record_routing_stats())
                for rid, r in (("r1", r1), ("r2", r2))]
    router = offline_router(LoraAffinityRouter, APP)
    router.initialize_state(miss_cost=4.0, placement_ttl_s=5.0, clock=FakeClock(0.0))
    router.update_replicas(replicas)
    turn = SimpleNamespace(args=(job(chat + [44] * 30),),
                           routing_context=SimpleNamespace(should_backoff=False))
    ranks = await router.choose_replicas(replicas, turn)
    assert ranks[0][0].replica_id.unique_id == "r2", "the chat's next turn goes to the replica of its first"

    out = await r2.complete(turn.args[0])
    assert out["cached_tokens"] >= len(chat) // 16 * 16 - 16, (
        f"there it finds its earlier turn's prompt cached ({out['cached_tokens']} of {len(chat)} tokens)")


async def test_a_replica_without_the_prefix_cache_reports_no_prefixes(make_replica) -> None:
    replica = make_replica("r3", enable_prefix_caching=False)
    await replica.complete(job(SYSTEM))
    report = await replica.record_routing_stats()
    assert report["prefixes"] == [], "a replica that caches nothing claims no prefix"


async def test_a_replica_reports_its_host_tier_to_the_router(make_replica) -> None:
    replica = make_replica("r4")
    await replica.complete(job(SYSTEM, adapter="a2"))
    report = await replica.record_routing_stats()
    assert "a2" in report["host_held"], (
        "the routing stats list the adapters its host tier holds (the router's host-tier tie-break)")

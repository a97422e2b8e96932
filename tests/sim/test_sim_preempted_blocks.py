"""The simulated replica's prefix cache without chats: a request shares no prefix, but a preempted
one finds the blocks it computed on re-admission, as the engine's sequence does with
`enable_prefix_caching` on (its default)."""

from __future__ import annotations

import dataclasses

import pytest
from sim_profiles import SYNTHETIC

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.prefix_cache import SimPrefixCache, own_keys
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

CLASSES = SlaClasses()
BLOCK = 16


def test_requests_without_a_shared_prefix_get_keys_no_other_request_has() -> None:
    a = SimRequest(1, "a0", CLASSES.get("batch"), prompt=100, output=60, arrival=0.0, measured=True)
    b = SimRequest(2, "a0", CLASSES.get("batch"), prompt=100, output=60, arrival=0.0, measured=True)
    assert len(own_keys(a, BLOCK)) == 10, "one key per full block of prompt and answer (160 // 16)"
    assert not set(own_keys(a, BLOCK)) & set(own_keys(b, BLOCK)), "two requests share no key"


def test_a_first_admission_without_a_shared_prefix_reuses_nothing() -> None:
    cache = SimPrefixCache(capacity=1000, block_size=BLOCK)
    for rid in range(3):
        req = SimRequest(rid, "a0", CLASSES.get("batch"), prompt=100, output=10, arrival=0.0, measured=True)
        cache.admit(req)
        cache.release(req, req.prompt + req.output - 1)
        assert req.prefill_left == 100, f"request {rid} computes its whole prompt"
    assert cache.hit_tokens == 0, "no request found another's blocks"


def test_a_request_over_the_keys_it_can_number_is_refused_with_its_adapter() -> None:
    req = SimRequest(7, "a9", CLASSES.get("batch"), prompt=1 << 20, output=10, arrival=0.0, measured=True)
    with pytest.raises(ValueError, match="a9"):
        own_keys(req, 1)


def test_a_preempted_request_recomputes_at_most_one_block_when_its_blocks_stayed_cached() -> None:
    loop = EventLoop()
    profile = dataclasses.replace(SYNTHETIC, max_num_seqs=1)
    cache = SimPrefixCache(capacity=10_000, block_size=BLOCK)
    replica = SimReplica("r0", profile=profile, max_num_seqs=1, max_loras=2, loop=loop,
                         sizes={"a0": 1 << 20}, on_finish=lambda *_: None, on_load=lambda _: None,
                         prefix_cache=cache)
    batch = SimRequest(0, "a0", CLASSES.get("batch"), prompt=100, output=5000, arrival=0.0, measured=True)
    urgent = SimRequest(1, "a0", CLASSES.get("interactive"), prompt=10, output=2, arrival=0.0, measured=True)
    replica.add(batch, 0.0)
    loop.run(until=0.5)
    replica.add(urgent, 0.5)
    loop.run(until=1000.0)
    assert batch.preemptions == 1, "the batch request was preempted once for the urgent one"
    first_admissions = batch.prompt + urgent.prompt
    recomputed = cache.queried_tokens - first_admissions - cache.hit_tokens
    assert cache.hit_tokens > batch.prompt, "its re-admission found its prompt and its answer so far cached"
    assert 1 <= recomputed <= BLOCK, f"it recomputed only its last partial block, not {recomputed} tokens"


def test_every_simulated_replica_models_the_engine_prefix_cache() -> None:
    sim = Simulation(SimConfig(nodes=2, adapters=10, duration=1, warmup=0, max_loras=2, load=0.5), SYNTHETIC)
    assert all(r.prefix_cache is not None for r in sim.replicas.values()), (
        "the engine's prefix caching is on by default, so every replica models it, chats or not")

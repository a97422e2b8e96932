"""Placement read through the view's holders index (`ClusterView.holders`) and its shrinking list
of candidates chooses what the walk of every replica per hot adapter chose, on random clusters."""

from __future__ import annotations

import math
import random

from helpers import FakeClock

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.placement import PlacementPolicy
from lora_cluster.cluster.reports import ReplicaReport

ADAPTERS = [f"a{i}" for i in range(40)]


def walk_targets(policy: PlacementPolicy, rates: dict[str, float],
                 replicas: list[ReplicaReport]) -> dict[str, tuple[str, ...]]:
    """The placement by walking every replica for each hot adapter (the reference)."""
    live = sorted(replicas, key=lambda r: r.replica_id)
    if len(live) < 2:
        return {}
    max_num_seqs = min(r.max_num_seqs for r in live)
    planned = {r.replica_id: 0 for r in live}
    by_load = sorted(live, key=lambda r: (r.ongoing / max(r.capacity, 1), r.replica_id))
    out = {}
    for adapter, rate in sorted(rates.items(), key=lambda kv: (-kv[1], kv[0])):
        need = max(1, min(len(live), math.ceil(rate * policy.service_time_s
                                               / max(policy.hot_share * max_num_seqs, 1e-9))))
        if need < 2:
            continue
        holders = [r for r in live if adapter in r.held]
        held = {r.replica_id for r in holders}
        others = [r for r in by_load if r.replica_id not in held]
        chosen = list(holders)
        for r in others:
            if len(chosen) >= need:
                break
            if r.free_adapter_slots - planned[r.replica_id] > 0:
                chosen.append(r)
                planned[r.replica_id] += 1
        chosen = chosen[:need]
        if len(chosen) > 1:
            out[adapter] = tuple(sorted(r.replica_id for r in chosen))
    return out


def test_placement_through_the_holders_index_equals_the_walk_of_every_replica():
    rng = random.Random(5)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=100.0, clock=clock)
    ids = [f"r{i:02d}" for i in range(30)]
    spread = 0
    for step in range(300):
        rid = rng.choice(ids)
        if rng.random() < 0.1:
            view.forget(rid)
        else:
            view.update(ReplicaReport(rid, "n1", capacity=8, max_num_seqs=8, max_loras=4,
                                      running=rng.randrange(9), waiting=0,
                                      free_adapter_slots=rng.choice((0, 0, 1, 2, 3)),
                                      resident=tuple(rng.sample(ADAPTERS, rng.randrange(5)))))
        rates = {a: rng.choice((0.5, 5.0, 20.0, 80.0)) for a in rng.sample(ADAPTERS, 15)}
        policy = PlacementPolicy(service_time_s=0.5, hot_share=rng.choice((0.1, 0.5)))
        want = walk_targets(policy, rates, view.replicas())
        assert policy.targets(rates, view.replicas(), view.holders) == want, (
            f"step {step}: placement through the holders index, as the walk chooses")
        assert policy.targets(rates, view.replicas()) == want, f"step {step}: placement without the index"
        spread += len(want)
    assert spread > 300, f"many adapters were spread over several replicas: {spread}"

"""Placement knows releases (issue 47, item 5), as pure policy: a candidate `name@N` is an adapter id
of its own, so the cluster's placement counts its demand apart from the stable version's and gives it
replicas by its own traffic share; and a replica's device pool chooses victims by load priority
(`replica_policy.eviction`: frequency, then recency), so a 1% canary never takes the slot of the
version that answers the other 99%."""

from __future__ import annotations

import pytest
import torch
from helpers import FakeClock
from tickets import report

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.cluster.placement import DemandTracker, PlacementPolicy
from lora_cluster.config import EngineConfig
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.replica_policy.eviction import AccessTracker
from lora_cluster.serve.http.adapter_versions import replica_id_of
from lora_cluster.store.usage import AdapterUsage

STABLE, CANDIDATE = replica_id_of("fin", 1), replica_id_of("fin", 2)  # the ids the replicas serve
WINDOW_S = 100.0
RATE = 24.0  # the name's requests per second
POLICY = PlacementPolicy(service_time_s=0.5, hot_share=0.5)  # 4 requests in flight per replica of 8 slots
REPLICAS = [report(f"r{i}", capacity=8, resident=(STABLE,) if i <= 3 else ()) for i in range(1, 6)]


def placement(share: float) -> dict[str, tuple[str, ...]]:
    """The placement targets after a window of the name's traffic with `share` of it on the candidate."""
    demand = DemandTracker(window_s=WINDOW_S, clock=FakeClock(100.0))
    counts = {STABLE: round(RATE * WINDOW_S * (1 - share)), CANDIDATE: round(RATE * WINDOW_S * share)}
    demand.record({adapter: n for adapter, n in counts.items() if n})
    return POLICY.targets(demand.rates(), REPLICAS)


def test_the_candidate_gets_replicas_from_its_own_traffic_share_and_the_stable_version_keeps_its_own():
    before, canary, half = placement(0.0), placement(0.01), placement(0.5)
    assert before[STABLE] == ("r1", "r2", "r3"), f"24 req/s x 0.5 s over 4 per replica: 3 holders ({before})"
    assert canary[STABLE] == before[STABLE], "a 1% canary leaves the stable version's holders as they were"
    assert CANDIDATE not in canary, "at 1% the candidate needs one replica: left to affinity routing"
    assert half[CANDIDATE] and len(half[CANDIDATE]) == 2, f"at 50% it is spread like any adapter: {half}"
    assert set(half[STABLE]) <= set(before[STABLE]), "the stable version keeps holders it already had"
    assert len(half[STABLE]) == 2, "and as many as its own half of the traffic needs"


def weights(adapter_id: str) -> LoraWeights:
    return LoraWeights(adapter_id, 2, frozenset({"q_proj"}), {"q_proj": 1.0},
                       {(0, "q_proj"): torch.ones(2, 4)}, {(0, "q_proj"): torch.ones(4, 2)})


class Replica:
    """One replica's device pool with the engine's slot policy (`AdapterUsage` over an `AccessTracker`
    with the engine's default window), on a clock the test moves."""

    def __init__(self, slots: int):
        self.clock = FakeClock(1000.0)
        window = EngineConfig.model_fields["prefetch_window_s"].default
        hot = EngineConfig.model_fields["prefetch_min_requests"].default
        self.usage = AdapterUsage(AccessTracker(window, hot, self.clock))
        self.pool = AdapterPool(ModelShapes(1, {"q_proj": (4, 4)}), num_slots=slots, max_rank=4,
                                dtype=torch.float32, device=torch.device("cpu"), policy=self.usage)

    def serve(self, adapter_id: str) -> None:
        """One request of `adapter_id`, run to its end on its slot (placed first when not resident)."""
        self.usage.request_started(adapter_id)
        if self.pool.slot_of(adapter_id) is None:
            self.pool.allocate(weights(adapter_id))
        self.pool.release(self.pool.acquire(adapter_id))
        self.usage.request_finished(adapter_id)

    def traffic(self, requests: list[str], seconds: float) -> None:
        """`requests` in turn, spread evenly over `seconds`."""
        for adapter_id in requests:
            self.clock.now += seconds / len(requests)
            self.serve(adapter_id)


@pytest.mark.parametrize("other_requests", [1, 5])
def test_a_one_percent_canary_takes_the_slot_of_another_adapter_never_the_stable_versions(other_requests):
    replica = Replica(slots=2)
    name_traffic = [CANDIDATE if i == 50 else STABLE for i in range(100)]  # 1% of the name's requests
    replica.traffic([STABLE] * 20, 10.0)
    replica.serve("other")  # another adapter, requested after the stable version's last request
    replica.traffic(name_traffic[:50], 5.0)
    replica.traffic(["other"] * other_requests, 1.0)  # the most recently used adapter now
    assert replica.pool.resident() == [STABLE, "other"], "both slots are held: the canary must evict one"
    replica.usage.request_started(CANDIDATE)
    victim = replica.pool.next_victim()
    assert victim == "other", f"the canary's request evicts the less requested adapter, not {victim}"
    replica.pool.allocate(weights(CANDIDATE))
    assert replica.pool.slot_of(STABLE) is not None, "the stable version stays on the device"


def test_with_the_stable_version_and_its_canary_resident_a_new_adapter_evicts_the_canary():
    replica = Replica(slots=2)
    replica.traffic([CANDIDATE if i % 100 == 99 else STABLE for i in range(200)], 20.0)  # the canary last
    assert sorted(replica.pool.resident()) == sorted([STABLE, CANDIDATE]), "both versions are resident"
    replica.clock.now += 1.0
    replica.usage.request_started("newcomer")
    assert replica.pool.next_victim() == CANDIDATE, "the version with 1% of the traffic makes room"

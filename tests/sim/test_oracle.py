"""The oracle-placement yardstick (`sim.oracle`): it pins the most popular adapters, hotter ones on more
replicas, within the cluster's slots; pinned adapters stay on the device and their requests go to
their holders; waiting requests leave in priority order; its command line and seeded runs work."""

from __future__ import annotations

import json
import random

import pytest
from sim_profiles import SYNTHETIC

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.__main__ import main
from lora_cluster.sim.context import ServeSections, SimContext, TrueDemand
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import MACHINE_KEYS, Metrics
from lora_cluster.sim.oracle import OraclePolicy, place
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

CLASSES = SlaClasses()
PROFILE = SYNTHETIC
SMALL = SimConfig(nodes=4, adapters=40, zipf=1.0, load=0.9, duration=6, warmup=1, seed=5, max_loras=4,
                  policy="oracle")


# ----- the placement ----------------------------------------------------------------------------

IN_FLIGHT = [("a0", 20.0), ("a1", 9.0), ("a2", 3.0), ("a3", 1.0), *((f"t{i}", 0.2) for i in range(30))]
REPLICAS = ["r0", "r1", "r2", "r3"]


def test_the_placement_pins_the_most_popular_adapters_first() -> None:
    placement = place(IN_FLIGHT, REPLICAS, max_loras=4, max_num_seqs=4)
    names = [a for a, _ in IN_FLIGHT]
    assert list(placement.holders) == names[:len(placement.holders)], (
        "the pinned adapters are a popularity prefix")
    assert placement.holders, "some adapter is pinned"


def test_a_hotter_adapter_gets_more_copies_on_distinct_replicas() -> None:
    holders = place(IN_FLIGHT, REPLICAS, max_loras=4, max_num_seqs=4).holders
    assert len(holders["a0"]) == 4, "a0's 20 in flight need ceil(20 / 4) = 5 copies, capped at 4 replicas"
    assert len(holders["a1"]) == 3, "a1's 9 requests in flight need ceil(9 / 4) = 3 copies"
    assert len(holders["a0"]) > len(holders["a2"]), "the hottest adapter has more copies than a cooler one"
    assert all(len(set(rids)) == len(rids) for rids in holders.values()), "each copy is on a distinct replica"


def test_below_full_load_a_copy_carries_no_more_than_a_replicas_mean_load() -> None:
    light = [("hot", 12.0), *((f"t{i}", 0.5) for i in range(8))]  # 16 in flight: 4 per replica, batch 8
    holders = place(light, REPLICAS, max_loras=4, max_num_seqs=8).holders
    assert len(holders["hot"]) == 3, "12 in flight at 4 per replica need 3 copies, not ceil(12 / 8) = 2"


def test_the_placement_never_exceeds_the_slots() -> None:
    placement = place(IN_FLIGHT, REPLICAS, max_loras=4, max_num_seqs=4)
    assert placement.pinned_slots + placement.tail_slots <= 4 * 4 + 1e-9, (
        "pinned slots plus the tail's expected slot use fit in the cluster's slots")
    per_replica = {rid: sum(rid in rids for rids in placement.holders.values()) for rid in REPLICAS}
    assert max(per_replica.values()) <= 3, "every replica keeps one slot unpinned for the tail"


def test_a_crowded_tail_leaves_no_room_to_pin() -> None:
    tail = [(f"t{i}", 1.0) for i in range(100)]  # 100 (1 - e^-1) = 63 expected slots > 16
    assert place(tail, REPLICAS, max_loras=4, max_num_seqs=4).holders == {}, (
        "when the tail alone needs more than the slots, nothing is pinned")


# ----- a run ------------------------------------------------------------------------------------

def test_pinned_adapters_stay_on_their_holders_devices_through_a_run() -> None:
    sim = Simulation(SMALL, PROFILE)
    holders = sim.policy.placement.holders  # type: ignore[attr-defined]
    assert holders, "the small cluster pins some adapters"
    for until in (0.0, 2.0, 4.0, 7.0):
        sim.advance(until)
        missing = [(a, rid) for a, rids in holders.items() for rid in rids
                   if a not in sim.replicas[rid].adapters.refs]
        assert not missing, f"at t={until} each pinned adapter is in its holders' device slots: {missing[:3]}"


def test_requests_of_a_pinned_adapter_go_to_its_holders_and_are_hits() -> None:
    sim = Simulation(SMALL, PROFILE)
    policy = sim.policy
    holders = policy.placement.holders  # type: ignore[attr-defined]
    ended: list[SimRequest] = []
    policy_finished = policy.finished

    def record(replica: SimReplica, req: SimRequest) -> None:
        ended.append(req)
        policy_finished(replica, req)

    policy.finished = record  # type: ignore[method-assign]
    sim.finish()
    pinned = [r for r in ended if r.adapter in holders]
    assert pinned, "requests of pinned adapters ran"
    assert all(r.replica in holders[r.adapter] for r in pinned), "each ran on a replica pinning its adapter"
    assert all(r.hit for r in pinned), "each found its adapter on the device: a hit"


def test_when_the_cluster_is_full_a_more_urgent_request_queued_later_goes_first() -> None:
    loop = EventLoop()
    metrics = Metrics(CLASSES, measure_from=0.0, clock=loop.clock)
    ends: list[SimRequest] = []
    replica = SimReplica("r0", profile=PROFILE, max_num_seqs=4, max_loras=4, loop=loop, sizes={"a0": 1 << 20},
                         on_finish=lambda r, q: (ends.append(q), policy.finished(r, q)), on_load=metrics.load)
    ctx = SimContext(loop=loop, replicas={"r0": replica}, metrics=metrics, classes=CLASSES,
                     serve=ServeSections().with_fields(max_ongoing_requests=1), rng=random.Random(0),
                     demand=TrueDemand(shares=(("a0", 1.0),), rate_rps=1.0, hold_s=1.0))
    policy = OraclePolicy(ctx)
    policy.start()

    def request(rid: int, cls: str) -> SimRequest:
        return SimRequest(rid, "a0", CLASSES.get(cls), prompt=8, output=4, arrival=loop.now, measured=True)

    for req in (request(0, "standard"), request(1, "batch"), request(2, "interactive")):
        metrics.arrived()
        policy.arrive(req)
    assert len(policy.pending()) == 2, "two wait: the replica is full"
    loop.run(until=60.0, stop=lambda: metrics.outstanding == 0)
    assert [r.rid for r in ends] == [0, 2, 1], (
        "the interactive request queued later is sent (and ends) before the batch one queued earlier")


# ----- the command line and determinism ---------------------------------------------------------

@pytest.mark.parametrize("policy", ["oracle", "oracle-pinned"])
def test_the_command_line_accepts_the_yardsticks(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--policy", policy, "--nodes", "4", "--adapters", "40", "--duration", "10",
                 "--warmup", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, "the run succeeds"
    assert out["completed"] > 0, "requests complete"
    assert {"hit_rate", "hit_rate_offered", "psb", "classes"} <= set(out), "the documented keys are printed"


def test_a_seeded_oracle_run_is_deterministic() -> None:
    first, second = (Simulation(SMALL, PROFILE).finish().to_json() for _ in range(2))
    for out in (first, second):
        for key in MACHINE_KEYS:
            out.pop(key, None)
    assert first == second, "the same seed gives the same result"


def test_with_several_bases_each_group_pins_its_own_adapters() -> None:
    sim = Simulation(SimConfig(nodes=4, adapters=40, load=0.8, duration=3, warmup=1, seed=1, max_loras=4,
                               policy="oracle", bases=2), PROFILE)
    split = sim.split
    assert split is not None, "two replica groups"
    for group in sim.policy.groups:  # type: ignore[attr-defined]
        for adapter, rids in group.placement.holders.items():
            assert {split.replica_base[r] for r in rids} == {split.adapter_base[adapter]}, (
                f"{adapter} is pinned only on replicas of its own base")
    assert sim.finish().completed > 0, "the grouped oracle run completes requests"


def test_the_oracle_refuses_a_context_without_the_true_demand() -> None:
    sim = Simulation(SMALL, PROFILE)
    bare = SimContext(loop=sim.loop, replicas=sim.replicas, metrics=sim.metrics, classes=CLASSES,
                      serve=ServeSections(), rng=sim.ctx.rng)
    with pytest.raises(ValueError, match="true demand"):
        OraclePolicy(bare)

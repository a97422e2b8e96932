"""The pinned-placement yardstick (`sim.oracle_pinned`): lora-cluster's policy with the oracle's placement
pinned at start. The oracle's adapters stay in its replicas' device slots for the whole run, every other
decision is ours, and the capacity grid accepts it (the command line: `tests/sim/test_oracle.py`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from sim_profiles import SYNTHETIC

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim import capacity_grid as cg
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.context import ServeSections, SimContext
from lora_cluster.sim.experiments import main as experiments
from lora_cluster.sim.metrics import MACHINE_KEYS
from lora_cluster.sim.oracle import true_placement
from lora_cluster.sim.oracle_pinned import OraclePinnedPolicy

PROFILE = SYNTHETIC
SMALL = SimConfig(nodes=4, adapters=40, zipf=1.0, load=0.9, duration=6, warmup=1, seed=5, max_loras=4,
                  policy="oracle-pinned")


def test_the_oracles_placement_stays_pinned_for_the_whole_run() -> None:
    sim = Simulation(SMALL, PROFILE)
    holders = true_placement(sim.ctx).holders
    assert holders, "the oracle pins some adapter on this cell"
    result = sim.finish()
    assert result.completed > 0, "the run completes requests"
    for adapter, replica_ids in holders.items():
        for rid in replica_ids:
            assert adapter in sim.replicas[rid].adapters.pinned, f"{adapter} still pinned on {rid}"
            assert adapter in sim.replicas[rid].adapters.refs, f"{adapter} still in a device slot of {rid}"


def test_every_replica_keeps_a_slot_unpinned() -> None:
    sim = Simulation(SMALL, PROFILE)
    for rid, replica in sim.replicas.items():
        assert len(replica.adapters.pinned) < replica.adapters.max_loras, f"{rid} has a slot left unpinned"


def test_every_other_decision_is_lora_clusters() -> None:
    sim = Simulation(SMALL, PROFILE)
    assert isinstance(sim.policy, LoraClusterPolicy), "the policy is ours, with the pins added"
    assert sim.policy.name == "oracle-pinned", "its results are named as the yardstick's"


def test_a_seeded_run_is_deterministic() -> None:
    first, second = (Simulation(SMALL, PROFILE).finish().to_json() for _ in range(2))
    for key in MACHINE_KEYS:
        first.pop(key, None)
        second.pop(key, None)
    assert first == second, "the same seed gives the same result"


def test_it_refuses_a_context_without_the_true_demand() -> None:
    sim = Simulation(SMALL, PROFILE)
    bare = SimContext(loop=sim.loop, replicas=sim.replicas, metrics=sim.metrics, classes=SlaClasses(),
                      serve=ServeSections(), rng=random.Random(0))
    with pytest.raises(ValueError, match="true demand"):
        OraclePinnedPolicy(bare)


def test_the_capacity_grid_reruns_it_at_our_reference_load_and_shows_its_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "capacity.json"
    experiments(["capacity", "--sizes", "4x40", "--zipfs", "1.0", "--seeds", "0", "--duration", "8",
                 "--warmup", "2", "--policies", f"{cg.OURS},{cg.PINNED}", "--workers", "1",
                 "--save", str(saved)])
    out = capsys.readouterr().out
    runs = json.loads(saved.read_text())
    assert {s["policy"] for s in runs["searches"]} == {cg.OURS, cg.PINNED}, "one search per policy asked for"
    assert [r["policy"] for r in runs["references"]] == [cg.OURS, cg.PINNED], "both rerun at 0.9x of ours"
    assert f"{cg.PINNED} hit rate offered" in out, "the table has the yardstick's hit-rate column"

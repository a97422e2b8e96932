"""The simulator with several base models (`sim.bases`): replica groups, one base each, a request
only on its adapter's base's replicas, per-base figures, and one base exactly the one-base run."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from sim_profiles import SYNTHETIC

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.__main__ import main
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

PROFILE = SYNTHETIC


def _spy(replica: SimReplica, sent: list[tuple[str, str]]) -> Callable[[SimRequest, float], None]:
    add = replica.add

    def recorded(req: SimRequest, now: float) -> None:
        sent.append((req.adapter, replica.replica_id))
        add(req, now)
    return recorded


def _run(policy: str, **kw: Any) -> tuple[Simulation, Any, list[tuple[str, str]]]:
    """An overloaded run (requests take the fast path and the cluster queue), every send recorded."""
    config = SimConfig(nodes=6, adapters=40, zipf=1.0, load=2.5, duration=20, warmup=2, seed=3, max_loras=4,
                       policy=policy, **kw)
    sim = Simulation(config, PROFILE)
    sent: list[tuple[str, str]] = []
    for replica in sim.replicas.values():
        replica.add = _spy(replica, sent)  # type: ignore[method-assign]
    return sim, sim.finish(), sent


@pytest.mark.parametrize("policy", ["lora-cluster", "serve-multiplex", "round-robin"])
def test_no_request_runs_on_a_replica_of_another_base(policy: str) -> None:
    sim, result, sent = _run(policy, bases=2)
    split = sim.split
    assert split is not None, "two bases split the cluster"
    wrong = [(a, rid) for a, rid in sent if split.adapter_base[a] != split.replica_base[rid]]
    assert sent, "requests were sent to replicas"
    assert not wrong, f"requests sent to a replica of another base: {wrong[:5]}"
    bases = {a: split.adapter_base[a] for a, _ in sent}
    assert set(bases.values()) == {0, 1}, "both bases served requests"
    held = {rid: set(r.adapters.refs) for rid, r in sim.replicas.items()}
    stray = {rid: [a for a in ids if split.adapter_base[a] != split.replica_base[rid]]
             for rid, ids in held.items()}
    assert not any(stray.values()), f"adapters of another base on a replica's device: {stray}"
    assert result.details["replica_bases"] == {rid: f"base{b}" for rid, b in split.replica_base.items()}, \
        "the details list every replica's base"


def test_both_paths_of_the_lora_cluster_policy_stay_in_their_group() -> None:
    sim, _, _ = _run("lora-cluster", bases=2)
    by_base = sim.policy.details()["by_base"]
    paths = {b: (d["fast_path"], d["parked"]) for b, d in by_base.items()}
    assert all(fast > 0 and parked > 0 for fast, parked in paths.values()), \
        f"each group's admission both sent requests and parked them at its controller: {paths}"


def test_per_base_figures_add_up_to_the_cluster_totals() -> None:
    _, result, _ = _run("lora-cluster", bases=2)
    bases = result.to_json()["bases"]
    by_class = result.details["by_class"]
    assert sum(b["completed"] for b in bases.values()) == result.completed, "completed adds up"
    assert sum(b["rejected"] for b in bases.values()) == result.rejected, "rejected adds up"
    offered = sum(c["offered"] for c in by_class.values())
    assert sum(b["offered"] for b in bases.values()) == offered, "offered adds up"
    assert sum(b["unfinished"] for b in bases.values()) == result.details["unfinished"], "unfinished adds up"
    hits = sum(round(b["hit_rate"] * b["completed"]) for b in bases.values())
    assert hits == round(result.hit_rate * result.completed), "hits add up"
    assert sum(len(b["replicas"]) for b in bases.values()) == 6, "every replica is in one base"
    assert sum(b["adapters"] for b in bases.values()) == 40, "every adapter is under one base"
    assert sum(b["traffic_share"] for b in bases.values()) == pytest.approx(1.0), "traffic shares add to 1"
    for c in SlaClasses().classes:
        for field in ("offered", "met"):
            total = sum(b["by_class"][c.name][field] for b in bases.values())
            assert total == by_class[c.name][field], f"{field} of class {c.name} adds up"


def test_explicit_node_counts_and_their_errors() -> None:
    _, result, _ = _run("lora-cluster", base_nodes=(4, 2))
    bases = result.to_json()["bases"]
    assert [len(b["replicas"]) for b in bases.values()] == [4, 2], "--base-nodes sizes the groups"
    with pytest.raises(ValueError, match="adding up to 6"):
        Simulation(SimConfig(nodes=6, adapters=40, base_nodes=(4, 1)), PROFILE)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["--nodes", "4", "--bases", "5", "--json"])
    assert "--bases" in err.getvalue(), f"a clear error names the option: {err.getvalue()!r}"


def _json(argv: list[str]) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    res = json.loads(out.getvalue())
    res.pop("wall_s")
    res.pop("sim_cpu_s_per_request")
    res["control_plane"].pop("controller_cpu_s_per_sim_s")
    return res


def test_one_base_is_the_default_run() -> None:
    argv = ["--nodes", "3", "--adapters", "30", "--load", "1.5", "--duration", "6", "--warmup", "1",
            "--profile", "cpu", "--json"]
    default, one = _json(argv), _json([*argv, "--bases", "1"])
    assert "bases" not in default, "a one-base run has no per-base figures"
    assert one == default, "--bases 1 is the default run, figure for figure"

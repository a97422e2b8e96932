"""A miss without a host-tier holder prefers a replica on a node where the cluster tier's copy of the
adapter lies: the `cluster_held` field of a replica's report (bounded, sent as deltas), the view's
index of it by node, the controller's choice with hand-made reports, and the simulator's report of
the same field from its cluster tier (issue 46, item 1)."""

from __future__ import annotations

import dataclasses
import json

from helpers import FakeClock
from tickets import report, ticket

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.report_delta import apply_delta, diff, parse_report
from lora_cluster.cluster.reports import MAX_REPORTED_CLUSTER, ReplicaReport, normalized
from lora_cluster.cluster.scheduling import choose_replica, home_score
from lora_cluster.sim.cluster_store import ClusterTierSettings, SimClusterTier
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.profile import load_profile
from lora_cluster.sim.simulation import SimConfig, Simulation

REPLICAS = ("r1", "r2", "r3", "r4")


def on_node(rid: str, node: str, cluster: tuple[str, ...] = (), host: tuple[str, ...] = (),
            **kw: object) -> ReplicaReport:
    """Replica `rid`'s report (`tickets.report`) on `node`, with the cluster tier's copies of
    `cluster` on its node and `host` in its host tier."""
    base = report(rid, node=node, **kw)  # type: ignore[arg-type]
    return dataclasses.replace(base, cluster_held=cluster, host_held=host)


def view_of(*reports: ReplicaReport) -> ClusterView:
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    for r in reports:
        view.update(r)
    return view


def last_home(adapter: str, replicas: tuple[str, ...] = REPLICAS) -> str:
    """The replica that the adapter's home ranking puts last (so a test's choice is not the home's)."""
    return min(replicas, key=lambda rid: home_score(adapter, rid))


def test_a_miss_goes_to_a_node_where_the_cluster_tier_copy_lies() -> None:
    target = last_home("x")
    view = view_of(*(on_node(rid, f"n-{rid}", ("x",) if rid == target else ()) for rid in REPLICAS))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == target, (
        "the replica on the node holding the cluster-tier copy wins over the adapter's home")
    prefixed = dataclasses.replace(ticket("t", "standard", 100.0, "x"), prefix=("k1",))
    assert choose_replica(prefixed, view, {}) == target, "the same with a prompt prefix cached nowhere"


def test_every_replica_on_that_node_qualifies_not_only_the_one_that_reported_it() -> None:
    target = last_home("x")
    reporter = next(rid for rid in REPLICAS if rid != target)
    reports = [on_node(rid, "shared" if rid in (target, reporter) else f"n-{rid}",
                       ("x",) if rid == reporter else ()) for rid in REPLICAS]
    reports[REPLICAS.index(reporter)] = on_node(reporter, "shared", ("x",), running=2)  # no room
    view = view_of(*reports)
    assert view.tiers.cluster_nodes("x") == {"shared"}, "the view knows the node that holds the copy"
    assert view.tiers.cluster_local("x") == {target, reporter}, "and every replica on it"
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == target, (
        "a replica with room on the holding node, though another replica there reported the copy")


def test_the_host_tier_a_free_slot_and_room_come_before_the_cluster_tier_copy() -> None:
    local, host = last_home("x"), next(rid for rid in REPLICAS if rid != last_home("x"))
    view = view_of(*(on_node(rid, f"n-{rid}", ("x",) if rid == local else (),
                             ("x",) if rid == host else ()) for rid in REPLICAS))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == host, (
        "a host-tier holder beats a node with the cluster-tier copy")
    view = view_of(on_node("r1", "n1", ("x",), free_slots=0), on_node("r2", "n2"))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a replica on the holding node whose adapter slots all serve running requests loses to a free slot")
    view = view_of(on_node("r1", "n1", ("x",), running=2), on_node("r2", "n2"))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a replica on the holding node without room is not chosen: the other copies it from a peer")
    view = view_of(on_node("r1", "n1", ("x",)), on_node("r2", "n2", resident=("x",)))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a replica holding the adapter on its device beats the cluster-tier copy")


def test_the_cluster_index_follows_reports_and_departures() -> None:
    view = view_of(on_node("r1", "n1", ("x", "y")), on_node("r2", "n2", ("x",)))
    view.update(on_node("r1", "n1", ("y",)))
    assert view.tiers.cluster_nodes("x") == {"n2"}, "a copy gone from a node leaves the index"
    view.forget("r2")
    assert not view.tiers.cluster_local("x"), "a replica forgotten takes its node's copies with it"
    assert view.tiers.cluster_local("y") == {"r1"}, "the other adapters stay"
    view.update(on_node("r1", "n3", ("y",)))
    assert view.tiers.cluster_local("y") == {"r1"}, "a replica that moved is found on its new node"
    assert view.tiers.cluster_nodes("y") == {"n3"}, "and its old node no longer holds the copy"


def test_a_report_lists_at_most_the_latest_cluster_copies_and_sends_changes_only() -> None:
    ids = [f"c{i:04d}" for i in range(MAX_REPORTED_CLUSTER + 40)]  # least recent first
    bounded = ReplicaReport.from_dict(on_node("r1", "n1", tuple(ids)).to_dict())
    assert len(bounded.cluster_held) == MAX_REPORTED_CLUSTER, "at most MAX_REPORTED_CLUSTER copies"
    assert set(bounded.cluster_held) == set(ids[-MAX_REPORTED_CLUSTER:]), "the latest are kept"
    old = normalized(on_node("r1", "n1", ("a", "b")), seq=1)
    new = normalized(on_node("r1", "n1", ("b", "c")), seq=2)
    delta = parse_report(json.loads(json.dumps(diff(old, new).to_dict())))
    assert (delta.cluster_held_added, delta.cluster_held_removed) == (("c",), ("a",)), (  # type: ignore[union-attr]
        "a delta carries the copies added and dropped")
    assert "cluster_held" not in delta.changed, "not the whole list"  # type: ignore[union-attr]
    rebuilt = apply_delta(old, delta)  # type: ignore[arg-type]
    assert rebuilt == new, "applied, the delta gives the new report"
    assert rebuilt.cluster_set == {"b", "c"}, "its cluster set is rebuilt from the new list"


def test_the_simulator_reports_the_copies_its_cluster_tier_keeps_on_each_node() -> None:
    profile = load_profile("gpu")
    loop = EventLoop()
    sizes = {"a": 1 << 20, "b": 1 << 20, "c": 1 << 20}
    tier = SimClusterTier(profile, loop, sizes, list(sizes), ["n1", "n2"],
                          ClusterTierSettings(prefetch=False), seed=0)
    tier.preloaded("n1", ["a", "b"])
    kind, _ = tier.start_fetch("n2", "a")
    tier.fetch_done("n2", "a", kind)
    assert tier.held_on("n1") == ("a", "b"), "the node that published them holds both"
    assert tier.held_on("n2") == ("a",), "the node that copied one holds that one"
    tier.index.node_lost("n1")
    assert tier.held_on("n1") == (), "a lost node's copies are reported no more"
    assert tier.held_on("n2") == ("a",), "the surviving copy is"


def test_a_simulated_replicas_report_lists_its_nodes_cluster_tier_copies() -> None:
    sim = Simulation(SimConfig(nodes=4, adapters=40, load=1.0, seed=0, warmup=0.0, duration=10.0, preload=0))
    sim.finish()
    assert sim.cluster is not None, "the GPU profile models the cluster tier by default"
    reports = {rid: r.report(capacity=4, now=10.0) for rid, r in sim.replicas.items()}
    assert any(rep.cluster_held for rep in reports.values()), "after a cold start some node holds copies"
    for rid, rep in reports.items():
        assert rep.cluster_held == sim.cluster.held_on(rep.node_id), (
            f"{rid} reports the copies its cluster tier keeps on its node")

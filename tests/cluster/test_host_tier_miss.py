"""A miss prefers a replica whose host tier holds the adapter: the `host_held` field of a replica's
report (bounded, sent as deltas), the view's index of it, and the controller's choice, with
hand-made reports (issue 46, item 1)."""

from __future__ import annotations

import dataclasses
import json

from helpers import FakeClock
from tickets import report, ticket

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.report_delta import apply_delta, diff, parse_report
from lora_cluster.cluster.reports import MAX_REPORTED_HOST, ReplicaReport, normalized
from lora_cluster.cluster.scheduling import choose_replica, home_score
from lora_cluster.serve.replica.report import host_held
from lora_cluster.sim.store import NodeStore


def in_host(rid: str, adapters: tuple[str, ...], **kw: object) -> ReplicaReport:
    """Replica `rid`'s report (`tickets.report`) with `adapters` in its host tier."""
    return dataclasses.replace(report(rid, **kw), host_held=adapters)  # type: ignore[arg-type]


def view_of(*reports: ReplicaReport) -> ClusterView:
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    for r in reports:
        view.update(r)
    return view


def not_home(adapter: str, replicas: tuple[str, ...]) -> str:
    """The replica that the adapter's home ranking puts last (so a test's choice is not the home's)."""
    return min(replicas, key=lambda rid: home_score(adapter, rid))


def test_a_miss_goes_to_a_replica_whose_host_tier_holds_the_adapter() -> None:
    replicas = ("r1", "r2", "r3", "r4")
    target = not_home("x", replicas)
    view = view_of(*(in_host(rid, ("x",) if rid == target else ("y",)) for rid in replicas))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == target, (
        "the host-tier holder wins over the adapter's home")
    assert view.tiers.host_holders("x") == {target}, "the view indexes the host tiers by adapter"
    prefixed = dataclasses.replace(ticket("t", "standard", 100.0, "x"), prefix=("k1",))
    assert choose_replica(prefixed, view, {}) == target, "the same with a prompt prefix cached nowhere"


def test_a_device_holder_a_free_slot_and_room_come_before_the_host_tier() -> None:
    view = view_of(in_host("r1", ("x",)), report("r2", resident=("x",)))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a replica holding the adapter on its device beats one holding it in host memory")
    view = view_of(in_host("r1", ("x",), free_slots=0), report("r2"))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a host-tier holder whose adapter slots all serve running requests loses to a free slot")
    view = view_of(in_host("r1", ("x",), running=2), report("r2"))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", (
        "a host-tier holder without room is not chosen")
    view = view_of(in_host("r1", ("x",)), in_host("r2", ("x",)))
    home = max(("r1", "r2"), key=lambda rid: home_score("x", rid))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == home, (
        "among host-tier holders, the adapter's home")


def test_the_host_index_follows_reports_deltas_and_departures() -> None:
    view = view_of(in_host("r1", ("x", "y")), in_host("r2", ("x",)))
    view.update(in_host("r1", ("y",)))
    assert view.tiers.host_holders("x") == {"r2"}, "an adapter evicted from a host tier leaves the index"
    view.forget("r2")
    assert not view.tiers.host_holders("x"), "a replica forgotten leaves the index"
    assert view.tiers.host_holders("y") == {"r1"}, "the other adapters stay"


def test_a_report_lists_at_most_the_most_recent_host_adapters_and_sends_changes_only() -> None:
    ids = [f"h{i:04d}" for i in range(MAX_REPORTED_HOST + 50)]  # least recently used first
    bounded = ReplicaReport.from_dict(in_host("r1", tuple(ids)).to_dict())
    assert len(bounded.host_held) == MAX_REPORTED_HOST, "at most MAX_REPORTED_HOST host adapters"
    assert set(bounded.host_held) == set(ids[-MAX_REPORTED_HOST:]), "the most recently used are kept"
    old = normalized(in_host("r1", ("a", "b")), seq=1)
    new = normalized(in_host("r1", ("b", "c")), seq=2)
    delta = parse_report(json.loads(json.dumps(diff(old, new).to_dict())))
    assert (delta.host_held_added, delta.host_held_removed) == (("c",), ("a",)), (  # type: ignore[union-attr]
        "a delta carries the host adapters added and dropped")
    assert "host_held" not in delta.changed, "not the whole list"  # type: ignore[union-attr]
    rebuilt = apply_delta(old, delta)  # type: ignore[arg-type]
    assert rebuilt == new, "applied, the delta gives the new report"
    assert rebuilt.host_set == {"b", "c"}, "its host set is rebuilt from the new list"


def test_replicas_report_their_host_tiers_most_recent_adapters() -> None:
    keys = [f"a{i}" for i in range(MAX_REPORTED_HOST + 3)]
    assert host_held(lambda: keys) == tuple(keys[3:]), "a live replica: the last the host cache took"
    assert host_held(None) == (), "a store without a host tier reports none"
    store = NodeStore(host_bytes=300, disk_bytes=1000)
    for aid in ("a", "b", "c"):
        store.fetched(aid, 100, "s3")
    store.fetched("a", 100, "host")  # used again: the most recent
    assert store.host.recent(2) == ("c", "a"), "the simulator: the two most recently used, oldest first"

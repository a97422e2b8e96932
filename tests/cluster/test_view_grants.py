"""The controller's view learns from its own grants: a grant of an adapter to a replica whose report
lacks it makes that replica a holder (and takes one of its free adapter slots) until a report lists
the ticket as arrived, so the adapter's next tickets in a report period are hits there, not misses
that load it on another replica again (measured at 1,024 replicas, where a replica reports every
2.56 s: docs/scale.md)."""

from __future__ import annotations

import random

from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.reports import ReplicaReport


def test_the_next_ticket_of_an_adapter_granted_as_a_miss_goes_where_it_loads_before_any_report():
    ctl = Controller(CLASSES, ControllerSettings(), clock=FakeClock(100.0))
    for rid in ("r1", "r2", "r3", "r4"):
        ctl.report(report(rid, capacity=4, free_slots=2))
    first = ctl.park(ticket("t1", "standard", 100.0, "fresh"))
    assert first is not None, "room everywhere: the miss is granted at once"
    second = ctl.park(ticket("t2", "standard", 100.0, "fresh"))
    assert second is not None and second.replica_id == first.replica_id, (
        f"the second ticket of 'fresh' joins the first at {first.replica_id}, where it loads, "
        f"not {second and second.replica_id}")
    assert ctl.view.holders("fresh") == {first.replica_id}, "the grant made its replica the holder"


def test_a_grant_holds_its_adapter_until_a_report_lists_it_as_arrived_or_it_is_released():
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=30.0, clock=clock)
    view.update(report("r1", capacity=4, free_slots=1))
    view.granted("r1", "t1", adapter_id="a")
    assert "a" in view.held("r1"), "granted: the replica holds its adapter"
    assert "r1" not in view.slot_ids(), "the adapter on its way takes the replica's one free slot"
    view.update(report("r1", capacity=4, free_slots=1))
    assert "a" in view.held("r1"), "a report built before the ticket arrived does not undo the grant"
    view.update(report("r1", capacity=4, free_slots=0, resident=("a",), arrived=("t1",)))
    assert view.held("r1") == frozenset({"a"}), "the report after the arrival shows the adapter itself"
    view.update(report("r1", capacity=4, free_slots=1))
    assert view.holders("a") == frozenset(), "evicted since: no longer held"
    view.granted("r1", "t2", adapter_id="b")
    assert view.release("t2", "r1"), "the grant was counted"
    assert "b" not in view.held("r1") and "r1" in view.slot_ids(), (
        "a released grant no longer holds its adapter nor its slot")


def test_a_grant_of_a_held_adapter_or_of_the_base_model_changes_nothing_held():
    view = ClusterView(stale_after_s=30.0, clock=FakeClock(100.0))
    view.update(report("r1", capacity=4, free_slots=1, resident=("a",)))
    held = view.held("r1")
    view.granted("r1", "t1", adapter_id="a")
    view.granted("r1", "t2")
    assert view.held("r1") is held, "a hit and a base-model request leave the held set as it was"
    assert "r1" in view.slot_ids(), "and the free slot"


def _random_report(rng: random.Random, rid: str, arrived: tuple[str, ...]) -> ReplicaReport:
    return report(rid, capacity=8, running=rng.randrange(4), free_slots=rng.choice((0, 1, 2, 3)),
                  resident=tuple(rng.sample(ADAPTERS, rng.randrange(4))), arrived=arrived)


ADAPTERS = [f"a{i}" for i in range(12)]


def test_the_holders_index_and_the_slots_follow_reports_grants_arrivals_and_releases_exactly():
    """Against a model kept by the test: a replica holds its report's adapters and those of its
    grants not arrived, not released, younger than `grant_ttl_s`, whose adapter its report lacked."""
    rng = random.Random(5)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=30.0, clock=clock, grant_ttl_s=1.0)
    ids = [f"r{i}" for i in range(8)]
    pending: dict[str, dict[str, tuple[str, float]]] = {rid: {} for rid in ids}  # rid -> ticket -> (a, at)
    grants = 0
    for step in range(3000):
        clock.now += rng.choice((0.0, 0.01, 0.1))
        rid, action = rng.choice(ids), rng.random()
        mine = pending[rid]
        if action < 0.3:
            arrived = tuple(t for t in mine if rng.random() < 0.5)
            new = _random_report(rng, rid, arrived)
            view.update(new)
            pending[rid] = {t: (a, at) for t, (a, at) in mine.items() if t not in arrived
                            and clock.now - at < 1.0 and a not in new.held}
        elif action < 0.7 and view.get(rid) is not None:
            adapter = rng.choice(ADAPTERS)
            view.granted(rid, f"t{step}", adapter_id=adapter)
            grants += 1
            if adapter not in view.get(rid).held:
                mine[f"t{step}"] = (adapter, clock.now)
        elif action < 0.8 and mine:
            gone = rng.choice(list(mine))
            view.arrived(rid, [gone])
            del mine[gone]
        elif action < 0.9 and mine:
            gone = rng.choice(list(mine))
            assert view.release(gone, rid), f"step {step}: {gone} was counted at {rid}"
            del mine[gone]
        elif action >= 0.98:
            view.forget(rid)
            pending[rid] = {}
        for r in ids:
            got = view.get(r)
            adapters = {a for a, _ in pending[r].values()}
            want = frozenset() if got is None else got.held | adapters
            assert view.held(r) == want, f"step {step}: {r} holds its report's and its pending grants'"
            has_slot = got is not None and got.free_adapter_slots - len(adapters) > 0
            assert (r in view.slot_ids()) is has_slot, f"step {step}: {r}'s free slots less its pending"
        for a in ADAPTERS:
            assert view.holders(a) == {r for r in ids if a in view.held(r)}, f"step {step}: holders of {a}"
    assert grants > 500, f"grants were made: {grants}"

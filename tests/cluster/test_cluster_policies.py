"""The controller's policies as pure functions with a fake clock: queue order, aging, deadlines,
grants by affinity, preemption choice, placement targets, and the view rebuilt after a restart."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random

import pytest
from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster.cluster_queue import ClusterQueue
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller import Controller, ControllerSettings, Refusal
from lora_cluster.cluster.placement import DemandTracker, PlacementPolicy
from lora_cluster.cluster.report_rules import projected_batch
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.scheduling import choose_replica, home_score, preemption_target
from lora_cluster.config import ServeConfig
from lora_cluster.errors import ClusterOverloadedError, WaitBoundError

# ----- the queue ------------------------------------------------------------------------------


def test_queue_orders_by_class_then_deadline_then_arrival():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=10, aging_s=100.0, clock=clock)
    for t in (ticket("b1", "batch", 100.0), ticket("s1", "standard", 100.1),
              ticket("i1", "interactive", 100.2), ticket("s2", "standard", 100.3)):
        q.park(t)
    assert [t.ticket_id for t in q.in_order()] == ["i1", "s1", "s2", "b1"], "class first, then arrival"
    assert q.pop().ticket_id == "i1", "pop takes the most urgent"


def test_aging_lets_a_long_waiting_batch_ticket_pass_fresh_standard_ones():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=10, aging_s=1.0, clock=clock, top_priority=0)
    q.park(ticket("old-batch", "batch", 100.0))
    clock.now = 103.0  # three priority levels of aging: batch (2) now ranks as -1
    q.park(ticket("fresh-standard", "standard", 103.0))
    assert q.peek().ticket_id == "old-batch", "aging keeps a batch ticket from starving"
    assert q.urgency(q.peek()) == pytest.approx(-1.0), "urgency is priority - waited / aging_s"


def test_aging_never_lifts_a_ticket_above_the_most_urgent_class():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=10, aging_s=1.0, clock=clock, top_priority=0)
    q.park(ticket("old-batch", "batch", 100.0))
    q.park(ticket("old-standard", "standard", 100.0))
    clock.now = 200.0  # a hundred levels of aging
    q.park(ticket("fresh-interactive", "interactive", 200.0))
    assert [t.ticket_id for t in q.in_order()] == ["fresh-interactive", "old-standard", "old-batch"], (
        "a fresh request of the most urgent class goes before any aged one")
    plain = ClusterQueue(max_size=10, aging_s=1.0, clock=clock)
    plain.park(ticket("old-batch", "batch", 100.0))
    plain.park(ticket("fresh-interactive", "interactive", 200.0))
    assert plain.peek().ticket_id == "old-batch", "without top_priority, aging applies to every class"


def test_the_predicted_wait_counts_only_the_tickets_ahead():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock, top_priority=0)
    for i in range(6):
        q.park(ticket(f"b{i}", "batch", 100.0))
    for i in range(2):
        q.park(ticket(f"i{i}", "interactive", 100.0))
    q.remove("i1")
    wait = q.predicted_wait_s(ticket("new-i", "interactive", 100.0), expected_rate=1.0)
    assert wait == pytest.approx(2.0), (
        "one interactive ticket ahead, plus itself, at one request per second")
    assert q.predicted_wait_s(ticket("new-b", "batch", 100.0), expected_rate=1.0) == pytest.approx(8.0), (
        "every queued ticket is ahead of a fresh batch one")


def test_a_full_queue_refuses_with_a_retry_after():
    q = ClusterQueue(max_size=1, aging_s=10.0, clock=FakeClock(100.0))
    q.park(ticket("a", "batch", 100.0))
    with pytest.raises(ClusterOverloadedError, match="cluster_queue_size") as info:
        q.park(ticket("b", "batch", 100.0))
    assert info.value.retry_after_s >= 1.0, "a refusal says when to retry"


def test_a_deadline_that_cannot_be_met_is_refused_at_once():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock)
    q.drain.record(10)  # ten requests left the queue just now: a drain rate of 4/s (over 2.5 s at least)
    for i in range(4):
        q.park(ticket(f"i{i}", "interactive", 100.0))  # the 4th starts after 1 s: just in time
    with pytest.raises(ClusterOverloadedError, match="time-to-first-token target of 1 s"):
        q.park(ticket("late", "interactive", 100.0))
    q.park(ticket("patient", "batch", 100.0))  # no target: queued however long the wait
    assert "patient" in q, "a class without a TTFT target is never refused for its deadline"


def test_removed_tickets_are_skipped():
    q = ClusterQueue(max_size=10, aging_s=10.0, clock=FakeClock(100.0))
    q.park(ticket("a", "interactive", 100.0))
    q.park(ticket("b", "standard", 100.0))
    assert q.remove("a").ticket_id == "a", "remove returns the ticket"
    assert q.peek().ticket_id == "b", "a removed ticket is never granted"
    assert len(q) == 1, "the queue counts live tickets"


# ----- grants and preemption ------------------------------------------------------------------


def test_a_ticket_goes_to_a_holder_of_its_adapter_with_room():
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    view.update(report("r1", running=0))
    view.update(report("r2", running=1, resident=("x",)))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", "the holder wins"
    home = max(("r1", "r2"), key=lambda rid: home_score("y", rid))
    assert choose_replica(ticket("t", "standard", 100.0, "y"), view, {}) == home, (
        "else the adapter's home among the replicas with room")
    assert choose_replica(ticket("t", "standard", 100.0, "y"), view, {"y": ("r2",)}) == "r2", (
        "else a replica the placement table names")
    view.granted("r2", "t0")
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r1", (
        "a replica whose room went to a grant on its way is full")
    view.update(report("r2", running=2, resident=("x",), arrived=("t0",)))
    assert view.free("r2") == 0, "an arrived grant is counted once, in the replica's own count"
    view.update(report("r2", running=1, resident=("x",)))
    assert choose_replica(ticket("t", "standard", 100.0, "x"), view, {}) == "r2", "room once it finished"


def test_preemption_waits_for_its_fraction_and_picks_the_most_less_urgent_work():
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=5, clock=clock)
    view.update(report("r1", running=5, by_priority={1: 5}))
    view.update(report("r2", running=2, by_priority={2: 2}))
    view.update(report("r3", running=2, by_priority={0: 2}))
    urgent = ticket("t", "interactive", 100.0)
    settings = ControllerSettings(preempt_after_fraction=0.5, top_class_preempt_after_fraction=0.0)
    assert settings.preempt_wait_s(ticket("s", "standard", 100.0), top_priority=0) == 2.5, (
        "a standard request waits half of its 5 s TTFT target before it may preempt")
    assert settings.preempt_wait_s(urgent, top_priority=0) == 0.0, "the most urgent class at once"
    assert preemption_target(urgent, view) == "r1", "the replica with the most less urgent running work"
    assert preemption_target(ticket("s", "standard", 100.0), view) == "r2", (
        "work as urgent as the ticket does not count")
    assert preemption_target(ticket("b", "batch", 100.0), view) is None, "nothing is less urgent than batch"


def test_controller_grants_as_capacity_frees_and_preempts_for_urgent_work():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    ctl.report(report("r1", capacity=2, running=2, by_priority={2: 2}))
    assert ctl.park(ticket("b", "batch", 100.0)) is None, "no room: the batch ticket waits"
    assert ctl.park(ticket("i", "interactive", 100.0)) is None, "no room: the urgent ticket waits too"
    clock.now = 100.6
    ctl.tick()
    grants = ctl.take_grants()
    assert grants.get("i") is not None and grants["i"].preempt, "the urgent ticket preempts after 0.5 s"
    assert "b" not in grants, "the batch ticket does not preempt"
    still_coming = ctl.report(report("r1", capacity=2, running=1, by_priority={0: 1}))
    assert ctl.take_grants() == {}, "the urgent ticket's grant still counts until the replica says it arrived"
    assert still_coming["queue_depth"] == 1, "the batch ticket still waits"
    reply = ctl.report(report("r1", capacity=2, running=1, by_priority={0: 1}, arrived=("i",)))
    assert ctl.take_grants()["b"].replica_id == "r1", "the batch ticket gets the slot that freed"
    assert reply["queue_depth"] == 0, "the reply tells the replica that nothing waits any more"


def test_a_restarted_controller_rebuilds_its_view_from_the_next_reports():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, clock=clock)
    ctl.report(report("r1", node="n1"))
    ctl.report(report("r2", node="n2"))
    restarted = Controller(CLASSES, clock=clock)
    assert restarted.snapshot()["nodes"] == {}, "a new controller starts empty"
    restarted.report(report("r1", node="n1"))
    restarted.report(report("r2", node="n2"))
    assert restarted.snapshot()["nodes"] == ctl.snapshot()["nodes"], "one round of reports rebuilds the view"
    clock.now += 10
    restarted.report(report("r1", node="n1"))
    restarted.tick()
    assert list(restarted.snapshot()["nodes"]) == ["n1"], "a replica that stopped reporting is forgotten"


def test_cancelled_tickets_leave_no_trace():
    ctl = Controller(CLASSES, clock=FakeClock(100.0))
    ctl.report(report("r1", running=2))
    ctl.park(ticket("gone", "standard", 100.0))
    ctl.cancel("gone")
    ctl.report(report("r1", running=0))
    assert ctl.take_grants() == {}, "a cancelled ticket is never granted"
    assert ctl.snapshot()["queue"]["depth"] == 0, "and does not stay queued"


def test_a_grant_that_will_not_be_used_frees_its_room_before_the_grant_ttl():
    ctl = Controller(CLASSES, clock=FakeClock(100.0))
    ctl.report(report("r1", capacity=2, running=0))
    assert ctl.park(ticket("a", "standard", 100.0)) is not None, "r1 has room: granted at once"
    assert ctl.park(ticket("b", "standard", 100.0)) is not None, "and room for a second one"
    assert ctl.view.free("r1") == 0, "both grants reserve r1's room until r1 reports them"
    ctl.cancel("a")  # its caller went away after the grant was decided: which replica is not said
    assert ctl.view.free("r1") == 1, "the grant nobody will use frees its slot at once"
    ctl.cancel("b", "r1")  # the ingress could not send it to r1
    assert ctl.view.free("r1") == 2, "so does one the ingress gives back"
    assert ctl.counts["cancelled"] == 2, "both are counted as cancelled"


# ----- placement ------------------------------------------------------------------------------


def test_demand_rates_decay_with_the_window_and_stay_bounded():
    clock = FakeClock(100.0)
    demand = DemandTracker(window_s=10.0, clock=clock, max_adapters=3)
    demand.record({"a": 10})
    assert demand.rates()["a"] == pytest.approx(1.0), "n requests add n / window_s requests per second"
    clock.now += 10.0
    demand.record({"b": 10})
    assert demand.rates()["a"] == pytest.approx(math.exp(-1.0)), "a rate decays by e per window"
    clock.now += 1000.0  # past the lazy reference's rebase interval
    demand.record({"c": 10})
    assert demand.rates() == pytest.approx({"c": 1.0}), "rates that decayed away are forgotten"
    for i in range(20):
        demand.record({f"x{i}": i + 1})
    assert len(demand.rates()) <= 3, "only the max_adapters busiest are kept"


def test_hot_adapters_spread_and_cold_ones_stay_on_one_replica():
    clock = FakeClock(100.0)
    demand = DemandTracker(window_s=10.0, clock=clock)
    demand.record({"hot": 200, "cold": 2})  # 20 req/s and 0.2 req/s
    rates = demand.rates()
    assert rates["hot"] == pytest.approx(20.0), "the rate is requests over the window"
    policy = PlacementPolicy(service_time_s=0.5, hot_share=0.5)
    replicas = [report("r1", capacity=8, resident=("hot",)), report("r2", capacity=8),
                report("r3", capacity=8, free_slots=0)]
    targets = policy.targets(rates, replicas)
    assert targets["hot"] == ("r1", "r2"), "load 10 over 4 slots per replica: the holder and one more"
    assert "cold" not in targets, "a cold adapter is left to affinity routing"
    assert "r3" not in targets["hot"], "a replica with no free adapter slot is never a new holder"
    clock.now += 100
    assert demand.rates() == {}, "demand decays away when requests stop"


def test_controller_tells_a_replica_to_prefetch_what_placement_chose_for_it():
    ctl = Controller(CLASSES, ControllerSettings(hot_share=0.1, demand_window_s=1.0), clock=FakeClock(100.0))
    ctl.report(report("r1", capacity=8, resident=("hot",), demand={"hot": 50}))
    reply = ctl.report(report("r2", capacity=8))
    assert reply["prefetch"] == ["hot"], "the new holder is told to prefetch the hot adapter"
    assert ctl.placement()["hot"] == ("r1", "r2"), "the placement table names both holders"


def test_requests_sent_the_direct_way_count_before_the_replicas_report_them():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, clock=clock)
    ctl.report(report("r1", capacity=2, running=0))  # stale: two direct requests are on their way there
    claims = {"inflight": {"r1": 1}, "unassigned": 1}
    assert ctl.park(ticket("t", "standard", 100.0), claims) is None, (
        "one request runs there and one more is on its way: no room for the ticket")
    clock.now += 2.0  # the claim expired; the replica's report is the truth again
    ctl.report(report("r1", capacity=2, running=1))
    assert ctl.take_grants()["t"].replica_id == "r1", "the ticket gets the slot the report shows free"


def test_an_urgent_ticket_that_can_preempt_is_not_refused_for_its_deadline():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}))  # busy with batch work
    ctl.queue.drain.record(1)  # a slow measured drain: any wait looks long
    for i in range(3):
        ctl.park(ticket(f"b{i}", "batch", 100.0))
    assert ctl.park(ticket("i", "interactive", 100.0)) is None, (
        "queued, not refused: it can preempt the running batch work in time")
    ctl.report(report("r1", capacity=1, running=1, by_priority={0: 1}))  # now urgent work runs there
    with pytest.raises(ClusterOverloadedError, match="cannot be met"):
        ctl.park(ticket("i2", "interactive", 100.0))


def test_the_expected_drain_rate_of_the_replicas_avoids_refusals_a_slow_measurement_would_cause():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock)
    q.drain.record(1)  # measured: 0.4 requests per second
    for i in range(3):
        q.park(ticket(f"s{i}", "batch", 100.0))
    with pytest.raises(ClusterOverloadedError):
        q.park(ticket("late", "interactive", 100.0))
    q.park(ticket("in-time", "interactive", 100.0), expected_rate=10.0)
    assert "in-time" in q, "with replicas that complete 10 requests/s, 4 ahead take 0.4 s: in time"


def test_a_hit_a_few_tickets_back_is_granted_before_a_miss_at_the_head():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, resident=("x",)))
    ctl.park(ticket("miss", "standard", 100.0, "y"))
    ctl.park(ticket("hit", "standard", 100.1, "x"))
    ctl.park(ticket("urgent-miss", "interactive", 100.2, "z"))
    ctl.report(report("r1", capacity=1, running=0, resident=("x",)))
    grants = ctl.take_grants()
    assert list(grants) == ["urgent-miss"], "a hit never overtakes a more urgent class"
    ctl.report(report("r1", capacity=1, running=0, resident=("x",), arrived=("urgent-miss",)))
    assert list(ctl.take_grants()) == ["hit"], "within a class, the hit goes first to the slot that holds x"


def test_a_preempting_grant_prefers_a_holder_of_the_adapter():
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    view.update(report("r1", running=2, by_priority={2: 2}))
    view.update(report("r2", running=2, by_priority={2: 1, 0: 1}, resident=("x",)))
    assert preemption_target(ticket("t", "interactive", 100.0, "x"), view) == "r2", (
        "a holder with less urgent work wins over more less urgent work elsewhere")
    home = max(("r1", "r2"), key=lambda rid: home_score("y", rid))
    assert preemption_target(ticket("t", "interactive", 100.0, "y"), view) == home, (
        "without a holder, the adapter's home among the replicas with less urgent work")


def test_an_urgent_ticket_whose_adapter_is_held_preempts_its_holder_at_once():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    ctl.report(report("r2", capacity=1, running=1, by_priority={2: 1}))
    grant = ctl.park(ticket("hit", "interactive", 100.0, "x"))
    assert grant is not None and grant.replica_id == "r1" and grant.preempt, (
        "a hit by preemption now beats waiting half the TTFT target")
    assert ctl.park(ticket("miss", "interactive", 100.0, "y")) is None, (
        "an adapter nobody holds waits its fraction of the target before preempting")


def test_a_holder_with_less_urgent_work_beats_a_miss_on_a_replica_with_room():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={0: 1}, resident=("x",)))
    ctl.report(report("r2", capacity=2, running=2, by_priority={2: 2}))
    ctl.park(ticket("b", "batch", 99.0, "y"))
    ctl.park(ticket("s", "standard", 100.0, "x"))
    assert ctl.take_grants() == {}, "no room anywhere yet, and the holder runs urgent work"
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    grants = ctl.take_grants()
    assert grants["s"].replica_id == "r1" and grants["s"].preempt, (
        "once the holder runs less urgent work, the ticket preempts there at once, before it is due")
    ctl.report(report("r2", capacity=2, running=1, by_priority={2: 1}))
    grants = ctl.take_grants()
    assert "s" not in grants, "the urgent ticket does not also miss on r2"
    assert grants["b"].replica_id == "r2" and not grants["b"].preempt, "r2's room goes to the next ticket"


def test_a_full_queue_bumps_its_least_urgent_ticket_for_a_more_urgent_one():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(queue_size=2), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={0: 1}))
    ctl.park(ticket("b-old", "batch", 99.0))
    ctl.park(ticket("b-new", "batch", 100.0))
    with pytest.raises(ClusterOverloadedError, match="cluster_queue_size"):
        ctl.park(ticket("b-late", "batch", 100.0))
    assert ctl.park(ticket("s", "standard", 100.0)) is None, "the standard ticket is queued"
    refusals = ctl.take_grants()
    assert list(refusals) == ["b-new"], "the least urgent ticket (the newest batch one) is bumped"
    assert isinstance(refusals["b-new"], Refusal) and refusals["b-new"].retry_after_s >= 1.0, (
        "its request is refused with a retry-after")
    assert "b-new" not in ctl.queue and "s" in ctl.queue, "the queue keeps its bound"
    assert ctl.snapshot()["controller"]["counts"]["bumped"] == 1, "bumps are counted"


def test_a_ticket_without_a_deadline_is_refused_at_once_when_it_would_outwait_the_queue_timeout():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock, top_priority=0)
    for i in range(9):
        q.park(ticket(f"b{i}", "batch", 100.0))
    with pytest.raises(ClusterOverloadedError, match="cluster_queue_timeout_s"):
        q.park(ticket("late", "batch", 100.0), expected_rate=1.0, max_wait_s=5.0)
    q.park(ticket("in-time", "batch", 100.0), expected_rate=1.0, max_wait_s=30.0)
    assert "in-time" in q, "a wait of 10 s within a 30 s timeout is queued"


def test_a_replica_s_later_report_supersedes_an_ingress_claim_on_it():
    """Regression: a claim hid a slot freed after it for its whole TTL (1 s), so a ticket parked
    behind it waited that long (912 ms p50 after the slot freed, against 271 ms without the
    controller; bench_sla.md, seventh run)."""
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=5, clock=clock, claim_ttl_s=1.0, claim_superseded_after_s=0.1)
    view.update(report("r0", capacity=4, running=4))
    view.claim("ing0", {"r0": 4}, 0)
    clock.now += 0.05
    view.update(report("r0", capacity=4, running=3))
    assert view.free("r0") == 0, "a report right after the claim may predate it: the claim still counts"
    clock.now += 0.15
    view.update(report("r0", capacity=4, running=3))
    assert view.free("r0") == 1, "a report well after the claim shows the slot freed since"
    assert view.total_free() == 1, "the running total follows"


def test_the_incremental_room_total_equals_the_sum_of_every_replica_s_room():
    rng, clock = random.Random(3), FakeClock(100.0)
    view = ClusterView(stale_after_s=5, clock=clock, claim_ttl_s=1.0)
    for step in range(400):
        rid = f"r{rng.randrange(6)}"
        action = rng.random()
        if action < 0.4:
            view.update(report(rid, capacity=4, running=rng.randrange(6), arrived=tuple(
                t for t in (f"t{step - k}" for k in range(1, 4)) if rng.random() < 0.5)))
        elif action < 0.6:
            view.granted(rid, f"t{step}")
        elif action < 0.8:
            inflight = {f"r{k}": rng.randrange(5) for k in range(6) if rng.random() < 0.5}
            view.claim(f"ing{rng.randrange(2)}", inflight, rng.randrange(3))
        elif action < 0.9:
            view.forget(rid)
        clock.now += rng.random() * 0.5
        if rng.random() < 0.1:
            view.prune()
        expected = sum(max(0, view.free(r)) for r in list(view.ids()))
        assert view.total_free() == expected, f"step {step}: the running total drifted from the room"


# ----- affinity under overload: hits first within a class, homes for misses ---------------------


def test_the_queue_finds_the_most_urgent_ticket_of_an_adapter_and_class():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock)
    for i in range(5):
        q.park(ticket(f"y{i}", "standard", 100.0 + i, "y"))
    q.park(ticket("x-batch", "batch", 99.0, "x"))
    q.park(ticket("x-late", "standard", 101.0, "x"))
    q.park(ticket("x-early", "standard", 100.5, "x"))
    assert q.best_for("x", 1).ticket_id == "x-early", "the earliest standard ticket for x"
    assert q.best_for("x", 2).ticket_id == "x-batch", "the classes are kept apart"
    q.remove("x-early")
    assert q.best_for("x", 1).ticket_id == "x-late", "a removed ticket is never offered"
    q.remove("x-late")
    assert q.best_for("x", 1) is None, "no standard ticket for x is left"
    assert q.best_for("z", 1) is None, "an adapter without tickets has none"


def test_the_queue_knows_exactly_which_adapters_have_tickets_of_each_class():
    rng = random.Random(7)
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=40, aging_s=10.0, clock=clock, top_priority=0)
    names = {0: "interactive", 1: "standard", 2: "batch"}
    for step in range(3000):
        clock.now += 0.01
        if rng.random() < 0.55:
            priority = rng.randint(0, 2)
            with contextlib.suppress(ClusterOverloadedError):  # full, and nothing less urgent to bump
                q.park(ticket(f"t{step}", names[priority], clock.now, rng.choice(["a", "b", "c", "d", None])))
        else:
            queued = list(q.in_order())
            if queued:
                q.remove(rng.choice(queued[:3] + queued[-2:]).ticket_id)  # the most urgent, or bumped ones
        for priority in names:
            expected = {t.adapter_id for t in q.in_order() if t.priority == priority}
            assert q.queued_adapters(priority) == expected, f"step {step}: the adapters with class {priority}"
            for adapter_id in ("a", "b", "c", "d", None):
                best = min((t for t in q.in_order() if t.priority == priority and t.adapter_id == adapter_id),
                           key=lambda t: q.sort_key(t.ticket_id), default=None)
                assert q.best_for(adapter_id, priority) == best, f"step {step}: best for {adapter_id}"


def test_a_hit_far_back_in_its_class_gets_the_room_before_a_miss_at_the_head():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, resident=("x",)))
    for i in range(20):
        ctl.park(ticket(f"miss{i}", "standard", 100.0, f"y{i}"))
    ctl.park(ticket("hit", "standard", 100.0, "x"))
    ctl.report(report("r1", capacity=1, running=0, resident=("x",)))
    assert list(ctl.take_grants()) == ["hit"], "the hit 20 tickets back goes first to the slot that holds x"


def test_only_hits_that_arrived_soon_after_a_miss_may_pass_it():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(affinity_wait_fraction=0.25), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, resident=("x",)))
    ctl.park(ticket("miss", "standard", 100.0, "y"))
    ctl.park(ticket("late-hit", "standard", 101.3, "x"))
    clock.now = 101.3
    ctl.report(report("r1", capacity=1, running=0, resident=("x",)))
    assert list(ctl.take_grants()) == ["miss"], (
        "a hit that arrived more than 1.25 s (a quarter of the 5 s target) after the miss does not pass it")
    ctl = Controller(CLASSES, ControllerSettings(affinity_wait_fraction=0.25), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, resident=("x",)))
    ctl.park(ticket("miss", "standard", 101.3, "y"))
    ctl.park(ticket("soon-hit", "standard", 102.0, "x"))
    clock.now = 103.0
    ctl.report(report("r1", capacity=1, running=0, resident=("x",)))
    assert list(ctl.take_grants()) == ["soon-hit"], (
        "a hit that arrived 0.7 s after the miss passes it, though the miss has waited 1.7 s")


def test_misses_of_one_adapter_go_to_the_same_replica_whatever_the_order_of_the_replicas():
    clock = FakeClock(100.0)
    homes = set()
    for order in (["r1", "r2", "r3", "r4"], ["r4", "r3", "r2", "r1"], ["r2", "r4", "r1", "r3"]):
        view = ClusterView(stale_after_s=5, clock=clock)
        for rid in order:
            view.update(report(rid, capacity=2))
        homes.add(choose_replica(ticket("t", "standard", 100.0, "x"), view, {}))
    assert len(homes) == 1, f"one home for x, however the replicas reported: {homes}"
    spread = set()
    view = ClusterView(stale_after_s=5, clock=clock)
    for rid in ("r1", "r2", "r3", "r4"):
        view.update(report(rid, capacity=2))
    for i in range(40):
        spread.add(choose_replica(ticket("t", "standard", 100.0, f"a{i}"), view, {}))
    assert spread == {"r1", "r2", "r3", "r4"}, "different adapters have different homes"


def test_a_replica_that_leaves_moves_only_the_adapters_whose_home_it_was():
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=5, clock=clock)
    for rid in ("r1", "r2", "r3", "r4"):
        view.update(report(rid, capacity=2))
    before = {f"a{i}": choose_replica(ticket("t", "standard", 100.0, f"a{i}"), view, {}) for i in range(60)}
    view.forget("r2")
    after = {a: choose_replica(ticket("t", "standard", 100.0, a), view, {}) for a in before}
    moved = {a for a in before if before[a] != after[a]}
    assert moved == {a for a, home in before.items() if home == "r2"}, "only r2's adapters found a new home"


def test_due_tickets_that_a_holder_can_take_preempt_first_within_their_class():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={0: 1}))
    ctl.park(ticket("s-miss", "standard", 100.0, "y"))
    ctl.park(ticket("s-hit", "standard", 100.1, "x"))
    clock.now = 103.0  # both have waited half their 5 s target
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    grants = ctl.take_grants()
    assert list(grants) == ["s-hit"], "the later ticket whose adapter r1 holds preempts there, not the miss"
    assert grants["s-hit"].preempt, "it is a preempting grant"


def test_a_hit_of_a_less_urgent_class_never_preempts_before_a_due_miss_of_a_more_urgent_one():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={0: 1}))
    ctl.park(ticket("s-hit", "standard", 100.0, "x"))
    clock.now = 102.6
    ctl.park(ticket("i-miss", "interactive", 102.6, "y"))
    clock.now = 103.2  # s-hit waited 3.2 s of 5, i-miss 0.6 s of 1: both due
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    assert list(ctl.take_grants()) == ["i-miss"], "the interactive ticket preempts first, hit or not"


def test_a_miss_goes_where_an_adapter_slot_is_free_before_its_home():
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    home = max(("r1", "r2"), key=lambda rid: home_score("y", rid))
    other = "r2" if home == "r1" else "r1"
    view.update(report(home, capacity=4, running=1, free_slots=0))
    view.update(report(other, capacity=4, running=1, free_slots=1))
    assert choose_replica(ticket("t", "interactive", 100.0, "y"), view, {}) == other, (
        "the home's adapter slots are all busy: the miss would wait there for one")
    view.update(report(home, capacity=4, running=1, free_slots=1))
    assert choose_replica(ticket("t", "interactive", 100.0, "y"), view, {}) == home, (
        "with a free slot at both, the miss goes home")


def test_a_ticket_preempts_as_soon_as_a_replica_with_less_urgent_work_reports_its_adapter():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("y",)))
    ctl.park(ticket("s", "standard", 100.0, "x"))
    assert ctl.take_grants() == {}, "nobody holds x, and the ticket is not due before 2.5 s"
    clock.now = 100.5
    ctl.report(report("r1", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    grants = ctl.take_grants()
    assert "s" in grants and grants["s"].preempt, "r1 now holds x: the ticket preempts there, 2 s early"


def holder_runs_standard_work_other_runs_batch(cls: str) -> tuple[FakeClock, Controller]:
    """`holder` holds adapter x and runs standard work; `other` runs batch work; a ticket "t" of
    class `cls` for x is parked at 100.0 (preempt_after_fraction 0.5, holder_wait_fraction 0.8)."""
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5, holder_wait_fraction=0.8),
                     clock=clock)
    ctl.report(report("holder", capacity=1, running=1, by_priority={1: 1}, resident=("x",)))
    ctl.report(report("other", capacity=1, running=1, by_priority={2: 1}))
    ctl.park(ticket("t", cls, 100.0, "x"))
    return clock, ctl


def test_a_due_miss_waits_for_a_holder_of_its_adapter_then_preempts_where_it_can():
    clock, ctl = holder_runs_standard_work_other_runs_batch("standard")
    clock.now = 103.0  # due (2.5 s of its 5 s target), but only `other` runs batch work
    ctl.tick()
    assert ctl.take_grants() == {}, "holder runs standard work only: the ticket waits for it, not a miss"
    clock.now = 103.5
    ctl.report(report("holder", capacity=1, running=1, by_priority={2: 1}, resident=("x",)))
    grants = ctl.take_grants()
    assert grants.get("t") is not None and grants["t"].replica_id == "holder", (
        "once the holder runs batch work, the ticket preempts there: a hit")


def test_a_due_miss_stops_waiting_for_the_holder_at_its_share_of_the_target():
    clock, ctl = holder_runs_standard_work_other_runs_batch("standard")
    clock.now = 103.9
    ctl.tick()
    assert ctl.take_grants() == {}, "still within 80% of the 5 s target"
    clock.now = 104.0
    ctl.tick()
    grants = ctl.take_grants()
    assert grants.get("t") is not None and grants["t"].replica_id == "other", (
        "at 4 s it preempts where batch work runs, though its adapter must load there")
    nobody = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=clock)
    nobody.report(report("other", capacity=1, running=1, by_priority={2: 1}))
    nobody.park(ticket("y", "standard", clock.now, "y"))
    clock.now += 2.5
    nobody.tick()
    assert "y" in nobody.take_grants(), "no replica holds y: nothing to wait for, it preempts when due"


def test_a_due_miss_of_the_most_urgent_class_never_waits_for_a_holder():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5, holder_wait_fraction=0.8),
                     clock=clock)
    ctl.report(report("holder", capacity=1, running=1, by_priority={0: 1}, resident=("x",)))
    ctl.report(report("other", capacity=1, running=1, by_priority={2: 1}))
    ctl.park(ticket("i", "interactive", 100.0, "x"))
    clock.now = 100.5  # due: half of its 1 s target
    ctl.tick()
    grants = ctl.take_grants()
    assert grants.get("i") is not None and grants["i"].replica_id == "other", (
        "an interactive ticket preempts where it can as soon as it is due, though its adapter must load")


# ----- the most urgent class preempts at once; reports count what waiting requests will take -----

def full_replica(rid: str, by_priority: dict[int, int]) -> ReplicaReport:
    n = sum(by_priority.values())
    return ReplicaReport(rid, "n1", capacity=n, max_num_seqs=n, max_loras=4, running=n, waiting=0,
                         free_adapter_slots=0, running_by_priority=by_priority)


def test_the_top_class_preempts_as_soon_as_no_replica_has_room():
    clock = FakeClock(100.0)
    settings = ControllerSettings(preempt_after_fraction=0.5, top_class_preempt_after_fraction=0.0)
    ctl = Controller(CLASSES, settings, clock=clock)
    ctl.report(full_replica("r1", {2: 2}))
    grant = ctl.park(ticket("i", "interactive", 100.0, "nobody-holds-it"))
    assert grant is not None and grant.preempt and grant.replica_id == "r1", (
        "an interactive request whose adapter no replica holds preempts at once, not after 0.5 s")
    # another adapter: "nobody-holds-it" is held at r1 now, by the grant on its way (a hit by preemption)
    assert ctl.park(ticket("s", "standard", 100.0, "nobody-holds-this-one")) is None, (
        "a standard request still waits its fraction of its target")
    clock.now = 102.6
    ctl.tick()
    assert ctl.take_grants()["s"].preempt, "after 2.5 s of its 5 s target it preempts too"


def test_without_a_top_class_fraction_every_class_waits_its_fraction():
    ctl = Controller(CLASSES, ControllerSettings(preempt_after_fraction=0.5), clock=FakeClock(100.0))
    ctl.report(full_replica("r1", {2: 2}))
    assert ctl.park(ticket("i", "interactive", 100.0, "nobody-holds-it")) is None, (
        "with top_class_preempt_after_fraction unset, the interactive request waits half its target")


def test_the_served_configuration_lets_the_top_class_preempt_at_once():
    settings = ControllerSettings.from_config(ServeConfig(model="m").controller)
    assert settings.top_class_preempt_after_fraction == 0.0, "the default: the top class preempts at once"
    assert settings.preempt_after_fraction == 0.5, "the other classes keep preempt_after_fraction"


def test_the_reported_batch_counts_waiting_requests_that_will_preempt():
    batch = projected_batch({0: 1, 1: 2, 2: 1}, {0: 3, 1: 1, 2: 2}, slots=4)
    assert batch == {0: 4}, (
        "three urgent requests waiting on a full replica take the slots of its three less urgent ones")
    assert projected_batch({1: 2}, {2: 3}, slots=4) == {1: 2, 2: 2}, "waiting requests fill free slots"
    assert projected_batch({2: 4}, {}, slots=4) == {2: 4}, "nothing waits: the batch is what runs"


def test_urgent_requests_go_only_where_preemptible_work_is_left():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(top_class_preempt_after_fraction=0.0), clock=clock)
    # r1 received two urgent requests (reported arrived) that its engine has not admitted yet
    ctl.report(full_replica("r1", projected_batch({2: 2}, {0: 2}, slots=2)))
    ctl.report(full_replica("r2", {1: 2}))
    grant = ctl.park(ticket("i", "interactive", 100.0))
    assert grant is not None and grant.replica_id == "r2", (
        "r1's less urgent work is already taken by the urgent requests waiting there: preempt on r2")


# ----- the wait bound of classes without a TTFT target ----------------------------------------


def test_a_batch_ticket_is_refused_with_a_retry_after_while_its_class_already_waits_half_the_bound():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock, top_priority=0, wait_bound_s=60.0)
    q.park(ticket("old", "batch", 100.0))
    clock.now = 125.0
    q.class_granted(ticket("served", "batch", 110.0))  # the class drains: one grant in the window
    clock.now = 129.0
    q.park(ticket("queued", "batch", 129.0))
    assert "queued" in q, "the oldest batch ticket waited 29 s, under half the 60 s bound: queued"
    clock.now = 131.0
    with pytest.raises(WaitBoundError, match="cluster_queue_max_wait_s") as info:
        q.park(ticket("refused", "batch", 131.0))
    assert info.value.retry_after_s >= 1.0, "the refusal carries a retry-after"
    q.park(ticket("standard", "standard", 131.0))
    assert "standard" in q, "a class with a TTFT target is judged by its deadline, not by the bound"
    q.remove("old")
    q.park(ticket("after-drain", "batch", 131.0))
    assert "after-drain" in q, "once the oldest queued waited under half the bound, batch is queued again"


def test_a_batch_ticket_is_refused_when_its_class_backlog_would_drain_past_half_the_bound():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock, top_priority=0, wait_bound_s=60.0,
                     drain_window_s=10.0)
    clock.now = 90.0
    q.class_granted(ticket("served", "batch", 85.0))  # one batch grant in the 10 s window
    clock.now = 100.0
    for i in range(2):
        q.park(ticket(f"b{i}", "batch", 100.0))
    assert len(q) == 2, "a backlog of 2 at 0.1 grants/s (20 s) is under half the bound: queued"
    with pytest.raises(WaitBoundError, match="about 30 s"):
        q.park(ticket("third", "batch", 100.0))


def test_a_batch_ticket_that_waited_the_bound_is_granted_before_fresher_urgent_work():
    clock = FakeClock(100.0)
    settings = ControllerSettings(wait_bound_s=60.0, aging_s=1000.0, preempt_after_fraction=1.0,
                                  top_class_preempt_after_fraction=1.0)
    ctl = Controller(CLASSES, settings, clock=clock)
    ctl.report(report("r1", capacity=1, running=1, by_priority={1: 1}))
    ctl.park(ticket("b", "batch", 100.0))
    clock.now = 140.0
    ctl.park(ticket("s", "standard", 140.0))
    ctl.report(report("r1", capacity=1, running=0))
    assert list(ctl.take_grants()) == ["s"], "before 3/4 of the bound, a standard ticket goes first"
    ctl.report(report("r1", capacity=1, running=1, by_priority={1: 1}, arrived=("s",)))
    clock.now = 146.0
    fast = dataclasses.replace(report("r1", capacity=1, running=1, by_priority={1: 1}), service_time_s=0.1)
    ctl.report(fast)  # a replica that serves 10 requests/s: the urgent tickets' deadlines are in reach
    ctl.park(ticket("s2", "standard", 146.0))
    ctl.park(ticket("i", "interactive", 146.0))
    ctl.take_grants()  # the interactive ticket preempts the running standard request
    ctl.report(dataclasses.replace(report("r1", capacity=1, running=0), service_time_s=0.1))
    grants = ctl.take_grants()
    assert list(grants) == ["b"], f"the batch ticket that waited 46 s (> 3/4 of 60) goes first: {grants}"
    assert ctl.counts["overdue_grants"] == 1, "the grant is counted as overdue"


def test_without_a_bound_batch_waits_by_aging_alone():
    clock = FakeClock(100.0)
    q = ClusterQueue(max_size=100, aging_s=10.0, clock=clock, top_priority=0)
    q.park(ticket("old", "batch", 100.0))
    clock.now = 1000.0
    q.park(ticket("new", "batch", 1000.0))
    assert "new" in q and q.overdue() is None, "no bound: no refusal and nothing overdue"


def test_the_served_configuration_bounds_the_batch_wait_at_a_minute():
    settings = ControllerSettings.from_config(ServeConfig(model="m").controller)
    assert settings.wait_bound_s == 60.0, "cluster_queue_max_wait_s defaults to 60 s"
    off = ControllerSettings.from_config(ServeConfig(model="m", cluster_queue_max_wait_s=0).controller)
    assert off.wait_bound_s is None, "0 turns the bound off"


def test_a_top_class_miss_preempts_where_an_adapter_slot_is_free_and_other_classes_go_home():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(top_class_preempt_after_fraction=0.0), clock=clock)
    ids = ["r1", "r2", "r3"]
    home = max(ids, key=lambda rid: home_score("tail", rid))
    with_slot = next(rid for rid in ids if rid != home)
    for rid in ids:  # every replica full of batch work; only `with_slot` has an adapter slot it can give
        slots = 1 if rid == with_slot else 0
        ctl.report(dataclasses.replace(full_replica(rid, {2: 2}), free_adapter_slots=slots))
    standard = ticket("s", "standard", 100.0, "tail")
    assert preemption_target(standard, ctl.view) == home, "a less urgent class's miss goes home"
    grant = ctl.park(ticket("i", "interactive", 100.0, "tail"))
    assert grant is not None and grant.preempt, "the interactive miss preempts at once"
    assert grant.replica_id == with_slot, (
        f"it goes where an adapter slot is free ({with_slot}), not to its home {home} whose slots all "
        "serve running requests")
    assert preemption_target(standard, ctl.view) == with_slot, (
        "once its adapter is granted there, the standard ticket goes where it loads, not home to load it")


def test_urgent_tickets_beyond_the_preemptible_work_queue_and_run_before_the_less_urgent_ones():
    """A burst of urgent requests larger than the less urgent work running: the ones beyond it are
    queued, not refused for their deadline (that work is claimed by the urgent grants ahead of them,
    and is theirs to preempt once those end), and each goes before every less urgent ticket waiting."""
    clock = FakeClock(100.0)
    settings = ControllerSettings(top_class_preempt_after_fraction=0.0)
    ctl = Controller(CLASSES, settings, clock=clock)
    ctl.report(full_replica("r1", {2: 1}))  # one batch slot, running batch work
    ctl.queue.drain.record(1)  # a slow measured drain: any wait looks long
    assert ctl.park(ticket("b", "batch", 100.0)) is None, "no room: the batch ticket waits"
    first = ctl.park(ticket("i1", "interactive", 100.0))
    assert first is not None and first.preempt, "the first urgent ticket preempts the batch work at once"
    assert ctl.park(ticket("i2", "interactive", 100.0)) is None, (
        "the second is queued, not refused: the batch work it could preempt is claimed by the first")
    ctl.report(full_replica("r1", {0: 1}))  # i1 runs: nothing less urgent runs there now
    assert ctl.take_grants() == {}, "while only urgent work runs, neither waiting ticket is granted"
    ctl.report(dataclasses.replace(full_replica("r1", {2: 1}), arrived_tickets=("i1",)))  # i1 ended
    grants = ctl.take_grants()
    assert grants.get("i2") is not None and grants["i2"].preempt, (
        "once batch work runs again, the waiting urgent ticket preempts it")
    assert "b" not in grants, "the batch ticket that waited longer still waits behind it"

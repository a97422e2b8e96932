"""Replica reports that scale: deltas the controller applies to its view (equal to the full report on
random sequences of changes, through the actor's dict path), a full report when the controller lost
state, at most one finish-triggered report per coalescing window (fake clock, the live reporter and
the simulator), and reports and the view bounded in bytes per replica."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Any

import pytest

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.report_delta import (
    ReportDelta,
    ReportEncoder,
    apply_delta,
    diff,
    parse_report,
)
from lora_cluster.cluster.report_rules import ReportPacer, report_spacing_s
from lora_cluster.cluster.reports import (
    MAX_ARRIVED_TICKETS,
    MAX_ID_LEN,
    MAX_REPORTED_ADAPTERS,
    MAX_REPORTED_CLUSTER,
    MAX_REPORTED_HOST,
    MAX_REPORTED_LOADING,
    MAX_REPORTED_RESIDENT,
    REPORT_MAX_BYTES,
    MemorySplit,
    ReplicaReport,
    normalized,
)
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.serve.replica.reporter import ControllerReporter
from lora_cluster.sim import SimConfig, run
from lora_cluster.sim.context import ServeSections


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def a_report(**changes: Any) -> ReplicaReport:
    base = ReplicaReport("r1", "n1", capacity=4, max_num_seqs=4, max_loras=8, running=0, waiting=0,
                         free_adapter_slots=8)
    return dataclasses.replace(base, **changes)


def random_report(rng: random.Random, adapters: list[str], seq_tickets: list[int]) -> ReplicaReport:
    """A report as a replica might build it next: any field may have changed, or none."""
    resident = rng.sample(adapters, rng.randint(0, 8))
    loading = rng.sample([a for a in adapters if a not in resident], rng.randint(0, 2))
    tickets = []
    for _ in range(rng.randint(0, 3)):
        seq_tickets[0] += 1
        tickets.append(f"t{seq_tickets[0]}")
    return a_report(
        capacity=rng.choice([4, 5, 6]), running=rng.randint(0, 4), waiting=rng.randint(0, 3),
        free_adapter_slots=rng.randint(0, 8), resident=tuple(resident), loading=tuple(loading),
        running_by_priority=rng.choice([{}, {0: 1}, {2: rng.randint(1, 4)}, {0: 1, 2: 2}]),
        classes=rng.choice([{}, {"interactive": {"running": rng.randint(0, 2), "ttft_p50_s": rng.random()}}]),
        adapter_requests={a: rng.randint(1, 5) for a in rng.sample(adapters, rng.randint(0, 3))},
        memory=rng.choice([MemorySplit(), MemorySplit(kv_cache=rng.randint(1, 3) << 20)]),
        service_time_s=rng.choice([None, 0.5, round(rng.random(), 3)]), active=rng.randint(0, 6),
        arrived_tickets=tuple(tickets), sent_at=rng.random(), base=rng.choice([None, "base"]),
        prefixes=tuple(f"k{rng.randint(0, 20)}" for _ in range(rng.randint(0, 4))),
        host_held=tuple(rng.sample(adapters, rng.randint(0, 6))),
        cluster_held=tuple(rng.sample(adapters, rng.randint(0, 6))),
    )


def wire(sent: ReplicaReport | ReportDelta) -> ReplicaReport | ReportDelta:
    """Through the controller actor's dict path, as JSON."""
    return parse_report(json.loads(json.dumps(sent.to_dict())))


def test_deltas_applied_give_the_full_reports_view_on_random_sequences() -> None:
    adapters = [f"adapter-{k}" for k in range(12)]
    for trial in range(60):
        rng, tickets = random.Random(trial), [0]
        clock = FakeClock()
        controller = Controller(SlaClasses(), clock=clock)
        encoder = ReportEncoder(clock=clock, full_every_s=1e9)
        deltas = 0
        for step in range(40):
            clock.now += 0.2
            report = random_report(rng, adapters, tickets)
            sent = encoder.encode(report)
            deltas += isinstance(sent, ReportDelta)
            reply = controller.report(wire(sent))
            encoder.replied(reply)
            assert not reply.get("resync"), f"trial {trial} step {step}: the controller held the delta's base"
            held = controller.view.get("r1")
            assert held == dataclasses.replace(normalized(report), seq=held.seq), (
                f"trial {trial} step {step}: the view after the delta is the full report's")
        assert deltas == 39, f"trial {trial}: after the first full report every report is a delta"


def test_a_delta_carries_only_what_changed() -> None:
    old = normalized(a_report(resident=("a", "b", "c"), running=2, seq=1))
    new = normalized(a_report(resident=("b", "c", "d"), running=2, waiting=1, seq=2, arrived_tickets=("t9",)))
    delta = diff(old, new)
    assert dict(delta.changed) == {"waiting": 1}, "only the changed field is in the delta"
    assert (delta.resident_added, delta.resident_removed) == (("d",), ("a",)), "adapters loaded and evicted"
    assert delta.arrived_tickets == ("t9",), "the events since the last report ride along"
    assert apply_delta(old, delta) == new, "applied to its base, the delta gives the new report"
    assert len(json.dumps(delta.to_dict())) < len(json.dumps(new.to_dict())), "a delta is smaller"
    reused = diff(normalized(a_report(prefixes=("k1", "k2", "k3"), seq=1)),
                  normalized(a_report(prefixes=("k3", "k1", "k4"), seq=2)))
    assert (reused.prefixes_added, reused.prefixes_removed, dict(reused.changed)) == (("k4",), ("k2",), {}), (
        "prefix keys used again in another order are no change; only keys added and dropped travel")


def test_a_restarted_controller_asks_for_a_full_report_and_its_view_is_whole_again() -> None:
    clock = FakeClock()
    encoder = ReportEncoder(clock=clock)
    first = Controller(SlaClasses(), clock=clock)
    encoder.replied(first.report(wire(encoder.encode(a_report(resident=("x",), running=1)))))
    encoder.replied(first.report(wire(encoder.encode(a_report(resident=("x", "y"), running=2)))))
    restarted = Controller(SlaClasses(), clock=clock)
    latest = a_report(resident=("x", "y"), running=3)
    sent = encoder.encode(latest)
    assert isinstance(sent, ReportDelta), "the replica does not know the controller restarted"
    reply = restarted.report(wire(sent))
    assert reply.get("resync") is True, "a controller without the delta's base asks for a full report"
    assert restarted.view.get("r1") is None, "it does not guess the replica's state from a delta"
    encoder.replied(reply)
    assert encoder.needs_full, "the replica's next report is a full one"
    again = encoder.encode(latest)
    assert isinstance(again, ReplicaReport), "a full report goes out"
    assert not restarted.report(wire(again)).get("resync"), "which the restarted controller takes"
    held = restarted.view.get("r1")
    assert held is not None and (held.resident, held.running) == (("x", "y"), 3), "its view is whole again"


def test_a_lost_reply_makes_the_next_delta_a_resync_never_a_wrong_view() -> None:
    clock = FakeClock()
    encoder = ReportEncoder(clock=clock)
    ctl = Controller(SlaClasses(), clock=clock)
    encoder.replied(ctl.report(wire(encoder.encode(a_report(resident=("x",))))))
    ctl.report(wire(encoder.encode(a_report(resident=("x", "y")))))  # applied there, the reply lost
    reply = ctl.report(wire(encoder.encode(a_report(resident=("x",), running=1))))
    assert reply.get("resync") is True, "a delta from a base the controller moved past is refused"
    assert ctl.view.get("r1").resident == ("x", "y"), "the view keeps the last report it applied"
    encoder.replied(reply)
    ctl.report(wire(encoder.encode(a_report(resident=("x",), running=1))))
    assert ctl.view.get("r1").resident == ("x",), "the full report that follows is the truth"
    assert ctl.counts["resyncs"] == 1, "the controller counts the resync"


def test_a_delta_the_controller_cannot_apply_still_tells_the_arrived_tickets() -> None:
    clock = FakeClock()
    encoder = ReportEncoder(clock=clock)
    ctl = Controller(SlaClasses(), clock=clock)
    encoder.replied(ctl.report(wire(encoder.encode(a_report(capacity=2)))))
    ctl.view.granted("r1", "t1")
    assert ctl.view.free("r1") == 1, "a grant on its way takes a slot"
    ctl.report(wire(encoder.encode(a_report(capacity=2))))  # applied, the reply lost
    reply = ctl.report(wire(encoder.encode(a_report(capacity=2, arrived_tickets=("t1",)))))
    assert reply.get("resync") is True, "the delta's base is gone"
    assert ctl.view.free("r1") == 2, "the ticket it says arrived no longer counts as on its way"


def test_a_full_report_goes_out_every_full_every_s() -> None:
    clock = FakeClock()
    encoder = ReportEncoder(clock=clock, full_every_s=10.0)
    kinds = []
    for _ in range(25):
        sent = encoder.encode(a_report(running=int(clock.now) % 3))
        kinds.append(type(sent).__name__)
        encoder.replied({"queue_depth": 0})
        clock.now += 1.0
    assert [k for k, kind in enumerate(kinds) if kind == "ReplicaReport"] == [0, 10, 20], (
        "a full report at start and every 10 s, deltas between")


# ----- when: the coalescing window ----------------------------------------------------------------

def test_finishes_inside_the_window_share_one_report_at_its_end() -> None:
    clock = FakeClock(100.0)
    pacer = ReportPacer(period_s=0.5, coalesce_s=0.2, clock=clock)
    assert pacer.finish_at() == 100.0, "a replica that has not reported in a while reports a finish at once"
    pacer.sent()
    clock.now = 100.05
    assert pacer.finish_at() == 100.2, "a finish 50 ms after a report waits for the window's end"
    clock.now = 100.15
    assert pacer.finish_at() == 100.2, "a later finish in the same window shares that report"
    assert pacer.periodic_at() == 100.5, "without finishes the next report is a period later"
    clock.now = 100.2
    pacer.sent()
    clock.now = 100.5
    assert pacer.finish_at() == 100.5, "a finish after the window is reported at once"


def test_the_live_reporter_sends_one_report_for_a_burst_of_finishes() -> None:
    sent: list[dict[str, Any]] = []

    class Sink:
        def __init__(self) -> None:
            self.report = self

        def remote(self, report: dict[str, Any]) -> Any:
            sent.append(report)

            async def reply() -> dict[str, Any]:
                return {"queue_depth": 3, "prefetch": []}
            return reply()

    async def build() -> ReplicaReport:
        return a_report(running=len(sent))

    async def on_reply(reply: dict[str, Any]) -> None:
        return None

    async def scenario() -> int:
        reporter = ControllerReporter(Sink(), build, on_reply, period_s=60.0, coalesce_s=0.3)
        await reporter.report_once()  # its reply: tickets are queued
        reporter.start()
        await asyncio.sleep(0.02)
        before = len(sent)
        for _ in range(10):
            reporter.request_finished(ongoing_before=4, capacity=4)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)
        reporter.stop()
        return len(sent) - before

    assert asyncio.run(scenario()) == 1, "ten finishes within the window make one report"
    assert sent[0].get("delta") is None and sent[-1].get("delta") is True, "a full report first, then deltas"


def test_the_simulated_replicas_report_at_most_once_per_window_plus_their_period() -> None:
    serve = ServeSections().with_fields(controller_report_coalesce_s=0.25, controller_report_period_s=0.5)
    result = run(SimConfig(nodes=4, adapters=40, load=2.0, duration=20, warmup=5, seed=1, max_loras=4,
                           profile="gpu", serve=serve))
    figures = result.to_json()["control_plane"]
    assert figures["reports_per_s_per_replica"] <= 1 / 0.25 + 1 / 20, "at most one report per window"
    assert figures["reports_per_s_per_replica"] > 1 / 0.5, "finishes while tickets wait add reports"
    assert figures["controller_cpu_s_per_sim_s"] > 0, "the controller's CPU per simulated second is measured"
    assert result.details["controller_counts"]["resyncs"] == 0, "nothing lost between replica and controller"


# ----- bounded in bytes ---------------------------------------------------------------------------

def test_a_report_and_a_delta_stay_within_their_bound_in_bytes() -> None:
    def ids(prefix: str, n: int) -> list[str]:
        return [(prefix + str(k)).ljust(MAX_ID_LEN, "x") for k in range(n)]
    huge = a_report(resident=tuple(ids("r", 3 * MAX_REPORTED_RESIDENT)),
                    loading=tuple(ids("l", 3 * MAX_REPORTED_LOADING)),
                    adapter_requests={a: 1 for a in ids("d", 3 * MAX_REPORTED_ADAPTERS)},
                    arrived_tickets=tuple(ids("t", 3 * MAX_ARRIVED_TICKETS)),
                    classes={f"class{k}": {"running": k, "ttft_p50_s": 0.1} for k in range(100)},
                    prefixes=tuple(f"{k:016x}" for k in range(10_000)),
                    host_held=tuple(ids("h", 2 * MAX_REPORTED_HOST)),
                    cluster_held=tuple(ids("c", 2 * MAX_REPORTED_CLUSTER)))
    parsed = ReplicaReport.from_dict(json.loads(json.dumps(huge.to_dict())) | {"extra": "x" * 10})
    size = len(json.dumps(parsed.to_dict()))
    assert size <= REPORT_MAX_BYTES, f"a report at every bound is {size} bytes, over {REPORT_MAX_BYTES}"
    assert len(parsed.resident) == MAX_REPORTED_RESIDENT, "the resident list is capped"
    too_long = ReplicaReport.from_dict(a_report(resident=("a" * (MAX_ID_LEN + 1), "ok")).to_dict())
    assert too_long.resident == ("ok",), "an id longer than any adapter id is dropped"
    delta = diff(normalized(a_report(seq=1)), dataclasses.replace(normalized(huge), seq=2))
    wire_delta = json.loads(json.dumps(delta.to_dict()))
    wire_delta["resident_removed"] = ids("z", 3 * MAX_REPORTED_RESIDENT)  # what no replica sends
    size = len(json.dumps(ReportDelta.from_dict(wire_delta).to_dict()))
    assert size <= 2 * REPORT_MAX_BYTES, f"a delta (adds and removes) is {size} bytes, over twice the bound"


def test_the_controllers_view_of_a_replica_stays_bounded_over_many_deltas() -> None:
    clock = FakeClock()
    encoder = ReportEncoder(clock=clock)
    ctl = Controller(SlaClasses(), clock=clock)
    for k in range(3 * MAX_REPORTED_RESIDENT):  # one more adapter loaded with every report
        loaded = tuple(f"a{j:05d}" for j in range(k + 1))
        encoder.replied(ctl.report(wire(encoder.encode(a_report(resident=loaded)))))
        clock.now += 0.2
    held = ctl.view.get("r1")
    assert len(held.resident) == MAX_REPORTED_RESIDENT, "the view lists at most the capped resident adapters"
    assert len(json.dumps(held.to_dict())) <= REPORT_MAX_BYTES, "the view's report is within the bound"


def test_the_live_reporter_answers_a_resync_with_a_full_report_at_once() -> None:
    sent: list[dict[str, Any]] = []
    replies = iter([{"queue_depth": 0}, {"queue_depth": 0, "resync": True}, {"queue_depth": 0},
                    {"queue_depth": 0}])

    class RestartingController:
        def __init__(self) -> None:
            self.report = self

        def remote(self, report: dict[str, Any]) -> Any:
            sent.append(report)
            reply = next(replies)

            async def answer() -> dict[str, Any]:
                return reply
            return answer()

    async def build() -> ReplicaReport:
        return a_report(running=len(sent) % 2)

    async def on_reply(reply: dict[str, Any]) -> None:
        return None

    async def scenario() -> None:
        reporter = ControllerReporter(RestartingController(), build, on_reply, period_s=60.0, coalesce_s=0.05)
        await reporter.report_once()  # full, acknowledged
        await reporter.report_once()  # a delta the restarted controller cannot apply
        reporter.start()  # its period is 60 s: only the resync makes it report now
        await asyncio.sleep(0.5)
        reporter.stop()

    asyncio.run(scenario())
    kinds = ["delta" if r.get("delta") else "full" for r in sent]
    assert kinds == ["full", "delta", "full"], f"a resync is answered by one full report at once: {kinds}"


def test_what_a_report_derives_follows_the_deltas_that_change_a_few_fields_at_a_time() -> None:
    adapters = [f"adapter-{k}" for k in range(12)]
    for trial in range(40):
        rng, tickets = random.Random(1000 + trial), [0]
        clock = FakeClock()
        controller = Controller(SlaClasses(), clock=clock)
        encoder = ReportEncoder(clock=clock, full_every_s=1e9)
        report = random_report(rng, adapters, tickets)
        for step in range(40):
            clock.now += 0.2
            name = rng.choice(["resident", "loading", "running_by_priority", "prefixes", "running", None])
            if name is not None:
                other = random_report(rng, adapters, tickets)
                report = dataclasses.replace(report, **{name: getattr(other, name)})
            held = controller.view.get("r1")
            if held is not None:  # read before the delta, so that the view's report has them to keep
                assert held.held == frozenset((*held.resident, *held.loading)), f"trial {trial}: held"
            encoder.replied(controller.report(wire(encoder.encode(report))))
            held = controller.view.get("r1")
            fresh = ReplicaReport.from_dict(held.to_dict())
            assert held.held == fresh.held, f"trial {trial} step {step}: the adapters held after {name}"
            assert held.prefix_set == fresh.prefix_set, f"trial {trial} step {step}: prefix keys after {name}"
            assert [held.less_urgent_running(p) for p in range(4)] == [
                fresh.less_urgent_running(p) for p in range(4)], (
                f"trial {trial} step {step}: the less urgent running counts after {name}")


# ----- when: paced to the controller's report budget ----------------------------------------------

def test_a_large_cluster_stretches_the_window_and_the_period_to_the_budget() -> None:
    clock = FakeClock(100.0)
    pacer = ReportPacer(period_s=0.5, coalesce_s=0.2, clock=clock, budget_per_s=400.0)
    pacer.pace(32)
    assert (pacer.coalesce_s, pacer.period_s) == (0.2, 0.5), "32 replicas stay under budget: as configured"
    pacer.pace(256)
    assert pacer.coalesce_s == pytest.approx(0.64), "256 replicas x 1 / 0.64 s = 400 reports a second"
    assert pacer.period_s == pytest.approx(0.64), "the period is never shorter than the spacing either"
    pacer.sent()
    clock.now = 100.1
    assert pacer.finish_at() == pytest.approx(100.64), "a finish waits for the stretched window's end"
    pacer.pace(16)
    assert (pacer.coalesce_s, pacer.period_s) == (0.2, 0.5), "a cluster that shrinks goes back to the config"


def test_no_budget_paces_nothing() -> None:
    assert report_spacing_s(10_000, 0.0) == 0.0, "budget 0: no spacing"
    assert report_spacing_s(100, 50.0) == 2.0, "100 replicas within 50 a second: one each 2 s"


def test_the_live_reporter_paces_itself_by_the_replicas_its_controller_sees() -> None:
    class Controller256:
        def __init__(self) -> None:
            self.report = self

        def remote(self, report: dict[str, Any]) -> Any:
            async def reply() -> dict[str, Any]:
                return {"queue_depth": 0, "prefetch": [], "replicas": 256}
            return reply()

    async def build() -> ReplicaReport:
        return a_report(running=1)

    async def on_reply(reply: dict[str, Any]) -> None:
        return None

    reporter = ControllerReporter(Controller256(), build, on_reply, period_s=0.5, coalesce_s=0.2,
                                  budget_per_s=400.0)
    asyncio.run(reporter.report_once())
    assert reporter.pacer.coalesce_s == pytest.approx(0.64), "256 replicas at 400 a second: a 0.64 s window"
    assert reporter.pacer.period_s == pytest.approx(0.64), "and a period as long"

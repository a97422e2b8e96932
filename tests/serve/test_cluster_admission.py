"""The ingress's side of the cluster queue, with a fake controller: the fast path makes no controller
call, the slow path waits for a grant, refusals become errors, and a dead controller is retried
and then bypassed (no request is lost)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from helpers import CoalescedShard, FakeResponse

from lora_cluster.cluster.report_rules import AdapterDemand
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.errors import ClusterOverloadedError, ClusterQueueTimeoutError
from lora_cluster.serve.replica.reporter import ControllerReporter
from lora_cluster.serve.routing import admission as admission_module
from lora_cluster.serve.routing.admission import ClusterAdmission


class FakeController:
    """`admit.remote(...)` answers with the next scripted outcome (a reply dict or an exception) and
    advances the fake clock by `step_s` (the time the call took)."""

    def __init__(self, *outcomes: Any, clock: list[float] | None = None, step_s: float = 0.0):
        self.outcomes, self.clock, self.step_s = list(outcomes), clock, step_s
        self.calls: list[dict] = []
        self.admit = self

    def remote(self, ticket: dict, timeout_s: float) -> FakeResponse:
        self.calls.append(ticket)
        if self.clock is not None:
            self.clock[0] += self.step_s
        return FakeResponse(self.outcomes.pop(0))


def full_stats() -> dict[str, RoutingStats]:
    return {"r1": RoutingStats(num_running=2, num_waiting=0, max_num_seqs=2),
            "r2": RoutingStats(num_running=1, num_waiting=1, max_num_seqs=2)}


def admission(controller: Any, stats: Any = full_stats, clock: list[float] | None = None) -> ClusterAdmission:
    clock = clock if clock is not None else [0.0]
    return ClusterAdmission(CoalescedShard(controller), capacity=None, replica_stats=stats, timeout_s=30.0,
                            clock=lambda: clock[0])


def one_replica(running: int) -> dict[str, RoutingStats]:
    return {"r1": RoutingStats(num_running=running, num_waiting=0, max_num_seqs=2)}


async def test_the_fast_path_makes_no_controller_call():
    controller = FakeController()
    a = admission(controller, stats=lambda: one_replica(1))
    assert await a.admit(sla_class="standard", adapter_id="x", arrived_at=0.0) is None, "sent the direct way"
    assert controller.calls == [], "a replica with room means no controller call"


async def test_own_requests_in_flight_count_before_the_next_report():
    a = admission(FakeController(), stats=lambda: one_replica(0))
    assert await a.admit(sla_class="standard", adapter_id=None, arrived_at=0.0) is None, "fast path"
    assert await a.admit(sla_class="standard", adapter_id=None, arrived_at=0.0) is None, "fast path"
    assert not a.has_room(), "two requests on their way fill the two slots before any replica reports them"
    a.started("r1", granted=False)
    a.not_started()
    assert a.has_room(), "a request that failed before reaching a replica gives its slot back"
    a.started("r1", granted=False)
    assert not a.has_room(), "two requests run on the replica"
    a.finished("r1")
    assert a.has_room(), "a finished request frees its slot at once"


async def test_a_full_cluster_waits_for_a_grant_and_pins_the_request():
    controller = FakeController({"replica_id": "r2", "preempt": False})
    a = admission(controller)
    granted = await a.admit(sla_class="interactive", adapter_id="x", arrived_at=0.0)
    assert granted.replica_id == "r2", "the request goes to the replica the controller granted"
    assert granted.ticket_id == controller.calls[0]["ticket_id"], "with the ticket it was granted for"
    assert controller.calls[0]["sla_class"] == "interactive", "the ticket carries the class"
    assert controller.calls[0]["adapter_id"] == "x", "and the adapter, for affinity"


class GatedController:
    """`admit.remote(...)` answers only once the test opens the gate: a ticket that stays parked."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[dict] = []
        self.admit = self

    def remote(self, ticket: dict, timeout_s: float) -> Any:
        self.calls.append(ticket)

        async def reply() -> dict:
            await self.gate.wait()
            return {"replica_id": "r1", "preempt": False}
        return reply()


async def test_a_new_request_never_overtakes_a_parked_one():
    controller, running = GatedController(), [2]
    a = admission(controller, stats=lambda: one_replica(running[0]))
    parked = asyncio.create_task(a.admit(sla_class="interactive", adapter_id="x", arrived_at=0.0))
    await asyncio.sleep(0.02)  # its park call is sent (and answered: it waits)
    assert len(controller.calls) == 1, "the full cluster parks the first request"
    running[0] = 1  # a slot frees before the controller's grant reaches the parked request
    assert not a.has_room(), "the freed slot is not offered to newcomers while a request is parked"
    later = asyncio.create_task(a.admit(sla_class="batch", adapter_id="y", arrived_at=0.0))
    await asyncio.sleep(0.02)  # its park call is sent (and answered: it waits)
    assert len(controller.calls) == 2, "the newcomer parks behind it instead of taking the fast path"
    controller.gate.set()
    assert (await parked).replica_id == "r1", "the parked request gets its grant"
    assert (await later).replica_id == "r1", "and so does the newcomer"
    assert a.has_room(), "with nothing parked the fast path opens again"


async def test_refusals_become_429_and_timeouts_503():
    a = admission(FakeController({"overloaded": "the cluster queue is full", "retry_after_s": 3.0}))
    with pytest.raises(ClusterOverloadedError, match="full") as info:
        await a.admit(sla_class="batch", adapter_id=None, arrived_at=0.0)
    assert info.value.retry_after_s == 3.0, "the retry-after estimate travels"
    gated, releases = GatedController(), Releases()
    gated.cancel_ticket = releases
    slow = ClusterAdmission(CoalescedShard(gated), capacity=None, replica_stats=full_stats, timeout_s=0.1)
    with pytest.raises(ClusterQueueTimeoutError, match="cluster_queue_timeout_s"):
        await slow.admit(sla_class="batch", adapter_id=None, arrived_at=time.monotonic())
    assert releases.calls == [(gated.calls[0]["ticket_id"], None)], (
        "the ticket of a request that timed out is dropped at the controller")


async def test_a_dead_controller_is_asked_again_then_bypassed(monkeypatch):
    monkeypatch.setattr(admission_module, "RETRY_PAUSE_S", 0.0)
    revived = FakeController(RuntimeError("actor died"), {"replica_id": "r1", "preempt": True})
    granted = await admission(revived).admit(sla_class="interactive", adapter_id=None, arrived_at=0.0)
    assert granted.replica_id == "r1", (
        "a request parked at a controller that died is parked again at its successor")
    clock = [0.0]
    dead = FakeController(*[RuntimeError("actor died")] * 100, clock=clock, step_s=1.0)
    a = admission(dead, clock=clock)
    assert await a.admit(sla_class="standard", adapter_id=None, arrived_at=0.0) is None, (
        "with no controller reachable the request goes the direct way instead of being lost")
    calls = len(dead.calls)
    assert await a.admit(sla_class="standard", adapter_id=None, arrived_at=clock[0]) is None, "still direct"
    assert len(dead.calls) == calls, "during the backoff the ingress does not ask the dead controller"


def test_adapter_demand_is_bounded_and_reset_by_each_report():
    demand = AdapterDemand(max_adapters=3)
    for aid in ["a", "a", "b", "c", "d", None]:
        demand.record(aid)
    assert demand.take() == {"a": 2, "b": 1, "c": 1}, "beyond the bound new ids are not counted"
    assert demand.take() == {}, "each report takes the counts since the previous one"


def test_adapter_demand_forgets_a_request_it_should_not_have_counted():
    demand = AdapterDemand(max_adapters=2)
    for aid in ["a", "a", "missing"]:
        demand.record(aid)
    demand.forget("a")
    demand.forget("missing")
    demand.forget("never-counted")
    demand.forget(None)
    demand.record("b")
    assert demand.take() == {"a": 1, "b": 1}, "a forgotten id gives back its place under the bound"


A_REPORT = ReplicaReport("r1", "n1", capacity=4, max_num_seqs=4, max_loras=2, running=0, waiting=0,
                         free_adapter_slots=2)


class ReportSink:
    """The controller's `report` method: records when each report came; replies `queue_depth`."""

    def __init__(self, queue_depth: int):
        self.queue_depth, self.at = queue_depth, []
        self.report = self

    def remote(self, report: dict[str, Any]) -> Any:
        self.at.append(asyncio.get_running_loop().time())

        async def reply() -> dict[str, Any]:
            return {"queue_depth": self.queue_depth, "prefetch": []}
        return reply()


async def _reports_after_finish(queue_depth: int, ongoing_before: int, capacity: int) -> int:
    """Reports a replica sent within 0.5 s of a request's end, its period being 60 s."""
    sink = ReportSink(queue_depth)

    async def build() -> ReplicaReport:
        return A_REPORT

    async def on_reply(reply: dict[str, Any]) -> None:
        return None

    reporter = ControllerReporter(sink, build, on_reply, period_s=60.0)
    await reporter.report_once()  # its reply sets the queue depth the replica knows
    reporter.start()
    await asyncio.sleep(0.05)
    before = len(sink.at)
    reporter.request_finished(ongoing_before, capacity)
    await asyncio.sleep(0.5)
    reporter.stop()
    return len(sink.at) - before


async def test_a_full_replica_reports_each_freed_slot_at_once_though_no_ticket_was_queued():
    """Regression: a ticket parked after the replica's last report waited up to a report period for
    a slot that had freed; with the claims fix of `ClusterView` this brought a parked request's
    first token from 912 ms to 329 ms after the slot freed (bench_sla.md, seventh run)."""
    assert await _reports_after_finish(queue_depth=0, ongoing_before=4, capacity=4) == 1, (
        "a replica that was full reports the slot it freed without waiting for its period")
    assert await _reports_after_finish(queue_depth=3, ongoing_before=1, capacity=4) == 1, (
        "tickets queued at the last report: the freed slot is reported at once")
    assert await _reports_after_finish(queue_depth=0, ongoing_before=3, capacity=4) == 0, (
        "a replica with room and no queued ticket reports on its period only")


async def test_a_direct_request_counts_as_on_its_way_only_until_the_reports_can_show_it():
    clock = [0.0]
    a = ClusterAdmission(FakeController(), capacity=None, replica_stats=lambda: one_replica(1),
                         timeout_s=30.0, report_lag_s=1.0, clock=lambda: clock[0])
    assert await a.admit(sla_class="standard", adapter_id=None, arrived_at=0.0) is None, "fast path"
    assert not a.has_room(), "the request on its way takes the last free slot"
    clock[0] = 2.0
    assert a.has_room(), "after the report lag the replica's report counts it, not the ingress again"


async def test_a_report_that_cannot_be_built_is_logged_as_an_error_and_the_next_one_is_sent(caplog):
    sink = ReportSink(0)
    builds = iter([TypeError("build_report() got an unexpected keyword argument 'x'"), A_REPORT])

    async def build() -> ReplicaReport:
        outcome = next(builds)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def on_reply(reply: dict[str, Any]) -> None:
        return None

    reporter = ControllerReporter(sink, build, on_reply, period_s=60.0)
    with caplog.at_level("ERROR", logger="lora_cluster.serve.replica.reporter"):
        await reporter.report_once()
    assert "could not be built" in caplog.text, "a replica that cannot build its report says so loudly"
    assert sink.at == [], "nothing was sent for it"
    await reporter.report_once()
    assert len(sink.at) == 1, "the next report is built and sent"


class Releases:
    """`cancel_ticket.remote(ticket_id, replica_id=None)`: the releases an ingress sends, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.cancel_ticket = self

    def remote(self, *args: Any) -> None:
        self.calls.append(args)


class CancellableGate(GatedController):
    """A `GatedController` whose calls can be cancelled, as a Serve response can."""

    def remote(self, ticket: dict, timeout_s: float) -> Any:
        return asyncio.ensure_future(super().remote(ticket, timeout_s))


async def test_a_request_that_goes_away_while_parked_releases_any_grant_decided_meanwhile():
    controller, releases = CancellableGate(), Releases()
    controller.cancel_ticket = releases
    a = admission(controller)
    parked = asyncio.create_task(a.admit(sla_class="standard", adapter_id="x", arrived_at=0.0))
    await asyncio.sleep(0)
    parked.cancel()  # the client went away; the controller may have granted it meanwhile
    await asyncio.gather(parked, return_exceptions=True)
    assert releases.calls == [(controller.calls[0]["ticket_id"], None)], (
        "the controller is told to drop the ticket and the room a grant decided for it took")


async def test_a_granted_request_that_never_started_gives_its_grant_back():
    controller, releases = FakeController({"replica_id": "r2", "preempt": False}), Releases()
    controller.cancel_ticket = releases
    a = admission(controller)
    granted = await a.admit(sla_class="interactive", adapter_id="x", arrived_at=0.0)
    a.not_started(granted)  # sending it to r2 failed before r2 answered
    assert releases.calls == [(granted.ticket_id, "r2")], "the grant's room at r2 is released at once"

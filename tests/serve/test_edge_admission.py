"""Refusals at the edge in the ingress's admission (`serve.routing.admission`), with a fake controller that
answers with a real controller's state: a request the published state refuses is refused without a
controller call, with the controller's error, and counted by the ingress (not by the controller)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import CoalescedShard, FakeClock, FakeResponse
from tickets import CLASSES, ticket

from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.errors import ClusterOverloadedError, QueueFullError
from lora_cluster.serve.ops import metrics
from lora_cluster.serve.routing.admission import ClusterAdmission


class ScriptedController:
    """`admit.remote(...)` answers with the next scripted reply, and records the call."""

    def __init__(self, *replies: dict[str, Any]):
        self.replies, self.calls = list(replies), []
        self.admit = self

    def remote(self, request: dict, timeout_s: float) -> FakeResponse:
        self.calls.append(request)
        return FakeResponse(self.replies.pop(0))


def full_queue_reply() -> dict[str, Any]:
    """A real controller's refusal by its full queue (one slot, one queued ticket), as its actor replies."""
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(queue_size=1), clock=clock)
    ctl.report(ReplicaReport("r1", "n1", capacity=1, max_num_seqs=1, max_loras=4, running=1, waiting=0,
                             free_adapter_slots=0, resident=("held",), running_by_priority={1: 1}))
    ctl.park(ticket("s0", "standard", 100.0, "held"))
    with pytest.raises(QueueFullError) as info:
        ctl.park(ticket("s1", "standard", 100.0, "held"))
    return {"overloaded": str(info.value), "retry_after_s": info.value.retry_after_s,
            "error": type(info.value).__name__, "edge": ctl.edge_state(held=True).to_wire()}


def edge_count(reason: str, sla_class: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "lora_cluster_edge_refusals_total", {"reason": reason, "priority_class": sla_class}) or 0.0


async def test_a_request_the_published_state_refuses_is_refused_at_the_edge_as_the_controller_refused():
    reply = full_queue_reply()
    controller = ScriptedController(reply)
    a = ClusterAdmission(CoalescedShard(controller), capacity=None, timeout_s=30.0, clock=FakeClock(7.0),
                         replica_stats=lambda: {"r1": RoutingStats(num_running=1, max_num_seqs=1)})
    with pytest.raises(QueueFullError) as by_controller:
        await a.admit(sla_class="standard", adapter_id="held", arrived_at=7.0)
    counted = edge_count("queue_full", "standard")
    with pytest.raises(ClusterOverloadedError) as at_edge:
        await a.admit(sla_class="standard", adapter_id="held", arrived_at=7.0)
    assert len(controller.calls) == 1, "the second request never reached the controller"
    assert type(at_edge.value) is QueueFullError, f"the controller's error class: {at_edge.value!r}"
    assert str(at_edge.value) == str(by_controller.value), "the controller's message"
    assert at_edge.value.retry_after_s == by_controller.value.retry_after_s, "the controller's retry-after"
    assert a.counts["edge_refused"] == 1, f"the ingress counts it: {dict(a.counts)}"
    assert a.counts["refused"] == 1, f"the controller's refusals are counted apart: {dict(a.counts)}"
    assert edge_count("queue_full", "standard") == counted + 1, "the metric counts it by reason and class"

"""The controller deployment's own logic, without Ray: a parked request that goes away (cancelled or
timed out) leaves no ticket behind, one bumped out of a full queue is refused, and the room a
report frees is granted through the batch window (`serve.batch_window`).

Regression: `admit` dropped its ticket only when its waiter was not done, but `asyncio.wait_for`
cancels the waiter on a timeout or a cancellation, so stale tickets held the queue and counted
replicas' slots as granted to nobody.
"""

from __future__ import annotations

import asyncio

from lora_cluster.cluster.edge import EdgeState
from lora_cluster.config import ServeConfig
from lora_cluster.serve.controller_actor import ClusterController


def controller() -> ClusterController:
    return ClusterController.func_or_class(ServeConfig().model_dump())


def request(ticket_id: str) -> dict:
    return {"ticket_id": ticket_id, "ingress_id": "i1", "sla_class": "batch", "adapter_id": "a1",
            "waited_s": 0.0}


async def _until_queued(actor: ClusterController) -> None:
    """Wait (at most a second) until a ticket waits in the actor's cluster queue."""
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(actor.core.queue):
            return


async def test_a_cancelled_admit_call_drops_its_ticket():
    actor = controller()
    call = asyncio.create_task(actor.admit(request("t1"), 30.0))
    await _until_queued(actor)
    assert len(actor.core.queue) == 1, "the request waits in the cluster queue (no replica has room)"
    call.cancel()  # what Serve does to the coroutine when the ingress cancels its call
    await asyncio.gather(call, return_exceptions=True)
    assert len(actor.core.queue) == 0, "the ticket of a request that went away leaves the queue"
    assert actor.core.counts["cancelled"] == 1, "and is counted as cancelled"


async def test_a_timed_out_admit_call_drops_its_ticket():
    actor = controller()
    reply = await actor.admit(request("t2"), 0.05)
    assert reply == {"timeout": True}, "the call answers that it timed out"
    assert len(actor.core.queue) == 0, "and leaves no ticket behind"


async def test_a_request_bumped_out_of_the_full_queue_is_refused_with_a_retry_after():
    actor = ClusterController.func_or_class(ServeConfig(cluster_queue_size=1).model_dump())
    batch = asyncio.create_task(actor.admit(request("t-batch"), 30.0))
    await _until_queued(actor)
    urgent = asyncio.create_task(actor.admit({**request("t-urgent"), "sla_class": "interactive"}, 0.5))
    reply = await asyncio.wait_for(batch, 5.0)
    assert "overloaded" in reply and reply["retry_after_s"] >= 1.0, (
        "the waiting batch request is refused at once, with a retry-after, when an urgent one needs it")
    assert "t-urgent" in actor.core.queue, "the urgent request holds the place"
    await asyncio.gather(urgent, return_exceptions=True)


async def test_a_report_that_frees_room_grants_a_parked_request_through_the_batch_window():
    from tickets import report

    actor = controller()
    await actor.report(report("r1", capacity=2, running=2, by_priority={2: 2}).to_dict())
    call = asyncio.create_task(actor.admit(request("t3"), 30.0))
    await _until_queued(actor)
    assert len(actor.core.queue) == 1, "no replica has room: the request waits"
    freed = await actor.report(report("r1", capacity=2, running=1, by_priority={2: 1}).to_dict())
    assert freed["queue_depth"] == 0, "the report's reply counts the queue after its room was granted"
    reply = await asyncio.wait_for(call, 5.0)
    assert (reply["replica_id"], reply["preempt"]) == ("r1", False), (
        "the room the report frees is granted to it")
    assert EdgeState.from_wire(reply["edge"]).held is None, (
        "the grant carries the admission state for the edge, without the held adapters")


async def test_a_refusal_names_its_class_and_carries_the_state_that_refuses_the_next_at_the_edge():
    from tickets import report

    actor = ClusterController.func_or_class(ServeConfig(cluster_queue_size=1).model_dump())
    await actor.report(report("r1", capacity=1, running=1, resident=("a1",), by_priority={1: 1}).to_dict())
    first = asyncio.create_task(actor.admit(request("t1"), 30.0))
    await _until_queued(actor)
    reply = await actor.admit(request("t2"), 30.0)
    assert reply["error"] == "QueueFullError", f"the refusal names its class: {reply}"
    state = EdgeState.from_wire(reply["edge"])
    assert state.full, "the state it carries says the queue is full"
    view = await actor.ingress_view("i1")
    assert EdgeState.from_wire(view["edge"]).held == frozenset({"a1"}), (
        "ingress_view's state carries the adapters the replicas hold")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_a_grant_whose_caller_went_away_frees_its_room_at_once():
    from tickets import report

    actor = controller()
    await actor.report(report("r1", capacity=2, running=1, by_priority={2: 1}).to_dict())
    call = asyncio.create_task(actor.admit(request("t4"), 30.0))
    await asyncio.sleep(0)  # the park is in the batch window
    await asyncio.sleep(0)  # the window is sent: the free slot is granted to it
    assert actor.core.view.free("r1") == 0, "the grant reserves r1's free slot"
    call.cancel()  # the caller goes away before the grant reaches it
    await asyncio.gather(call, return_exceptions=True)
    assert actor.core.view.free("r1") == 1, "the grant nobody will use gives its slot back at once"


async def test_an_ingress_that_will_not_use_a_grant_gives_its_room_back():
    from tickets import report

    actor = controller()
    await actor.report(report("r1", capacity=2, running=1, by_priority={2: 1}).to_dict())
    reply = await asyncio.wait_for(actor.admit(request("t5"), 30.0), 5.0)
    assert reply["replica_id"] == "r1", "the free slot is granted"
    assert actor.core.view.free("r1") == 0, "and reserved until r1 reports the request"
    await actor.cancel_ticket("t5", "r1")  # sending the request to r1 failed
    assert actor.core.view.free("r1") == 1, "the ingress's release frees it at once"

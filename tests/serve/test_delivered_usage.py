"""A request whose client went away is one usage record with the tokens the client received
(`serve.routing.dispatch`, `serve.ops.usage_refusals.RefusalMeter.delivered`): the ingress's real
`Dispatcher` and `EventStream` over fake replica calls at the Serve boundary. The caller's task is
cancelled as Serve cancels it when the HTTP client disconnects; the e2e chaos test does it for real
(tests/serve/test_usage_chaos_e2e.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import TaskCancelledError

from lora_cluster.engine import SamplingParams
from lora_cluster.serve.http.sse import EventStream, event
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord


def item(tokens: int, finished: bool = False) -> dict[str, Any]:
    return {"replica": "r-1", "hit": True, "completion_tokens": tokens, "prompt_tokens": 7,
            "cached_tokens": 2, "device_s": 0.01 * tokens, "finished": finished, "delta_text": "x"}


class Call:
    """A replica call: yields `items`, then waits (the replica is still generating) until cancelled;
    awaited (a unary call), it never answers."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items, self.cancelled = list(items), False

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.items:
            return self.items.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def __await__(self) -> Any:
        return asyncio.Event().wait().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A deployment handle: `generate` (streams) and `complete` (unary) calls are `Call`s of `items`,
    except that the jobs named in `hang` never send a first item."""

    deployment_name = "LoraReplica"

    def __init__(self, items: list[dict[str, Any]], hang: tuple[str, ...] = ()):
        self.calls: list[Call] = []
        self._items, self._hang = items, hang
        self.generate = self.complete = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, job: GenerateJob) -> Call:
        self.calls.append(Call([] if job.request_id in self._hang else self._items))
        return self.calls[-1]


def job(request_id: str = "cmpl-1-0", stream: bool = True) -> GenerateJob:
    return GenerateJob(request_id=request_id, prompt=[1, 2, 3], adapter_id="a1@2", stream=stream,
                       sampling=SamplingParams(max_new_tokens=8), tenant="acme", priority_class="standard")


class Ingress:
    """The dispatcher wired to a meter as the ingress wires them; `records()` flushes and reads."""

    def __init__(self, handle: Handle):
        self.sent: list[UsageRecord] = []

        async def send(batch: Any) -> None:
            self.sent.extend(batch.records)

        self.meter = RefusalMeter(UsageShipper(send, background=False), "demo", "ingress-1")
        self.dispatcher = Dispatcher(handle, "app", lost=self.meter.lost, delivered=self.meter.delivered)

    async def records(self) -> list[UsageRecord]:
        await self.meter.shipper.flush()
        return self.sent


async def until(check: Any, tries: int = 200) -> None:
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never held")


async def test_a_unary_request_given_up_before_its_answer_is_one_delivered_record_of_nothing():
    handle = Handle([])
    ingress = Ingress(handle)
    start = asyncio.ensure_future(ingress.dispatcher.start(job(stream=False), "/v1/completions"))
    await until(lambda: handle.calls)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    records = await ingress.records()
    assert handle.calls[0].cancelled, "precondition: the replica call was cancelled"
    assert len(records) == 1, f"one record for the request: {records}"
    record = records[0]
    assert record.request_id == "cmpl-1-0", f"under the job's own id, as the replica records it: {record}"
    assert (record.outcome, record.output_tokens, record.delivered) == (Outcome.CANCELLED, 0, True), \
        f"a delivered part of nothing, cancelled: {record}"
    assert (record.device_s, record.queue_s) == (0.0, 0.0), f"it carries no cost of its own: {record}"
    assert (record.tenant, record.adapter, record.version) == ("acme", "a1", 2), f"its names: {record}"


async def run_stream(generation: Generation, sent: list[bytes]) -> asyncio.Task[None]:
    """The stream's `EventStream` as the routes build it, served to a client that reads body chunks
    (events, several in one when they queue up) into `sent`; returns the response's task (cancel it:
    the client disconnected)."""

    async def events() -> AsyncIterator[bytes]:
        async for out in generation.items():
            yield event(out)

    response = EventStream(events(), {}, on_close=generation.cancel)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        if message.get("body"):
            sent.append(message["body"])

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST"}
    return asyncio.ensure_future(response(scope, receive, send))


async def test_a_stream_its_client_closes_is_one_delivered_record_of_the_tokens_sent():
    handle = Handle([item(1), item(3)])
    ingress = Ingress(handle)
    generation = await ingress.dispatcher.start(job(), "/v1/completions")
    sent: list[bytes] = []
    task = await run_stream(generation, sent)
    await until(lambda: b"".join(sent).count(b"data: ") == 2)
    task.cancel()  # the client disconnected
    with pytest.raises(asyncio.CancelledError):
        await task
    records = await ingress.records()
    assert handle.calls[0].cancelled, "precondition: the replica call was cancelled"
    assert len(records) == 1, f"one part for the request: {records}"
    record = records[0]
    assert (record.outcome, record.output_tokens, record.delivered) == (Outcome.CANCELLED, 3, True), \
        f"the tokens of the last item handed on, cancelled: {record}"
    assert (record.replica, record.prompt_tokens) == ("r-1", 7), f"its replica and prompt: {record}"


async def test_a_stream_read_to_its_end_adds_no_delivered_part():
    handle = Handle([item(1), item(3, finished=True)])
    ingress = Ingress(handle)
    generation = await ingress.dispatcher.start(job(), "/v1/completions")
    sent: list[bytes] = []
    await (await run_stream(generation, sent))
    assert b"".join(sent).count(b"data: ") == 2, "precondition: the client got the whole stream"
    assert await ingress.records() == [], "the replica's own record is the request's: no ingress part"


async def test_a_fan_out_cancelled_while_starting_is_one_delivered_record_per_choice():
    handle = Handle([item(2)], hang=("cmpl-2-1",))
    ingress = Ingress(handle)
    jobs = [job("cmpl-2-0"), job("cmpl-2-1")]
    start = asyncio.ensure_future(ingress.dispatcher.start_all(jobs, "/v1/completions"))
    await until(lambda: len(handle.calls) == 2)
    await asyncio.sleep(0.02)  # choice 0 has its first item; choice 1 is still starting
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    records = sorted(await ingress.records(), key=lambda r: r.request_id)
    assert all(call.cancelled for call in handle.calls), "precondition: both replica calls were cancelled"
    assert [(r.request_id, r.output_tokens, r.delivered) for r in records] == \
        [("cmpl-2-0", 0, True), ("cmpl-2-1", 0, True)], \
        f"each choice (`<request id>-<index>`) has one delivered part of nothing: {records}"


async def test_a_request_cancelled_before_its_choices_ran_is_one_delivered_record_per_choice():
    handle = Handle([item(2)])
    ingress = Ingress(handle)
    jobs = [job("cmpl-3-0"), job("cmpl-3-1")]
    start = asyncio.ensure_future(ingress.dispatcher.start_all(jobs, "/v1/completions"))
    await asyncio.sleep(0)  # start_all made its choices' tasks and waits on them; none of them ran yet
    start.cancel()  # the client went away: the choices are cancelled before their first step
    with pytest.raises(asyncio.CancelledError):
        await start
    records = sorted(await ingress.records(), key=lambda r: r.request_id)
    assert handle.calls == [], "precondition: no choice reached a replica"
    assert [(r.request_id, r.outcome, r.output_tokens, r.delivered) for r in records] == \
        [("cmpl-3-0", Outcome.CANCELLED, 0, True), ("cmpl-3-1", Outcome.CANCELLED, 0, True)], \
        f"each accepted choice has its one record, a delivered part of nothing: {records}"


async def test_the_ingress_wires_both_ingress_parts_with_the_groups_base_model():
    ingress = Ingress(Handle([]))
    parts = ingress.meter.parts("base-b")
    parts["delivered"](request_id="cmpl-3-0", tenant="acme", adapter_id=None, sla_class="standard",
                       queued_s=0.5, replica="", item=None)
    [record] = await ingress.records()
    assert sorted(parts) == ["delivered", "lost"], "a Dispatcher's two usage keywords"
    assert (record.base_model, record.delivered) == ("base-b", True), f"its group's base model: {record}"


class CancelledCall(Call):
    """A replica call that Serve cancels under the request (its client disconnected) once `items` are
    out: it raises Ray's `TaskCancelledError`, before the ingress's own task sees a cancellation."""

    async def __anext__(self) -> dict[str, Any]:
        if self.items:
            return self.items.pop(0)
        raise TaskCancelledError()

    def __await__(self) -> Any:
        return self.__anext__().__await__()


class CancellingHandle(Handle):
    def remote(self, job: GenerateJob) -> Call:
        self.calls.append(CancelledCall(self._items))
        return self.calls[-1]


async def test_a_stream_whose_call_serve_cancels_is_one_delivered_record_of_the_tokens_sent():
    ingress = Ingress(CancellingHandle([item(1), item(4)]))
    generation = await ingress.dispatcher.start(job(), "/v1/completions")
    received = []
    with pytest.raises(ApiException):
        async for out in generation.items():
            received.append(out["completion_tokens"])
    records = await ingress.records()
    assert received == [1, 4], "precondition: two items were handed on, then Serve cancelled the call"
    assert [(r.output_tokens, r.outcome, r.delivered) for r in records] == [(4, Outcome.CANCELLED, True)], \
        f"one delivered part of the tokens handed on: {records}"


async def test_a_unary_call_serve_cancels_before_its_answer_is_one_delivered_record_of_nothing():
    ingress = Ingress(CancellingHandle([]))
    with pytest.raises(ApiException):
        await ingress.dispatcher.start(job(stream=False), "/v1/completions")
    records = await ingress.records()
    assert [(r.output_tokens, r.outcome, r.delivered) for r in records] == [(0, Outcome.CANCELLED, True)], \
        f"one delivered part of nothing: {records}"

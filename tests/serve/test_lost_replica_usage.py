"""A request whose replica is lost is one usage record with the tokens the client received
(`serve.routing.dispatch`, `serve.ops.usage_refusals.RefusalMeter.lost`): the ingress's real
`Dispatcher` over a replica handle whose stream fails with Ray's own `ActorDiedError` mid-stream or
before its first item (a replica process cannot be killed without Ray; the e2e chaos test kills a
real one, tests/serve/test_usage_chaos_e2e.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from lora_cluster.engine import SamplingParams
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing import dispatch
from lora_cluster.serve.routing.dispatch import Dispatcher
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch


def item(tokens: int, finished: bool = False) -> dict[str, Any]:
    return {"replica": "r-dead", "hit": True, "completion_tokens": tokens, "prompt_tokens": 7,
            "cached_tokens": 2, "device_s": 0.01 * tokens, "finished": finished, "delta_text": "x"}


class DyingStream:
    """A replica's stream that yields `items`, then fails as a killed replica's call does."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items = list(items)

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.items:
            raise ActorDiedError()
        return self.items.pop(0)

    def cancel(self) -> None:
        self.items = []


class Handle:
    """A deployment handle whose every `generate` call is a `DyingStream` of `items`."""

    deployment_name = "LoraReplica"

    def __init__(self, items: list[dict[str, Any]]):
        self.calls = 0
        self._items = items
        self.generate = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, job: GenerateJob) -> DyingStream:
        self.calls += 1
        return DyingStream(self._items)


def job() -> GenerateJob:
    return GenerateJob(request_id="cmpl-1-0", prompt=[1, 2, 3], adapter_id="a1@2",
                       sampling=SamplingParams(max_new_tokens=8), tenant="acme", priority_class="standard")


async def lost_records(items: list[dict[str, Any]], monkeypatch) -> tuple[list[int], list[UsageBatch], int]:
    monkeypatch.setattr(dispatch, "RETRY_PAUSE_S", 0.0)
    batches: list[UsageBatch] = []

    async def send(batch: UsageBatch) -> None:
        batches.append(batch)

    meter = RefusalMeter(UsageShipper(send, background=False), "demo", "ingress-1")
    handle = Handle(items)
    received: list[int] = []
    with pytest.raises(ApiException):
        generation = await Dispatcher(handle, "app", lost=meter.lost).start(job(), "/v1/completions")
        async for out in generation.items():
            received.append(out["completion_tokens"])
    await meter.shipper.flush()
    return received, batches, handle.calls


async def test_a_stream_whose_replica_dies_mid_way_is_one_lost_record_of_what_was_sent(monkeypatch):
    received, batches, _ = await lost_records([item(1), item(3), item(5)], monkeypatch)
    records = [r for b in batches for r in b.records]
    assert received == [1, 3, 5], "precondition: the client received three items, then the replica died"
    assert len(records) == 1, f"one record for the request: {records}"
    record = records[0]
    assert record.request_id == "cmpl-1-0", "under the job's own id, which the replica would have used"
    assert record.outcome is Outcome.LOST, f"its outcome says the replica was lost: {record}"
    assert record.output_tokens == 5, f"the tokens the client received: {record}"
    assert record.prompt_tokens == 7, f"the prompt tokens the replica reported: {record}"
    assert record.device_s == pytest.approx(0.05), f"the device time the replica reported last: {record}"
    assert (record.replica, record.tenant, record.adapter, record.version) == ("r-dead", "acme", "a1", 2), \
        f"the replica it ran on, the tenant and the adapter version: {record}"


async def test_a_request_whose_replica_dies_on_every_try_is_one_lost_record_of_nothing(monkeypatch):
    received, batches, calls = await lost_records([], monkeypatch)
    records = [r for b in batches for r in b.records]
    assert calls == dispatch.MAX_ATTEMPTS, "precondition: every try failed before a first item"
    assert received == [], "precondition: the client received nothing"
    assert [(r.outcome, r.output_tokens) for r in records] == [(Outcome.LOST, 0)], \
        f"one lost record with no tokens: {records}"


async def test_a_client_gone_between_a_dead_try_and_its_retry_is_one_delivered_record(monkeypatch):
    monkeypatch.setattr(dispatch, "RETRY_PAUSE_S", 30.0)  # the client goes away during the pause
    batches: list[UsageBatch] = []

    async def send(batch: UsageBatch) -> None:
        batches.append(batch)

    meter = RefusalMeter(UsageShipper(send, background=False), "demo", "ingress-1")
    handle = Handle([])
    dispatcher = Dispatcher(handle, "app", lost=meter.lost, delivered=meter.delivered)
    start = asyncio.ensure_future(dispatcher.start(job(), "/v1/completions"))
    for _ in range(100):
        if handle.calls:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await meter.shipper.flush()
    records = [r for b in batches for r in b.records]
    assert handle.calls == 1, "precondition: the first try died and no retry was sent"
    assert [(r.request_id, r.outcome, r.output_tokens, r.delivered) for r in records] == \
        [("cmpl-1-0", Outcome.CANCELLED, 0, True)], \
        f"the request its dead replica cannot record is one delivered record of nothing: {records}"

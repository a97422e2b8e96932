"""A started job's seat in the cluster admission comes back when its replica ends it, read or not
(`serve.routing.generation`): a non-streaming job's as it starts, a stream's once the stream ends
(read ahead of the caller), a running stream's when it is cancelled. So a fan-out with more choices
than the replicas' seats starts them all: the ingress's real `Dispatcher` and `ClusterAdmission` over
fake replica calls at the Serve boundary and a controller that grants a parked request only while
the replica has a free seat by the ingress's own count, as the real one counts its claims."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import CoalescedShard, wait_until_async

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.serve.routing.dispatch import Dispatcher

BOUND_S = 10.0
SEATS = 2  # the one replica's batch slots


def item(tokens: int, finished: bool = False) -> dict[str, Any]:
    return {"replica": "r-1", "hit": True, "completion_tokens": tokens, "prompt_tokens": 4,
            "cached_tokens": 0, "device_s": 0.0, "finished": finished, "delta_text": "x"}


class Stream:
    """A replica's streaming call: yields `items`, then ends; with `hold`, waits until cancelled."""

    def __init__(self, items: list[dict[str, Any]], hold: bool = False):
        self.items, self.hold, self.cancelled = list(items), hold, False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.items:
            return self.items.pop(0)
        if self.hold:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Unary:
    """A replica's unary call (`complete`): answers the job's whole result after a loop turn."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __await__(self) -> Any:
        return self._answer().__await__()

    async def _answer(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        return item(self.tokens, finished=True)

    def cancel(self) -> None:
        pass


class Handle:
    """The LoRA deployment's handle: each streaming call is a `Stream` of `stream_items` (held open with
    `hold`), each unary call a `Unary` of 3 tokens."""

    deployment_name = "LoraReplica"

    def __init__(self, stream_items: list[dict[str, Any]] | None = None, hold: bool = False):
        self.stream_items, self.hold = stream_items or [item(1), item(2), item(3, finished=True)], hold
        self.streams: list[Stream] = []
        self.generate = SimpleNamespace(remote=self._stream)
        self.complete = SimpleNamespace(remote=lambda job: Unary(3))

    def options(self, **_: Any) -> Handle:
        return self

    def _stream(self, job: GenerateJob) -> Stream:
        self.streams.append(Stream(self.stream_items, self.hold))
        return self.streams[-1]


class SeatController:
    """The cluster controller as the admission calls it: grants a parked request the replica once it
    has a free seat by `taken()` (the ingress's requests in flight there, its claims)."""

    def __init__(self) -> None:
        self.taken: Any = None
        self.admit = SimpleNamespace(remote=lambda ticket, remaining: asyncio.ensure_future(self._grant()))
        self.snapshot = SimpleNamespace(remote=lambda: asyncio.ensure_future(self._empty()))

    @staticmethod
    async def _empty() -> dict[str, Any]:
        return {}

    async def _grant(self) -> dict[str, Any]:
        while await self.taken() >= SEATS:
            await asyncio.sleep(0.001)
        return {"replica_id": "r-1"}


def dispatcher(handle: Handle) -> tuple[Dispatcher, SeatController]:
    controller = SeatController()
    admission = ClusterAdmission(CoalescedShard(controller), capacity=None, timeout_s=BOUND_S,
                                 replica_stats=lambda: {"r-1": RoutingStats(max_num_seqs=SEATS)})
    d = Dispatcher(handle, "seats-app", admission=admission)

    async def taken() -> int:
        return sum((await in_flight(d)).values())
    controller.taken = taken
    return d, controller


async def in_flight(d: Dispatcher) -> dict[str, int]:
    """The admission's in-flight requests per replica (as GET /v1/cluster shows them)."""
    return (await d.cluster_view())["ingress"]["in_flight"]


def job(i: int, stream: bool) -> GenerateJob:
    return GenerateJob(request_id=f"job-{i}", prompt=[40, 41, 42, 43], adapter_id="a1",
                       sampling=SamplingParams(max_new_tokens=3, temperature=0.0), stream=stream)


async def test_a_non_streaming_job_gives_its_seat_back_as_it_starts():
    d, _ = dispatcher(Handle())
    generation = await d.start(job(0, stream=False), "/v1/completions")
    held = await in_flight(d)
    final = await generation.final()
    assert held == {}, f"its replica ended it with its one reply: no seat held while unread ({held})"
    assert final["completion_tokens"] == 3, "the caller still reads its whole result"


async def test_a_stream_gives_its_seat_back_when_its_replica_ends_it_unread():
    d, _ = dispatcher(Handle())
    generation = await d.start(job(0, stream=True), "/v1/completions")
    ended = await wait_until_async(lambda: _empty(d), BOUND_S, "the stream's seat came back")
    tokens = [i["completion_tokens"] async for i in generation.items()]
    assert ended, "the seat came back at the stream's end, before the caller read a second item"
    assert tokens == [1, 2, 3], f"the caller reads every item, in order, after its seat came back: {tokens}"


async def test_a_running_stream_keeps_its_seat_until_it_is_cancelled():
    handle = Handle([item(1), item(2)], hold=True)
    d, _ = dispatcher(handle)
    generation = await d.start(job(0, stream=True), "/v1/completions")
    for _ in range(20):
        await asyncio.sleep(0)
    running = await in_flight(d)
    generation.cancel()
    after = await in_flight(d)
    assert running == {"r-1": 1}, f"a stream its replica still runs holds its seat: {running}"
    assert after == {}, f"cancelled, it gives the seat back: {after}"
    assert handle.streams[0].cancelled, "and its replica call is cancelled"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_fan_out_with_more_choices_than_seats_starts_them_all(stream):
    """Five choices over two seats, none read before all have started (as `start_all`'s callers do)."""
    d, _ = dispatcher(Handle())
    jobs = [job(i, stream) for i in range(5)]
    generations = await asyncio.wait_for(d.start_all(jobs, "/v1/completions"), BOUND_S)
    finals = [(await g.final())["completion_tokens"] for g in generations]
    assert finals == [3] * 5, f"every choice started and answered in full: {finals}"
    assert await in_flight(d) == {}, "no seat is left held"


async def _empty(d: Dispatcher) -> bool:
    return await in_flight(d) == {}

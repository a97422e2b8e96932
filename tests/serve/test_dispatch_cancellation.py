"""A fan-out request (`n` > 1, several prompts) that is cancelled leaves nothing behind.

The ingress's real `Dispatcher` and `ClusterAdmission` send the jobs to two real `LoraReplica`s on
the tiny demo model, run outside Ray Serve (Serve cannot be cancelled mid-call on a chosen await in
a test). The handle between them is `InProcessReplicas`: each call runs as its own task, as on a
replica, after a few turns of the loop (the trip there); `cancel()` cancels that task, as Serve
cancels the call on its replica (the replica then aborts the request in its engine). Whatever point
the cancellation reaches, afterwards no replica runs a request of the fan-out, the admission's
in-flight count is back to 0 for every replica, and every choice that started was handed to the
caller (to charge its tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from app_client import BOUND_S, FakeTokenizer, serving
from helpers import CoalescedShard, greedy, wait_until_async
from ray.serve.exceptions import RequestCancelledError

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.http.context import ApiContext, finals, merge
from lora_cluster.serve.http.ingress import build_fastapi
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.serve.routing.quotas import LocalQuotas
from lora_cluster.tenancy.quota import QuotaBook
from lora_cluster.tenancy.tenants import hash_key
from lora_cluster.tenancy.watch import TenantsWatcher

REPLICAS = ("r1", "r2")
_END = object()


@pytest.fixture
def replicas(demo_zoo, monkeypatch) -> Iterator[dict[str, Any]]:
    """Two `LoraReplica`s outside Ray Serve (Serve's and Ray's context faked, logging left alone) on
    the tiny demo model, their engine steps slowed to 5 ms at least, so that a 300-token request is
    still running when its caller goes away."""
    from lora_cluster.serve.replica import deployment as replica_module

    monkeypatch.setattr(replica_module.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=str))
    monkeypatch.setattr(replica_module, "configure_logging", lambda *args, **kwargs: None)
    made: dict[str, Any] = {}
    for rid in REPLICAS:
        monkeypatch.setattr(replica_module.serve, "get_replica_context",
                            lambda rid=rid: SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid)))
        replica = replica_module.LoraReplica.func_or_class({
            "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "max_loras": 2,
            "max_num_seqs": 8, "lora_cpu_native": False})
        step = replica.engine.step

        def slow_step(step: Callable[[], Any] = step) -> Any:
            time.sleep(0.02)  # a 300-token choice outlasts every wait of these tests (>= 6 s of steps)
            return step()

        monkeypatch.setattr(replica.engine, "step", slow_step)
        made[rid] = replica
    yield made
    for replica in made.values():
        replica.aengine.shutdown()


class ServeCall:
    """One call to an in-process replica, shaped as Serve's `DeploymentResponseGenerator` (streaming:
    `__anext__`) and `DeploymentResponse` (unary: `await`). It runs as its own task after `hops`
    turns of the loop, and after `gate` opens when one is given; `cancel()` cancels that task."""

    def __init__(self, run: Callable[[], AsyncIterator[Any]], hops: int, gate: asyncio.Event | None):
        self._items: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump(run, hops, gate))

    async def _pump(self, run: Callable[[], AsyncIterator[Any]], hops: int,
                    gate: asyncio.Event | None) -> None:
        try:
            for _ in range(hops):
                await asyncio.sleep(0)
            if gate is not None:
                await gate.wait()
            async with contextlib.aclosing(run()) as items:
                async for item in items:
                    self._items.put_nowait(item)
            self._items.put_nowait(_END)
        except asyncio.CancelledError:
            self._items.put_nowait(RequestCancelledError("the call was cancelled"))
            raise
        except Exception as exc:
            self._items.put_nowait(exc)

    async def _next(self) -> Any:
        item = await self._items.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def __anext__(self) -> Any:
        return self._next()

    def __await__(self) -> Any:
        return self._next().__await__()

    def cancel(self) -> None:
        self.task.cancel()


class InProcessReplicas:
    """The LoRA replicas' deployment handle (`options`, `generate.remote`, `complete.remote`) over
    in-process replicas. The "router" sends a job to its granted replica, else to a seeded random one;
    each call's trip takes a seeded number of loop turns; a job that `held` gives a gate waits there."""

    deployment_name = "LoraReplica"

    def __init__(self, replicas: dict[str, Any], rng: random.Random, max_hops: int = 3):
        self.replicas, self.rng, self.max_hops = replicas, rng, max_hops
        self.calls: list[ServeCall] = []
        self.held: Callable[[GenerateJob], asyncio.Event | None] = lambda job: None  # a gate for this job

    def options(self, stream: bool = False) -> InProcessReplicas:
        return self

    def _call(self, job: GenerateJob, unary: bool) -> ServeCall:
        replica = self.replicas[job.replica_id or self.rng.choice(sorted(self.replicas))]

        async def run() -> AsyncIterator[Any]:
            if unary:
                yield await replica.complete(job)
            else:
                async with contextlib.aclosing(replica.generate(job)) as items:
                    async for item in items:
                        yield item

        call = ServeCall(run, self.rng.randrange(self.max_hops + 1), self.held(job))
        self.calls.append(call)
        return call

    @property
    def generate(self) -> Any:
        return SimpleNamespace(remote=lambda job: self._call(job, unary=False))

    @property
    def complete(self) -> Any:
        return SimpleNamespace(remote=lambda job: self._call(job, unary=True))

    async def settled(self) -> None:
        """Every call has ended (a cancelled one once its replica let go of it)."""
        await asyncio.wait_for(asyncio.gather(*(c.task for c in self.calls), return_exceptions=True), BOUND_S)


class Reply:
    """A controller call's reply, after a few loop turns; cancellable as a Serve call is."""

    def __init__(self, value: dict[str, Any], hops: int):
        self.task = asyncio.ensure_future(self._reply(value, hops))

    @staticmethod
    async def _reply(value: dict[str, Any], hops: int) -> dict[str, Any]:
        for _ in range(hops):
            await asyncio.sleep(0)
        return value

    def __await__(self) -> Any:
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class GrantingController:
    """The cluster controller as the admission calls it: grants every parked request a seeded
    random replica after a few loop turns; its snapshot is empty (the ingress adds its own counts)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.admit = SimpleNamespace(remote=lambda ticket, remaining: Reply(
            {"replica_id": self.rng.choice(REPLICAS)}, self.rng.randrange(4)))
        self.snapshot = SimpleNamespace(remote=lambda: Reply({}, 0))


def full() -> dict[str, RoutingStats]:
    """Reports of two full replicas: every request parks in the cluster queue."""
    return {rid: RoutingStats(max_num_seqs=1, num_running=1) for rid in REPLICAS}


def dispatcher_over(replicas: dict[str, Any], rng: random.Random,
                    parked: bool) -> tuple[Dispatcher, InProcessReplicas]:
    """A real Dispatcher over the in-process replicas; `parked`: its requests wait for grants."""
    handle = InProcessReplicas(replicas, rng)
    admission = ClusterAdmission(CoalescedShard(GrantingController(rng)), capacity=None, timeout_s=BOUND_S,
                                 replica_stats=full if parked else dict)
    return Dispatcher(handle, "cancel-app", admission=admission), handle


async def in_flight(dispatcher: Dispatcher) -> dict[str, int]:
    """The admission's in-flight requests per replica (as GET /v1/cluster shows them)."""
    return (await dispatcher.cluster_view())["ingress"]["in_flight"]


async def running(replica: Any) -> int:
    """Requests the replica's engine runs or queues, asked on its loop after every command sent to it."""
    stats = await replica.aengine.call(lambda engine: engine.stats())
    return stats.num_running + stats.num_waiting


async def nothing_left(replicas: dict[str, Any], dispatcher: Dispatcher, handle: InProcessReplicas,
                       what: str) -> None:
    await handle.settled()
    for rid, replica in replicas.items():
        assert await running(replica) == 0, f"{what}: replica {rid}'s engine runs no request of the fan-out"
        assert replica.active == 0, f"{what}: replica {rid} has no generate call in progress"
    assert await in_flight(dispatcher) == {}, f"{what}: no in-flight count above 0 on any replica"


def all_cancelled(replicas: dict[str, Any], what: str) -> None:
    """Every request that reached a replica was cancelled there (none generated to its end)."""
    for rid, replica in replicas.items():
        assert replica.counts["cancelled"] == replica.counts["requests"], (
            f"{what}: replica {rid} aborted every request of the fan-out it got: {dict(replica.counts)}")


def fan_out(prefix: str, prompts: int, n: int, stream: bool, adapters: list[str | None],
            max_new_tokens: int = 300) -> list[GenerateJob]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateJob(request_id=f"{prefix}-{i}", prompt=[40 + i // n, 41, 42, 43],
                        adapter_id=adapters[i % len(adapters)], sampling=sampling, stream=stream)
            for i in range(prompts * n)]


async def cancel_once_three_started(task: asyncio.Task, dispatcher: Dispatcher) -> None:
    """Cancel `task` (a four-choice fan-out whose last choice is held) once choices 0-2 run on their
    replicas; the cancellation reaches the task's awaiter."""

    async def three_started() -> bool:
        return sum((await in_flight(dispatcher)).values()) == 3

    await wait_until_async(three_started, BOUND_S, "choices 0-2 started on their replicas")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ----- a choice still starting when the client goes away -------------------------------------------------


def hold_last_choice(handle: InProcessReplicas) -> asyncio.Event:
    """The fan-out's choice 3 (request id `...-3`) waits before its replica until the gate opens."""
    gate = asyncio.Event()
    handle.held = lambda job: gate if job.request_id.endswith("-3") else None
    return gate


@pytest.mark.parametrize("parked", [False, True], ids=["fast-path", "cluster-queue"])
async def test_a_fan_out_cancelled_while_a_choice_starts_cancels_the_started_ones(replicas, parked):
    dispatcher, handle = dispatcher_over(replicas, random.Random(1), parked)
    hold_last_choice(handle)
    jobs = fan_out("held", prompts=1, n=4, stream=True, adapters=["a1"])
    task = asyncio.create_task(dispatcher.start_all(jobs, "/v1/completions"))
    await cancel_once_three_started(task, dispatcher)
    await nothing_left(replicas, dispatcher, handle, "a fan-out cancelled while its last choice starts")
    all_cancelled(replicas, "a fan-out cancelled while its last choice starts")


async def test_a_failing_choice_cancels_the_choices_still_starting(replicas):
    dispatcher, handle = dispatcher_over(replicas, random.Random(3), parked=False)
    hold_last_choice(handle)  # never opened: start_all returns because the held choice is cancelled
    jobs = fan_out("fails", prompts=1, n=4, stream=True, adapters=["a1"])
    jobs[1].adapter_id = "no-such-adapter"
    with pytest.raises(ApiException) as raised:
        await asyncio.wait_for(dispatcher.start_all(jobs, "/v1/completions"), BOUND_S)
    assert raised.value.error.status == 404, f"the failing choice's error is raised: {raised.value.error}"
    await nothing_left(replicas, dispatcher, handle, "a fan-out one of whose choices failed")


async def test_a_generation_cancelled_while_its_request_is_being_added_leaves_no_request(replicas):
    """The replica's engine: a caller cancelled at the first await of `AsyncEngine.generate` (the add,
    queued to the engine's thread, which still runs it) leaves no request generating."""
    engine = replicas["r1"].aengine
    sampling = greedy(300)
    stream = engine.generate([40, 41, 42], None, sampling, request_id="added-then-gone")
    task = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)  # the task posts the add and awaits it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await running(replicas["r1"]) == 0, "the request added for a cancelled caller was aborted"


# ----- the tenant is charged for the choices that ran ----------------------------------------------------

KEY = "sk-fin-cancel"


async def test_the_started_choices_of_a_cancelled_fan_out_are_charged_to_the_tenant(replicas, tmp_path: Path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"""
tenants:
  - name: finance
    api_keys: ["{hash_key(KEY)}"]
    adapters: ["*"]
    tokens_per_minute: 100000
    max_concurrent: 4
""")
    book = QuotaBook(lambda: 0.0)  # a frozen clock: the token bucket does not refill during the test
    dispatcher, handle = dispatcher_over(replicas, random.Random(2), parked=False)
    hold_last_choice(handle)
    watcher = TenantsWatcher(str(tenants), start=False)
    body = {"model": "a1", "prompt": "a", "n": 4, "max_tokens": 300, "stream": True}  # a 1-token prompt
    async with serving(FakeTokenizer(), dispatcher, tenants=watcher, quotas=LocalQuotas(book)) as client:
        task = asyncio.create_task(client.post("/v1/completions", json=body,
                                               headers={"authorization": f"Bearer {KEY}"}))
        await cancel_once_three_started(task, dispatcher)
    await nothing_left(replicas, dispatcher, handle, "an HTTP fan-out cancelled while its last choice starts")
    all_cancelled(replicas, "an HTTP fan-out cancelled while its last choice starts")
    usage = book.usage("finance")
    assert usage["active"] == 0, "the request's concurrency slot was freed"
    charged = 100000 - usage["tokens_left"]
    assert charged >= 3, (
        "the three choices that started each generated a token at least, charged to the tenant (with or "
        f"without the 1-token prompt): {charged} tokens charged")


# ----- a stream whose client goes away before its first byte --------------------------------------------


async def test_a_stream_whose_client_goes_away_before_its_first_byte_cancels_its_choices(replicas):
    """The ingress's ASGI app called as a server calls it: the client disconnects while the response's
    headers are on their way (a client or proxy that never takes them), so the body never starts."""
    dispatcher, handle = dispatcher_over(replicas, random.Random(4), parked=False)
    ctx = ApiContext(config=ServeConfig(model="base"), tokenizer=FakeTokenizer(), dispatcher=dispatcher)
    body = json.dumps({"model": "a1", "prompt": "a", "n": 4, "max_tokens": 300, "stream": True}).encode()
    headers_sent, requested = asyncio.Event(), [False]

    async def receive() -> dict[str, Any]:
        if not requested[0]:
            requested[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await headers_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers_sent.set()
            await asyncio.Event().wait()  # never taken: the disconnect ends the response here

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    try:
        await asyncio.wait_for(build_fastapi(ctx)(scope, receive, send), BOUND_S)
    finally:
        ctx.close()
    assert headers_sent.is_set(), "the request started its four choices and began its response"
    await nothing_left(replicas, dispatcher, handle, "a stream whose client left before its first byte")
    all_cancelled(replicas, "a stream whose client left before its first byte")


# ----- randomized: cancelled at any point ----------------------------------------------------------------

SEEDS = range(24)


async def cancelled_round(seed: int, replicas: dict[str, Any]) -> str:
    """One seeded fan-out, cancelled at a random point; how it ended. Asserts that nothing is left."""
    rng = random.Random(seed)
    parked, stream = rng.random() < 0.5, rng.random() < 0.5
    what = f"seed {seed} (parked={parked}, stream={stream})"
    dispatcher, handle = dispatcher_over(replicas, rng, parked)
    jobs = fan_out(f"seed{seed}", prompts=rng.randint(2, 3), n=4, stream=stream,
                   adapters=rng.sample([None, "a1", "a2", "a3"], 2),
                   max_new_tokens=rng.choice([4, 300] if stream else [4, 30]))
    started: list[Generation] = []

    async def request() -> None:
        generations = await dispatcher.start_all(jobs, "/v1/completions", on_started=started.append)
        if stream:
            async for _ in merge(generations):
                pass
        else:
            await finals(generations)

    task = asyncio.create_task(request())
    after = rng.randint(0, len(jobs))  # cancel once this many choices started (all: while they run)
    await wait_until_async(lambda: len(started) >= after or task.done(), BOUND_S,
                           f"{what}: {after} choices started")
    for _ in range(rng.randrange(40)):
        await asyncio.sleep(0)
    if rng.random() < 0.3:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
    task.cancel()
    try:
        await task
        ended = "completed"
    except asyncio.CancelledError:
        ended = "cancelled"
    await nothing_left(replicas, dispatcher, handle, what)
    assert all(g.finished for g in started), f"{what}: every started choice ended or was cancelled"
    assert all(g.tokens >= g.first["completion_tokens"] for g in started), (
        f"{what}: a started choice counts the tokens of its first item at least (they are charged)")
    return ended


async def test_a_fan_out_cancelled_at_random_points_leaves_nothing_running(replicas):
    """Seeded: per seed, 2-3 prompts with n = 4, streaming or not, on the fast path or the cluster
    queue, short or long, cancelled once a random number of its choices started (from none to all,
    then they run), a random number of loop turns later (and sometimes a short while more). The
    replicas are shared by the rounds: a leak of one round shows in the next."""
    ended = [await cancelled_round(seed, replicas) for seed in SEEDS]
    assert ended.count("cancelled") >= len(SEEDS) // 4, f"many rounds were cancelled before the end: {ended}"

"""The ingress's FastAPI app without Ray: `build_fastapi` around a fake dispatcher and a fake tokenizer.

Requests go through httpx's ASGI transport on the test's own event loop, so several requests are in
flight together on one loop, as in the ingress. Concurrency is arranged with events, never with
sleeps; every wait has a bound so that a defect fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from lora_cluster.config import ServeConfig
from lora_cluster.serve.context import ApiContext
from lora_cluster.serve.dispatch import Generation
from lora_cluster.serve.ingress import build_fastapi
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.registrations import AdapterRegistrations

BOUND_S = 20.0  # safety bound of every wait: reached only when the behaviour under test is broken


class FakeTokenizer:
    """One token per character (id = code point); the chat template renders `role: content` lines."""

    chat_template = "role: content"
    all_special_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class BlockingTemplateTokenizer(FakeTokenizer):
    """A chat template that blocks its thread until `release` is set (at most BOUND_S)."""

    def __init__(self) -> None:
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        self.entered.set()
        self.release.wait(BOUND_S)
        self.returned.set()
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


class FakeStream:
    """The rest of a replica's output stream (what `handle.options(stream=True)` returns)."""

    def __init__(self, items: list[dict[str, Any]]):
        self._items = iter(items)
        self.cancelled = False

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)  # a real stream yields to the loop between items
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


def outputs(job: GenerateJob) -> list[dict[str, Any]]:
    """Wire items of a generation of `max_new_tokens` tokens "x" (the first carries the routing head)."""
    n = job.sampling.max_new_tokens
    prompt_tokens = len(job.prompt)
    items = []
    for i in range(1, n + 1):
        done = i == n
        items.append({"text": "x" * i if done else None, "delta_text": "x", "delta_token_ids": [120],
                      "token_ids": [120] * i if done else None, "finished": done,
                      "finish_reason": "length" if done else None, "prompt_tokens": prompt_tokens,
                      "completion_tokens": i, "ttft_s": 0.0})
    items[0] = {"replica": "r1", "hit": True, **items[0]}
    return items


class FakeDispatcher:
    """Answers as one replica "r1" would. `register_gate` / `unregister_gate`, when given, hold every
    `register_adapter` / `unregister_adapter` broadcast until they are set; `registers_in_flight`
    counts the register broadcasts that started."""

    def __init__(self, register_gate: asyncio.Event | None = None,
                 unregister_gate: asyncio.Event | None = None, refuse_registers: int = 0):
        self.register_gate, self.unregister_gate = register_gate, unregister_gate
        self.refuse_registers = refuse_registers  # the next this many registers are refused (a 400)
        self.unregister_started = asyncio.Event()
        self.registers_in_flight = 0
        self.two_registers_in_flight = asyncio.Event()
        self.broadcasts: list[tuple[str, tuple[Any, ...]]] = []
        self.jobs: list[GenerateJob] = []  # every job started, in order

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        return {"r1": {}}

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        first, *rest = outputs(job)
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))

    async def start_all(self, jobs: list[GenerateJob], route: str) -> list[Generation]:
        return [await self.start(job, route) for job in jobs]

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        return [] if method == "list_adapters" else "r1"

    async def call(self, replica_id: str, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        return {"replica": replica_id, "ok": True}

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        self.broadcasts.append((method, args))
        if method == "register_adapter" and self.register_gate is not None:
            self.registers_in_flight += 1
            if self.registers_in_flight == 2:
                self.two_registers_in_flight.set()
            await self.register_gate.wait()
        if method == "unregister_adapter" and self.unregister_gate is not None:
            self.unregister_started.set()
            await self.unregister_gate.wait()
        if method == "register_adapter" and self.refuse_registers > 0:
            self.refuse_registers -= 1
            error = {"status": 400, "type": "invalid_request_error", "code": "invalid_adapter",
                     "message": "adapter 'mine': adapter_config.json is not valid JSON"}
            return {"r1": {"error": error}}
        return {"r1": {"replica": "r1", "ok": True}}


@contextlib.asynccontextmanager
async def serving(tokenizer: Any, dispatcher: Any, **context: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the app built around `tokenizer` and `dispatcher` (ApiContext fields in
    `context`); the context's tokenizer threads are stopped afterwards."""
    ctx = ApiContext(config=ServeConfig(model="base"), tokenizer=tokenizer, dispatcher=dispatcher, **context)
    transport = httpx.ASGITransport(app=build_fastapi(ctx))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=BOUND_S) as client:
            yield client
    finally:
        ctx.close()


@pytest.fixture
def fake_dispatcher() -> FakeDispatcher:
    return FakeDispatcher()


# ----- tokenization and chat templates stay off the event loop -----------------------------------------


async def test_a_slow_chat_template_does_not_stall_other_requests_streams(fake_dispatcher):
    tokenizer = BlockingTemplateTokenizer()
    chat_body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    stream_body = {"model": "a2", "prompt": "hello", "max_tokens": 3, "stream": True}
    async with serving(tokenizer, fake_dispatcher) as client:
        chat = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body))
        entered = await asyncio.to_thread(tokenizer.entered.wait, BOUND_S)
        streamed = await asyncio.wait_for(client.post("/v1/completions", json=stream_body), BOUND_S)
        template_still_running = not tokenizer.returned.is_set()
        tokenizer.release.set()
        chat_response = await asyncio.wait_for(chat, BOUND_S)
    assert entered, "the chat request reached its chat template"
    assert template_still_running, (
        "a streaming request ran to its end while another request's chat template was still rendering "
        "(a template on the event loop would stall every other request until it returned)")
    assert streamed.status_code == 200, f"the streaming request succeeded: {streamed.text}"
    assert streamed.text.endswith("data: [DONE]\n\n"), "the streaming request's stream ran to [DONE]"
    assert streamed.text.count('"text":"x"') == 3, "the stream carried its three tokens"
    assert chat_response.status_code == 200, f"the chat request completed once its template returned: " \
                                              f"{chat_response.text}"


async def test_chat_and_completion_prompts_are_tokenized_with_the_tokenizer(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        completion = await client.post("/v1/completions", json={
            "model": "a1", "prompt": "hello", "max_tokens": 1})
        chat = await client.post("/v1/chat/completions", json={
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == len("hello"), "a text prompt is tokenized"
    rendered = FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], True, False)
    assert chat.json()["usage"]["prompt_tokens"] == len(rendered), (
        "a conversation is rendered with the chat template, then tokenized")


async def test_a_chat_template_error_is_a_400_naming_the_template(fake_dispatcher):
    class RejectingTokenizer(FakeTokenizer):
        def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                                tokenize: bool) -> str:
            raise ValueError("roles must alternate")

    async with serving(RejectingTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400, f"a template that rejects the conversation is the client's error: {r.text}"
    assert "cannot apply the chat template: roles must alternate" in r.json()["error"]["message"], (
        "the message says that the chat template refused and why")


# ----- vLLM load_lora_adapter: one registration per name, even for concurrent calls ---------------------


async def test_concurrent_loads_of_one_adapter_name_register_it_once():
    gate = asyncio.Event()
    dispatcher = FakeDispatcher(register_gate=gate)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        loads = [asyncio.create_task(client.post("/v1/load_lora_adapter", json=body)) for _ in range(2)]
        both_broadcast = asyncio.create_task(dispatcher.two_registers_in_flight.wait())
        await asyncio.wait([*loads, both_broadcast], timeout=BOUND_S, return_when=asyncio.FIRST_COMPLETED)
        gate.set()
        responses = await asyncio.wait_for(asyncio.gather(*loads), BOUND_S)
        both_broadcast.cancel()
        models = (await client.get("/v1/models")).json()["data"]
    statuses = sorted(r.status_code for r in responses)
    refusals = [r.json()["error"]["message"] for r in responses if r.status_code == 400]
    registers = [args for method, args in dispatcher.broadcasts if method == "register_adapter"]
    assert statuses == [200, 400], f"one concurrent load succeeds and the other is refused, got {statuses}"
    assert any("being loaded" in m for m in refusals), f"the refused call is told that the adapter is " \
                                                       f"being loaded: {refusals}"
    assert len(registers) == 1, "the replicas were asked to register the adapter once"
    assert [m["id"] for m in models].count("mine") == 1, "the adapter is listed once"


async def test_a_failed_load_releases_the_name_for_a_retry():
    dispatcher = FakeDispatcher(refuse_registers=1)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        refused = await client.post("/v1/load_lora_adapter", json=body)
        retried = await client.post("/v1/load_lora_adapter", json=body)
    assert refused.status_code == 400, f"a load that a replica refuses is an error: {refused.text}"
    assert retried.status_code == 200, f"the name is free again after a failed load: {retried.text}"


async def test_a_load_of_a_name_that_is_being_unloaded_is_refused():
    unregister_gate = asyncio.Event()
    dispatcher = FakeDispatcher(unregister_gate=unregister_gate)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        loaded = await client.post("/v1/load_lora_adapter", json=body)
        unload = asyncio.create_task(client.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}))
        await asyncio.wait_for(dispatcher.unregister_started.wait(), BOUND_S)
        during = await client.post("/v1/load_lora_adapter", json=body)
        unregister_gate.set()
        unloaded = await asyncio.wait_for(unload, BOUND_S)
        after = await client.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, f"the first load succeeds: {loaded.text}"
    assert during.status_code == 400, f"a load while the name is being unloaded is refused: {during.text}"
    assert during.json()["error"]["code"] == "being_unloaded", "the refusal says the name is being unloaded"
    assert unloaded.status_code == 200, f"the unload succeeds: {unloaded.text}"
    assert after.status_code == 200, f"once unloaded, the name can be loaded again: {after.text}"


async def test_the_number_of_loaded_adapters_is_bounded(fake_dispatcher):
    registrations = AdapterRegistrations(limit=1)
    async with serving(FakeTokenizer(), fake_dispatcher, registrations=registrations) as client:
        first = await client.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": "/a/one"})
        second = await client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": "/a/two"})
    assert first.status_code == 200, f"a load within the limit succeeds: {first.text}"
    assert second.status_code == 400, f"a load beyond the limit is refused: {second.text}"
    assert "at most 1 LoRA adapters" in second.json()["error"]["message"], "the refusal names the limit"


# ----- SLA classes: header, else vLLM's priority field, else the default; the job and response carry it ----

COMPLETION = {"model": "a1", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LORAX = {"inputs": "hi", "parameters": {"adapter_id": "a1", "max_new_tokens": 2}}


async def test_the_header_names_the_class_and_wins_over_the_priority_field(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "priority": 0},
                              headers={"x-lora-priority": "batch"})
    assert r.status_code == 200, f"a request naming a known class succeeds: {r.text}"
    assert fake_dispatcher.jobs[0].priority_class == "batch", (
        "the header's class wins over the priority field")
    assert fake_dispatcher.jobs[0].priority == 2, "the job carries its class's priority"
    assert r.headers["x-lora-priority-class"] == "batch", "the response names the class that served it"


async def test_the_priority_field_picks_the_class_when_there_is_no_header(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        completion = await client.post("/v1/completions", json={**COMPLETION, "priority": 0})
        chat = await client.post("/v1/chat/completions", json={**CHAT, "priority": 2})
    assert completion.status_code == 200, f"a completion with a priority succeeds: {completion.text}"
    assert chat.status_code == 200, f"a chat completion with a priority succeeds: {chat.text}"
    assert fake_dispatcher.jobs[0].priority_class == "interactive", "completions: priority 0 is interactive"
    assert fake_dispatcher.jobs[0].priority == 0, "completions: the job carries priority 0"
    assert fake_dispatcher.jobs[1].priority_class == "batch", "chat: priority 2 is batch"
    assert chat.headers["x-lora-priority-class"] == "batch", "chat: the response names the class"


async def test_a_request_without_header_or_priority_is_in_the_default_class(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "n": 2})
    assert r.status_code == 200, f"the request succeeds: {r.text}"
    assert [j.priority_class for j in fake_dispatcher.jobs] == ["standard", "standard"], (
        "every choice's job is in the default class")
    assert [j.priority for j in fake_dispatcher.jobs] == [1, 1], (
        "every job carries the default class's priority")
    assert r.headers["x-lora-priority-class"] == "standard", "the response names the default class"


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                            ("/generate", LORAX), ("/generate_stream", LORAX)])
async def test_an_unknown_class_is_a_400_naming_the_known_classes(fake_dispatcher, path, body):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post(path, json=body, headers={"x-lora-priority": "platinum"})
    assert r.status_code == 400, f"{path}: an unknown class is the client's error: {r.text}"
    message = r.json()["error"]["message"]
    assert "'platinum'" in message, f"{path}: the message names the unknown class: {message}"
    assert "interactive, standard, batch" in message, (
        f"{path}: the message names the known classes: {message}")
    assert fake_dispatcher.jobs == [], f"{path}: nothing was sent to a replica"


@pytest.mark.parametrize(("path", "body", "stream"), [
    ("/v1/completions", COMPLETION, False), ("/v1/completions", {**COMPLETION, "stream": True}, True),
    ("/v1/chat/completions", CHAT, False), ("/v1/chat/completions", {**CHAT, "stream": True}, True),
    ("/generate", LORAX, False), ("/generate_stream", LORAX, True),
    ("/", LORAX, False), ("/", {**LORAX, "stream": True}, True),
])
async def test_every_generation_response_names_its_class(fake_dispatcher, path, body, stream):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post(path, json=body, headers={"x-lora-priority": "interactive"})
    assert r.status_code == 200, f"{path}: the request succeeds: {r.text}"
    kind = "text/event-stream" if stream else "application/json"
    assert r.headers["content-type"].startswith(kind), f"{path}: the response is {kind}"
    assert r.headers["x-lora-priority-class"] == "interactive", f"{path}: the response names its class"
    assert fake_dispatcher.jobs[0].priority_class == "interactive", f"{path}: the job carries the class"
    assert fake_dispatcher.jobs[0].priority == 0, f"{path}: the job carries the class's priority"


async def test_lorax_routes_ignore_a_priority_field_and_use_the_default_class(fake_dispatcher):
    body = {**LORAX, "parameters": {**LORAX["parameters"], "priority": 0}}
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/generate", json=body)
    assert r.status_code == 200, f"the request succeeds: {r.text}"
    assert r.headers["x-lora-priority-class"] == "standard", (
        "LoRAX's schema has no priority field: without the header, the default class")

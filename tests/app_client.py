"""In-process clients of the ingress's FastAPI app without Ray: `serving` builds the app around a fake
tokenizer and a fake dispatcher (one replica "r1") and yields an httpx client on the test's own event
loop, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.ingress import build_fastapi
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

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

    def replica_stats(self) -> dict[str, RoutingStats]:
        return {"r1": RoutingStats()}

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        first, *rest = outputs(job)
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))

    async def start_all(self, jobs: list[GenerateJob], route: str,
                        on_started: Callable[[Generation], None] | None = None) -> list[Generation]:
        started = []
        for job in jobs:
            started.append(await self.start(job, route))
            if on_started is not None:
                on_started(started[-1])
        return started

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
async def serving(tokenizer: Any, dispatcher: Any, config: ServeConfig | None = None, *,
                  raise_app_exceptions: bool = True, **context: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the app built around `tokenizer` and `dispatcher` (ApiContext fields in
    `context`; `config` defaults to the base model's), in process; the context's tokenizer threads are
    stopped afterwards. With `raise_app_exceptions=False` an exception the app lets out is the client's
    500 answer, as a server would send it, instead of an exception in the test."""
    ctx = ApiContext(config=config or ServeConfig(model="base"), tokenizer=tokenizer, dispatcher=dispatcher,
                     **context)
    transport = httpx.ASGITransport(app=build_fastapi(ctx), raise_app_exceptions=raise_app_exceptions)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=BOUND_S) as client:
            yield client
    finally:
        ctx.close()

"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

`model` is an adapter id, or the base model's name for no adapter. `n` choices run as separate
engine requests (choice i of a seeded request uses seed + i). `stream: true` sends SSE chunks and
ends with `data: [DONE]`; `stream_options.include_usage` adds a last chunk with the usage. An error
after the first token arrives as a `data: {"error": ...}` event before `[DONE]`. The SLA class is the
`x-lora-priority` header's, else vLLM's integer `priority` field's, else the default (see `context`);
every choice's job runs in it, and the response names it in `x-lora-priority-class`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.serve.context import HEADER_PRIORITY_CLASS, ApiContext, PriorityHeader, finals, merge
from lora_cluster.serve.dispatch import Generation, routing_headers
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.schemas import OPENAI_FINISH, ChatCompletionRequest, CompletionRequest
from lora_cluster.serve.sse import DONE, EventStream, event

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter()

    def jobs_for(body: Any, prompts: list[list[int]], default_max: int, request_id: str,
                 sla: SlaClass) -> list[GenerateJob]:
        adapter = ctx.adapter_for(body.model)
        jobs = []
        for prompt in prompts:
            for choice in range(body.n):
                jobs.append(GenerateJob(
                    request_id=f"{request_id}-{len(jobs)}", prompt=prompt, adapter_id=adapter,
                    sampling=body.sampling(ctx.config, default_max, choice), stream=body.stream,
                    adapter_path=ctx.adapter_path(adapter), priority_class=sla.name, priority=sla.priority))
        return jobs

    async def run(body: Any, route: str, prompts: list[list[int]], default_max: int, kind: str,
                  sla: SlaClass) -> Any:
        request_id = ctx.new_id("cmpl" if kind == "text" else "chatcmpl")
        created = int(time.time())
        jobs = jobs_for(body, prompts, default_max, request_id, sla)
        generations = await ctx.dispatcher.start_all(jobs, route)
        headers = {**routing_headers(generations), HEADER_PRIORITY_CLASS: sla.name}
        prompt_tokens = sum(len(p) for p in prompts)
        if not body.stream:
            done = await finals(generations)
            choices = []
            for index, item in enumerate(done):
                finish = OPENAI_FINISH.get(item["finish_reason"], item["finish_reason"])
                if kind == "text":
                    choices.append({"index": index, "text": item["text"], "logprobs": None,
                                    "finish_reason": finish})
                else:
                    choices.append({"index": index, "message": {"role": "assistant", "content": item["text"]},
                                    "logprobs": None, "finish_reason": finish})
            completion_tokens = sum(item["completion_tokens"] for item in done)
            return JSONResponse({
                "id": request_id, "object": "text_completion" if kind == "text" else "chat.completion",
                "created": created, "model": body.model, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}, headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(generations, request_id, created, body.model, kind, prompt_tokens, include_usage)
        return EventStream(events, headers, on_close=lambda: [g.cancel() for g in generations])

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, x_lora_priority: PriorityHeader = None) -> Any:
        body.check(ctx.config)
        sla = ctx.priority_class(x_lora_priority, body.priority)
        prompts = [await ctx.encode(p) for p in body.prompts()]  # in turn: one pool job per request
        return await run(body, "/v1/completions", prompts, COMPLETIONS_DEFAULT_MAX_TOKENS, "text", sla)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, x_lora_priority: PriorityHeader = None) -> Any:
        body.check(ctx.config)
        sla = ctx.priority_class(x_lora_priority, body.priority)
        prompt = await ctx.encode_chat(body.conversation())
        return await run(body, "/v1/chat/completions", [prompt], ctx.config.default_max_tokens, "chat", sla)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = await ctx.dispatcher.any_replica("list_adapters")
        created = int(time.time())
        base = {"id": ctx.base_name, "object": "model", "created": created, "owned_by": "lora-cluster",
                "root": ctx.config.model, "parent": None}
        registered = ctx.registrations.snapshot()
        ids = list(dict.fromkeys([*registered, *adapters]))
        return {"object": "list", "data": [base, *(
            {"id": a, "object": "model", "created": created, "owned_by": "lora-cluster",
             "root": registered.get(a, a), "parent": ctx.base_name} for a in ids)]}

    return router


async def _stream(generations: list[Generation], request_id: str, created: int, model: str, kind: str,
                  prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
    obj = "text_completion" if kind == "text" else "chat.completion.chunk"

    def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> bytes:
        if kind == "text":
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        else:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return event({"id": request_id, "object": obj, "created": created, "model": model,
                      "choices": [choice]})

    completion_tokens = [0] * len(generations)
    try:
        if kind == "chat":
            for index in range(len(generations)):
                yield chunk(index, None, None, first=True)
        async for index, item in merge(generations):
            completion_tokens[index] = item["completion_tokens"]
            finish = OPENAI_FINISH.get(item["finish_reason"]) if item["finished"] else None
            if item["delta_text"] or finish:
                yield chunk(index, item["delta_text"], finish)
        if include_usage:
            yield event({"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": _usage(prompt_tokens, sum(completion_tokens))})
    except ApiException as exc:
        yield event(exc.error.body())
    yield DONE

"""LoRAX-compatible routes: POST /generate, /generate_stream and / (TGI's compat route).

Request `{"inputs", "parameters": {"adapter_id", ...}, "stream"}`; response `{"generated_text",
"details": {"finish_reason", "prompt_tokens", "generated_tokens", "seed", "prefill", "tokens"}}`
(`POST /` without stream answers a one-element list, as TGI does). Stream events are TGI's:
`{"token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}`, the last
one with `generated_text` and `details`. The engine does not compute log-probabilities, so
`logprob` is always 0.0 (the LoRAX client requires a number there). `adapter_source` may be
absent, "hub", "local" or "s3": adapters are looked up in the server's configured sources either way.
The SLA class is the `x-lora-priority` header's, else the default (LoRAX's schema has no priority
field); the response names it in `x-lora-priority-class`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.serve.context import HEADER_PRIORITY_CLASS, ApiContext, PriorityHeader
from lora_cluster.serve.dispatch import Generation, routing_headers
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.schemas import LORAX_FINISH, LoraxRequest
from lora_cluster.serve.sse import EventStream, event


def lorax_router(ctx: ApiContext) -> APIRouter:
    router = APIRouter()

    def token(token_id: int, text: str | None = None) -> dict[str, Any]:
        return {"id": token_id, "text": ctx.token_text(token_id) if text is None else text, "logprob": 0.0,
                "special": ctx.is_special(token_id)}

    async def start(body: LoraxRequest, stream: bool, route: str,
                    sla: SlaClass) -> tuple[Generation, int | None]:
        p = body.parameters
        p.check()
        sampling, seed = p.sampling(ctx.config)
        adapter = ctx.adapter_for(p.adapter_id)
        prompt = await ctx.encode(body.inputs)
        job = GenerateJob(request_id=ctx.new_id("lorax"), prompt=prompt, adapter_id=adapter,
                          sampling=sampling, stream=stream, adapter_path=ctx.adapter_path(adapter),
                          priority_class=sla.name, priority=sla.priority)
        return (await ctx.dispatcher.start(job, route)), seed

    def headers_of(generation: Generation, sla: SlaClass) -> dict[str, str]:
        return {**routing_headers([generation]), HEADER_PRIORITY_CLASS: sla.name}

    async def generate(body: LoraxRequest, route: str,
                       sla: SlaClass) -> tuple[dict[str, Any], dict[str, str]]:
        generation, seed = await start(body, False, route, sla)
        final = await generation.final()
        p = body.parameters
        text = (body.inputs + final["text"]) if p.return_full_text else final["text"]
        details = None
        if p.details:
            details = {**_details(final, seed), "prefill": [],
                       "tokens": [token(t) for t in final["token_ids"]], "best_of_sequences": None}
        return {"generated_text": text, "details": details}, headers_of(generation, sla)

    async def generate_stream(body: LoraxRequest, route: str, sla: SlaClass) -> EventStream:
        generation, seed = await start(body, True, route, sla)
        return EventStream(_events(ctx, generation, body, seed, token), headers_of(generation, sla),
                           on_close=generation.cancel)

    @router.post("/generate")
    async def generate_route(body: LoraxRequest, x_lora_priority: PriorityHeader = None) -> Any:
        result, headers = await generate(body, "/generate", ctx.priority_class(x_lora_priority))
        return JSONResponse(result, headers=headers)

    @router.post("/generate_stream")
    async def generate_stream_route(body: LoraxRequest, x_lora_priority: PriorityHeader = None) -> Any:
        return await generate_stream(body, "/generate_stream", ctx.priority_class(x_lora_priority))

    @router.post("/")
    async def compat_route(body: LoraxRequest, x_lora_priority: PriorityHeader = None) -> Any:
        sla = ctx.priority_class(x_lora_priority)
        if body.stream:
            return await generate_stream(body, "/", sla)
        result, headers = await generate(body, "/", sla)
        return JSONResponse([result], headers=headers)

    return router


def _details(final: dict[str, Any], seed: int | None) -> dict[str, Any]:
    return {"finish_reason": LORAX_FINISH.get(final["finish_reason"], "length"),
            "prompt_tokens": final["prompt_tokens"], "generated_tokens": final["completion_tokens"],
            "seed": seed}


async def _events(ctx: ApiContext, generation: Generation, body: LoraxRequest, seed: int | None,
                  token: Any) -> AsyncIterator[bytes]:
    p = body.parameters
    last_id = None
    try:
        async for item in generation.items():
            ids = item["delta_token_ids"]
            last_id = ids[-1] if ids else last_id
            if not item["finished"]:
                if ids:
                    yield event({"token": token(last_id, item["delta_text"]), "generated_text": None,
                                 "details": None})
                continue
            text = (body.inputs + item["text"]) if p.return_full_text else item["text"]
            details = None
            if p.details:
                details = _details(item, seed)
            final_id = last_id if last_id is not None else (item["token_ids"] or [0])[-1]
            yield event({"token": token(final_id, item["delta_text"]), "generated_text": text,
                         "details": details})
    except ApiException as exc:
        yield event(exc.error.body())

"""LoRAX-compatible routes: POST /generate, /generate_stream and / (TGI's compat route).

Request `{"inputs", "parameters": {"adapter_id", ...}, "stream"}`; response `{"generated_text",
"details": {"finish_reason", "prompt_tokens", "generated_tokens", "seed", "prefill", "tokens"}}`
(`POST /` without stream answers a one-element list, as TGI does). Stream events are TGI's:
`{"token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}`, the last
one with `generated_text` and `details`. Every token's `logprob` is computed by the engine (of the raw
model distribution: see `engine.sample.logprobs`); `return_k_alternatives` adds `alternative_tokens` to each
token, `decoder_input_details` the prompt tokens as `prefill` (non-streaming; the first logprob is
null). A stream event that carries several tokens (a slow reader) names its last token and that
token's logprob. `adapter_source` may be
absent, "hub", "local" or "s3": adapters are looked up in the server's configured sources either way.
The SLA class is the `x-lora-priority` header's, else the default (LoRAX's schema has no priority
field); the response names it in `x-lora-priority-class`. `parameters.response_format` constrains the
output (`structured_output`). `parameters.best_of` above 1 (sampling, no seed, no stream, at most
`max_n`) runs that many generations, each with a seed of its own, and answers the one with the
highest mean logprob per token; with `details`, the others are `details.best_of_sequences` (`best_of`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.serve.http import openapi
from lora_cluster.serve.http.adapter_versions import version_header
from lora_cluster.serve.http.best_of import best_one
from lora_cluster.serve.http.context import (
    HEADER_PRIORITY_CLASS,
    ApiContext,
    PriorityHeader,
    UserHeader,
    finals,
)
from lora_cluster.serve.http.logprob_format import TokenTexts, json_logprob, lorax_alternatives, lorax_prefill
from lora_cluster.serve.http.lorax_schemas import LORAX_FINISH, LoraxRequest, LoraxStreamRequest
from lora_cluster.serve.http.release_shadow import ShadowCopies, StreamTap
from lora_cluster.serve.http.release_traffic import StreamEvidence, record_answer, record_failure
from lora_cluster.serve.http.schemas import merge_of
from lora_cluster.serve.http.sse import EventStream, event
from lora_cluster.serve.http.truncation import Prompt, truncation_headers
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.auth import Caller, CallerDep
from lora_cluster.serve.routing.dispatch import Generation, routing_headers


def lorax_router(ctx: ApiContext, shadows: ShadowCopies) -> APIRouter:
    """The LoRAX routes of one ingress, on `ctx` (`LoraxRoutes`), in the schema's order; `shadows`:
    the ingress's shadow copies of releases (shared with the OpenAI routes)."""
    routes, router = LoraxRoutes(ctx, shadows), APIRouter()
    router.post("/generate", responses=openapi.GENERATION_JSON)(routes.generate_route)
    router.post("/generate_stream", status_code=200, response_class=EventStream,
                responses=openapi.GENERATION_STREAM)(routes.generate_stream_route)
    router.post("/", responses=openapi.GENERATION)(routes.compat_route)
    return router


class LoraxRoutes:
    """The handlers of the LoRAX routes over one ingress's `ApiContext` (see the module docstring).

    A handler's name is its OpenAPI operation's id and summary, its docstring (where it has one) the
    operation's description: renaming one, or adding a docstring, changes the published schema."""

    def __init__(self, ctx: ApiContext, shadows: ShadowCopies):
        self.ctx = ctx
        self.shadows = shadows  # a release's shadow copies (http.release_shadow)

    async def generate_route(self, body: LoraxRequest, caller: CallerDep,
                             x_lora_priority: PriorityHeader = None, x_lora_user: UserHeader = None) -> Any:
        sla = self.ctx.policy.priority_class(x_lora_priority, caller=caller)
        result, headers = await self._generate(body, "/generate", sla, caller, x_lora_user)
        return JSONResponse(result, headers=headers)

    async def generate_stream_route(self, body: LoraxStreamRequest, caller: CallerDep,
                                    x_lora_priority: PriorityHeader = None,
                                    x_lora_user: UserHeader = None) -> Any:
        sla = self.ctx.policy.priority_class(x_lora_priority, caller=caller)
        return await self._generate_stream(body, "/generate_stream", sla, caller, x_lora_user)

    async def compat_route(self, body: LoraxRequest, caller: CallerDep,
                           x_lora_priority: PriorityHeader = None, x_lora_user: UserHeader = None) -> Any:
        sla = self.ctx.policy.priority_class(x_lora_priority, caller=caller)
        if body.stream:
            return await self._generate_stream(body, "/", sla, caller, x_lora_user)
        result, headers = await self._generate(body, "/", sla, caller, x_lora_user)
        return JSONResponse([result], headers=headers)

    def _token(self, token_id: int, lp: Any, alternatives: bool, texts: TokenTexts, base: str | None,
               text: str | None = None) -> dict[str, Any]:
        """One token in LoRAX's shape (`text` None: the token's own text)."""
        out = {"id": token_id, "text": texts(token_id) if text is None else text,
               "logprob": 0.0 if lp is None else json_logprob(lp.logprob),
               "special": self.ctx.tokens.is_special(token_id, base)}
        if alternatives and lp is not None:
            out["alternative_tokens"] = lorax_alternatives(lp, texts)
        return out

    async def _start(self, body: LoraxRequest, stream: bool, route: str, sla: SlaClass, caller: Caller,
                     user: str | None) -> tuple[list[Generation], list[int | None], Prompt, str | None]:
        """The request's generations (best_of candidates: several), the seed each reports, the prompt,
        the base model it runs on (whose tokenizer encoded it; `ModelNames.request_base`)."""
        ctx = self.ctx
        p = body.parameters
        p.check()
        p.check_best_of(ctx.config, streamed=stream or body.stream)
        # 404 when the tenant may not use it
        adapter = ctx.models.adapter_for(p.adapter_id, caller, merging=p.merged_adapters is not None,
                                         user=user)
        merge = merge_of(p.merged_adapters, adapter, ctx.config,
                         lambda aid: ctx.models.adapter_for(aid, caller))
        path = ctx.models.adapter_path(adapter)
        adapter = merge.adapter_id if merge is not None else adapter
        samplings = [p.sampling(ctx.config) for _ in range(p.candidates)]  # a seed of its own each
        request_id = ctx.new_id("lorax")
        # a refusal from here on (quota, cluster queue) is the request's usage record (`usage_refusals`)
        with ctx.refusals.watch(tenant=caller.tenant, adapter_id=adapter, sla_class=sla.name,
                                request_id=request_id):
            caller.check()  # the tenant's requests_per_minute, before any tokenizing
            ctx.check_budget(caller)  # a tenant's used-up monthly budget (action refuse): 429
            base = await ctx.models.request_base(p.adapter_id, adapter if merge is None else None,
                                                 None if merge is None else merge.ids, caller.tenant)
            prompt = await ctx.tokens.encode(body.inputs, base=base)
            await caller.admit(len(prompt.ids))  # the tenant's quota: 429 naming the limit
            n = len(samplings)
            ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
            jobs = [GenerateJob(request_id=ids[i], prompt=prompt.ids, adapter_id=adapter, sampling=sampling,
                                stream=stream, adapter_path=path, priority_class=sla.name,
                                priority=sla.priority, merge=merge, tenant=caller.tenant, base=base)
                    for i, (sampling, _) in enumerate(samplings)]
            if len(jobs) == 1:
                generations = [await ctx.dispatcher.start(jobs[0], route)]
                caller.track(generations)
            else:  # each candidate is charged from its start, as OpenAI's choices
                generations = await ctx.dispatcher.start_all(jobs, route,
                                                             on_started=lambda g: caller.track([g]))
        return generations, [seed for _, seed in samplings], prompt, base

    async def _generate(self, body: LoraxRequest, route: str, sla: SlaClass, caller: Caller,
                        user: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The answer of a request not streamed, and its headers (best_of: the best candidate's, the
        others as `best_of_sequences` with `details`)."""
        generations, seeds, prompt, base = await self._start(body, False, route, sla, caller, user)
        try:
            done = await finals(generations)
        except BaseException as exc:
            record_failure(self.ctx.release_state, generations[0].job, exc)  # evidence for a release
            raise
        record_answer(self.ctx.release_state, generations[0].job, done[0], sla)
        self.shadows.maybe_copy([g.job for g in generations], done)  # after the live answer
        best, others = best_one(done) if len(done) > 1 else (0, [])
        p = body.parameters
        texts = TokenTexts(partial(self.ctx.tokens.token_text, base=base))

        def text_of(final: dict[str, Any]) -> str:
            return (body.inputs + final["text"]) if p.return_full_text else final["text"]

        def sequence(final: dict[str, Any]) -> dict[str, Any]:
            """The token details of one generation: prefill and tokens."""
            lps = final.get("logprobs") or [None] * len(final["token_ids"])
            prefill = []
            if p.decoder_input_details:
                prefill = lorax_prefill(prompt.ids, final.get("prompt_logprobs"), texts)
            tokens = [self._token(t, lp, p.return_k_alternatives is not None, texts, base)
                      for t, lp in zip(final["token_ids"], lps, strict=True)]
            return {"prefill": prefill, "tokens": tokens}

        details = None
        if p.details:
            sequences = [{"generated_text": text_of(done[i]), **_sequence_details(done[i], seeds[i]),
                          **sequence(done[i])} for i in others]
            details = {**_details(done[best], seeds[best]), **sequence(done[best]),
                       "best_of_sequences": sequences or None}
        answer = {"generated_text": text_of(done[best]), "details": details}
        return answer, {**_headers(generations, sla, prompt), **self.ctx.budget_headers(caller)}

    async def _generate_stream(self, body: LoraxRequest, route: str, sla: SlaClass, caller: Caller,
                               user: str | None) -> EventStream:
        generations, seeds, prompt, base = await self._start(body, True, route, sla, caller, user)
        generation = generations[0]  # a stream has one (check_best_of)
        events = _events(self.ctx, generation, body, seeds[0], partial(self._token, base=base), base,
                         self.shadows.tap([generation.job]),
                         StreamEvidence(self.ctx.release_state, generation.job, sla))
        headers = {**_headers(generations, sla, prompt), **self.ctx.budget_headers(caller)}
        return EventStream(events, headers, on_close=generation.cancel)


def _headers(generations: list[Generation], sla: SlaClass, prompt: Prompt) -> dict[str, str]:
    return {**routing_headers(generations), HEADER_PRIORITY_CLASS: sla.name, **truncation_headers([prompt]),
            **version_header(generations[0].job)}


def _details(final: dict[str, Any], seed: int | None) -> dict[str, Any]:
    return {"finish_reason": LORAX_FINISH.get(final["finish_reason"], "length"),
            "prompt_tokens": final["prompt_tokens"], "generated_tokens": final["completion_tokens"],
            "seed": seed}


def _sequence_details(final: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """A best_of_sequences entry's details: a generation's, without the prompt's count."""
    return {key: value for key, value in _details(final, seed).items() if key != "prompt_tokens"}


async def _events(ctx: ApiContext, generation: Generation, body: LoraxRequest, seed: int | None,
                  token: Any, base: str | None, tap: StreamTap | None,
                  evidence: StreamEvidence | None = None) -> AsyncIterator[bytes]:
    """TGI's stream events of one generation; `tap` (a release's shadow copy) sees every item the
    client is sent and starts the copy once the stream ended; `evidence` (a release's) sees them too,
    and the error that ends the stream."""
    p = body.parameters
    last_id, last_lp = None, None
    texts = TokenTexts(partial(ctx.tokens.token_text, base=base))
    alternatives = p.return_k_alternatives is not None
    try:
        async for item in generation.items():
            if tap is not None:
                tap.add(item)
            if evidence is not None:
                evidence.item(0, item)
            ids, lps = item["delta_token_ids"], item.get("delta_logprobs")
            last_id = ids[-1] if ids else last_id
            last_lp = lps[-1] if lps else last_lp
            if not item["finished"]:
                if ids:
                    head = token(last_id, last_lp, alternatives, texts, text=item["delta_text"])
                    yield event({"token": head, "generated_text": None, "details": None})
                continue
            text = (body.inputs + item["text"]) if p.return_full_text else item["text"]
            details = None
            if p.details:
                details = _details(item, seed)
            final_id = last_id if last_id is not None else (item["token_ids"] or [0])[-1]
            yield event({"token": token(final_id, last_lp, alternatives, texts, text=item["delta_text"]),
                         "generated_text": text, "details": details})
    except ApiException as exc:
        if evidence is not None:
            evidence.failed(exc)
        yield event(exc.error.body())
    if tap is not None:
        tap.end()  # after the live stream, never delaying it (a stream that failed is not copied)

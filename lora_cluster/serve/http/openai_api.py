"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

`model` is an adapter id, or the base model's name for no adapter. `n` choices run as separate
engine requests (choice i of a seeded request uses seed + i); with `best_of` (raised to n), best_of
candidates run and the n with the highest cumulative logprob are the choices, best first (`best_of`;
the usage counts every candidate's tokens, as they were all generated and charged).
`stream: true` sends SSE chunks and ends with `data: [DONE]`; `stream_options.include_usage` adds a
last chunk with the usage. An error after the first token arrives as a `data: {"error": ...}` event
before `[DONE]`. A streamed request whose choices are known only at the end (a best_of selection,
completions' `echo`, whose prompt logprobs come with the last token) gets each choice whole in one
chunk once every job is done (`whole_chunks`), then the usage chunk and `[DONE]`. The SLA class is the
`x-lora-priority` header's, else vLLM's integer `priority` field's, else the default (see `request_policy`);
every choice's job runs in it, and the response names it in `x-lora-priority-class`. Log-probabilities
(completions `logprobs: k`, chat `logprobs: true` + `top_logprobs: k`) come in each choice's `logprobs`,
streamed chunks included, in OpenAI's shapes (`logprob_format`); they are of the raw model
distribution, whatever the temperature (see `engine.sample.logprobs`). Completions' `echo` prepends each
prompt to its choices' text and, with `logprobs`, its tokens' logprobs (the first null).
`usage.prompt_tokens_details.cached_tokens` and the `x-lora-cached-tokens` header count the prompt
tokens whose KV the replicas' prefix caches held, once per prompt (as `prompt_tokens`).
Chat `tools` go to the chat template; each choice's output is read for tool calls (`tool_calls`: the
model's format with `tool_choice: auto`, the grammar-forced shape with `required` or a named
function) and answered in OpenAI's `message.tool_calls` / `delta.tool_calls`, with `finish_reason:
"tool_calls"` when a choice that called a tool stopped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.releases.refs import parse_ref
from lora_cluster.serve.http import openapi, tool_calls
from lora_cluster.serve.http.adapter_versions import model_ids, version_header
from lora_cluster.serve.http.best_of import best_n
from lora_cluster.serve.http.context import (
    HEADER_PRIORITY_CLASS,
    ApiContext,
    PriorityHeader,
    UserHeader,
    finals,
    merge,
)
from lora_cluster.serve.http.logprob_format import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
)
from lora_cluster.serve.http.openai_schemas import OPENAI_FINISH, ChatCompletionRequest, CompletionRequest
from lora_cluster.serve.http.prompt_limits import ChatLimits
from lora_cluster.serve.http.release_shadow import ShadowCopies, StreamTap
from lora_cluster.serve.http.release_traffic import StreamEvidence, record_answer, record_failure
from lora_cluster.serve.http.schemas import merge_of
from lora_cluster.serve.http.sse import DONE, EventStream, event
from lora_cluster.serve.http.tool_calls import ContentDelta, ToolCallReader
from lora_cluster.serve.http.truncation import Prompt, truncation_headers
from lora_cluster.serve.http_errors import ApiException, bad_request
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.auth import Caller, CallerDep
from lora_cluster.serve.routing.dispatch import Generation, cached_tokens, routing_headers
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def openai_router(ctx: ApiContext, shadows: ShadowCopies) -> APIRouter:
    """The OpenAI routes of one ingress, on `ctx` (`OpenAiRoutes`), in the schema's order; `shadows`:
    the ingress's shadow copies of releases (shared with the LoRAX routes)."""
    routes, router = OpenAiRoutes(ctx, shadows), APIRouter()
    router.post("/v1/completions", responses=openapi.GENERATION)(routes.completions)
    router.post("/v1/chat/completions", responses=openapi.GENERATION)(routes.chat_completions)
    router.get("/v1/models", responses=openapi.LISTING)(routes.models)
    return router


class OpenAiRoutes:
    """The handlers of the OpenAI routes over one ingress's `ApiContext` (see the module docstring).

    A handler's name is its OpenAPI operation's id and summary, its docstring (where it has one) the
    operation's description: renaming one, or adding a docstring, changes the published schema."""

    def __init__(self, ctx: ApiContext, shadows: ShadowCopies):
        self.ctx = ctx
        self.shadows = shadows  # a release's shadow copies (http.release_shadow)

    async def completions(self, body: CompletionRequest, caller: CallerDep,
                          x_lora_priority: PriorityHeader = None, x_lora_user: UserHeader = None) -> Any:
        ctx = self.ctx
        body = _with_user(body, x_lora_user)
        sla = self._screen(body, caller, x_lora_priority)
        base = await self._base_of(body, caller)
        raw = body.prompts()
        fitted = [await ctx.tokens.encode(p, base=base) for p in raw]  # in turn: one pool job per request
        echoes = ([p if isinstance(p, str) and not f.truncated else await ctx.tokens.decode(f.ids, base)
                   for p, f in zip(raw, fitted, strict=True)] if body.echo else None)  # what ran
        return await self._run(body, "/v1/completions", fitted, COMPLETIONS_DEFAULT_MAX_TOKENS, "text", sla,
                               caller, base, echoes)

    async def chat_completions(self, body: ChatCompletionRequest, caller: CallerDep,
                               x_lora_priority: PriorityHeader = None, x_lora_user: UserHeader = None) -> Any:
        body = _with_user(body, x_lora_user)
        ctx = self.ctx
        sla = self._screen(body, caller, x_lora_priority)
        base = await self._base_of(body, caller)
        check_counts(body, await ctx.tokens.chat_limits(base), ctx.tokens.prompt_limit_of(base))
        use = body.tool_use()
        prompt = await ctx.tokens.encode_chat(body.conversation(), use.template_tools(), base)
        parser = ctx.tokens.tool_parser(base)
        reader = partial(tool_calls.reader_for, use.mode, parser, use.name, use.parallel)
        default = ctx.config.api.default_max_tokens
        return await self._run(body, "/v1/chat/completions", [prompt], default, "chat",
                               sla, caller, base, reader=reader)

    async def models(self, caller: CallerDep) -> dict[str, Any]:
        """The base models and the adapters, those the caller's tenant may use only. `root` is where
        a registered adapter was loaded from (as vLLM reports it) for an admin caller only (or on an
        open server): a tenant sees the adapter's id there, never a server path. With several base
        models (replica groups on several bases), each base is listed followed by its adapters, each
        with `parent` set to its base."""
        ctx = self.ctx
        created = int(time.time())
        paths = ctx.registrations.snapshot()
        listed_ids = model_ids(paths)  # a registered adapter's bare name and each version, name@N
        registered = {model: paths[replica_id] for model, replica_id in listed_ids.items()}
        grouped = ctx.dispatcher
        if isinstance(grouped, GroupedDispatcher) and grouped.several_bases:
            listed = await grouped.listings()
            by_base = {b: [*grouped.catalog.adapters_of(b), *ids] for b, ids in listed.items()}
        else:
            listed_here = await ctx.dispatcher.any_replica("list_adapters")
            by_base = {ctx.models.base_name: [*registered, *listed_here]}
        data: list[dict[str, Any]] = []
        for base, adapters in by_base.items():
            root = ctx.config.model if base == ctx.models.base_name else base
            if caller.may_use(None):
                data.append({"id": base, "object": "model", "created": created, "owned_by": "lora-cluster",
                             "root": root, "parent": None})
            data.extend({"id": a, "object": "model", "created": created, "owned_by": "lora-cluster",
                         "root": registered.get(a, a) if caller.principal.admin else a, "parent": base}
                        for a in dict.fromkeys(adapters) if caller.may_use(parse_ref(a)[0]))
        return {"object": "list", "data": data}

    def _screen(self, body: CompletionRequest | ChatCompletionRequest, caller: Caller,
                x_lora_priority: str | None) -> SlaClass:
        """The checks before any work, cheapest first: the body's limits, the adapter (404 when the
        tenant may not use it), the SLA class, the tenant's requests_per_minute."""
        body.check(self.ctx.config)
        adapter = self.ctx.models.adapter_for(body.model, caller, merging=body.merged_adapters is not None)
        sla = self.ctx.policy.priority_class(x_lora_priority, body.priority, caller)
        with self.ctx.refusals.watch(tenant=caller.tenant, adapter_id=adapter, sla_class=sla.name):
            caller.check()
            self.ctx.check_budget(caller)  # a tenant's used-up monthly budget (action refuse): 429
        return sla

    async def _base_of(self, body: CompletionRequest | ChatCompletionRequest, caller: Caller) -> str | None:
        """The base model the request runs on, whose tokenizer encodes and renders it (`request_base`)."""
        models = self.ctx.models
        adapter = models.adapter_for(body.model, caller, merging=body.merged_adapters is not None)
        merge = merge_of(body.merged_adapters, adapter, self.ctx.config,
                         lambda aid: models.adapter_for(aid, caller))
        merged = None if merge is None else merge.ids
        return await models.request_base(body.model, adapter, merged, caller.tenant)

    def _jobs_for(self, body: Any, prompts: list[list[int]], default_max: int, request_id: str,
                  sla: SlaClass, caller: Caller, base: str | None) -> list[GenerateJob]:
        """The request's jobs: `body.candidates` per prompt, prompt by prompt (choice i: seed + i)."""
        ctx = self.ctx
        adapter = ctx.models.adapter_for(body.model, caller, merging=body.merged_adapters is not None,
                                         user=body.user)
        merge = merge_of(body.merged_adapters, adapter, ctx.config,
                         lambda aid: ctx.models.adapter_for(aid, caller))
        path = ctx.models.adapter_path(adapter)
        adapter = merge.adapter_id if merge is not None else adapter
        jobs = []
        for prompt in prompts:
            for choice in range(body.candidates):
                jobs.append(GenerateJob(
                    request_id=f"{request_id}-{len(jobs)}", prompt=prompt, adapter_id=adapter,
                    sampling=body.sampling(ctx.config, default_max, choice),
                    stream=body.stream and not body.whole,
                    adapter_path=path, priority_class=sla.name, priority=sla.priority, merge=merge,
                    tenant=caller.tenant, base=base))
        return jobs

    async def _run(self, body: Any, route: str, fitted: list[Prompt], default_max: int, kind: str,
                   sla: SlaClass, caller: Caller, base: str | None, echoes: list[str] | None = None,
                   reader: Callable[[], ToolCallReader] = tool_calls.PlainReader) -> Any:
        """Start the jobs on `base` and answer; `echoes` (completions' `echo`): each prompt's text,
        prepended; `reader` (chat): a fresh reader of one choice's output (content and tool calls)."""
        ctx = self.ctx
        prompts = [p.ids for p in fitted]
        request_id = ctx.new_id("cmpl" if kind == "text" else "chatcmpl")
        created = int(time.time())
        jobs = self._jobs_for(body, prompts, default_max, request_id, sla, caller, base)
        prompt_tokens = sum(len(p) for p in prompts)
        # a refusal (quota, cluster queue) is the request's usage record (`serve.ops.usage_refusals`)
        with ctx.refusals.watch(tenant=caller.tenant, adapter_id=jobs[0].adapter_id, sla_class=sla.name,
                                base=base, request_id=request_id):
            await caller.admit(prompt_tokens)  # the tenant's quota: 429 naming the limit
            # each choice is charged from its start: a fan-out cancelled while starting charges what ran
            try:
                generations = await ctx.dispatcher.start_all(jobs, route,
                                                             on_started=lambda g: caller.track([g]))
            except BaseException as exc:
                record_failure(ctx.release_state, jobs[0], exc)  # evidence for a release of this version
                raise
        cached = cached_tokens(generations, len(prompts))
        headers = {**routing_headers(generations, len(prompts)), HEADER_PRIORITY_CLASS: sla.name,
                   **truncation_headers(fitted), **version_header(jobs[0]), **ctx.budget_headers(caller)}
        texts = TokenTexts(partial(ctx.tokens.token_text, base=base))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream and not body.whole:
            events = _stream(generations, request_id, created, body.model, kind, prompt_tokens, include_usage,
                             texts, reader, cached=cached, tap=self.shadows.tap(jobs),
                             evidence=StreamEvidence(ctx.release_state, jobs[0], sla))
            return EventStream(events, headers, on_close=lambda: [g.cancel() for g in generations])
        try:
            done = await finals(generations)
        except BaseException as exc:
            record_failure(ctx.release_state, jobs[0], exc)
            raise
        record_answer(ctx.release_state, jobs[0], done[0], sla)
        self.shadows.maybe_copy(jobs, done)  # after the live answer, never delaying it
        completion_tokens = sum(item["completion_tokens"] for item in done)  # every candidate's
        if body.selects:
            done = _selected(done, body.candidates, body.n, asked=body.logprobs_k() is not None)
        choices = [_choice(kind, index, item, texts, reader, body.n, prompts, echoes)
                   for index, item in enumerate(done)]
        usage = _usage(prompt_tokens, completion_tokens, cached)
        obj = "text_completion" if kind == "text" else "chat.completion"
        if body.stream:
            head = {"id": request_id, "object": obj if kind == "text" else "chat.completion.chunk",
                    "created": created, "model": body.model}
            chunks = whole_chunks(head, kind, choices, usage if include_usage else None)
            return EventStream(chunks, headers, on_close=lambda: None)  # every job is done
        return JSONResponse({"id": request_id, "object": obj, "created": created, "model": body.model,
                             "choices": choices, "usage": usage}, headers=headers)


def check_counts(body: ChatCompletionRequest, limits: ChatLimits, prompt_limit: int) -> None:
    """A chat request's messages and tools within its base's counts (`prompt_limits`): a 400 naming
    the limit otherwise."""
    for name, count, most in (("messages", len(body.messages), limits.messages),
                              ("tools", len(body.tools or ()), limits.tools)):
        if count > most:
            raise bad_request(f"{count} {name} exceed the limit of {most} for model {body.model!r} (as many "
                              f"short {name} as fit in their share of its {prompt_limit}-token prompt limit, "
                              "at most max_chat_messages or OpenAI's 128 tools)")


def _choice(kind: str, index: int, item: dict[str, Any], texts: TokenTexts,
            reader: Callable[[], ToolCallReader], n: int, prompts: list[list[int]],
            echoes: list[str] | None) -> dict[str, Any]:
    """Choice `index` of a response answered whole, from its final item: completions' text (the
    prompt first with `echo`) or chat's message with its tool calls."""
    finish = OPENAI_FINISH.get(item["finish_reason"], item["finish_reason"])
    logprobs = _logprobs(kind, item.get("logprobs"), texts)
    if kind == "text":
        text = item["text"]
        if echoes is not None:
            prompt_index = index // n
            text = echoes[prompt_index] + text
            logprobs = _echoed(prompts[prompt_index], item, texts)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    content, calls = tool_calls.collect(reader(), item["text"])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


async def whole_chunks(head: dict[str, Any], kind: str, choices: list[dict[str, Any]],
                       usage: dict[str, Any] | None) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response answered whole (`head`: its id, object, created and
    model): one chunk per choice (chat: its message as the delta), the usage chunk when asked, `[DONE]`."""
    for choice in choices:
        if kind == "chat":
            choice = {"index": choice["index"], "delta": choice["message"], "logprobs": choice["logprobs"],
                      "finish_reason": choice["finish_reason"]}
        yield event({**head, "choices": [choice]})
    if usage is not None:
        yield event({**head, "choices": [], "usage": usage})
    yield DONE


def _selected(done: list[dict[str, Any]], candidates: int, n: int, asked: bool) -> list[dict[str, Any]]:
    """best_of: the n best of each prompt's candidates (`best_of.best_n`), prompt by prompt; their
    logprobs, which ranked them, stay in the response only when the request asked for logprobs."""
    chosen = [item for start in range(0, len(done), candidates)
              for item in best_n(done[start:start + candidates], n)]
    return chosen if asked else [{**item, "logprobs": None} for item in chosen]


def _logprobs(kind: str, lps: list[Any] | None, texts: TokenTexts, offset: int = 0) -> dict[str, Any] | None:
    """A choice's `logprobs` (None when the request did not ask for them)."""
    if lps is None:
        return None
    return completion_logprobs(lps, texts, offset) if kind == "text" else chat_logprobs(lps, texts)


def _echoed(prompt: list[int], item: dict[str, Any], texts: TokenTexts) -> dict[str, Any] | None:
    """Completions `logprobs` of an echoed choice: the prompt's tokens, then the generated ones."""
    if item.get("logprobs") is None:
        return None
    head = echo_logprobs(prompt, item.get("prompt_logprobs"), texts)
    tail = completion_logprobs(item["logprobs"], texts, sum(len(t) for t in head["tokens"]))
    return {key: head[key] + tail[key] for key in head}


async def _stream(generations: list[Generation], request_id: str, created: int, model: str, kind: str,
                  prompt_tokens: int, include_usage: bool, texts: TokenTexts,
                  reader: Callable[[], ToolCallReader], *, cached: int = 0,
                  tap: StreamTap | None = None,
                  evidence: StreamEvidence | None = None) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response; `tap` (a release's shadow copy of a one-job request)
    sees every item the client is sent and starts the copy once the stream ended; `evidence` (a
    release's) sees them too, and the error that ends the stream."""
    obj = "text_completion" if kind == "text" else "chat.completion.chunk"
    offsets = [0] * len(generations)  # completions: text offset of each choice's next token
    readers = [reader() for _ in generations]  # chat: each choice's content and tool calls

    def chunk(index: int, text: str | None, finish: str | None, first: bool = False,
              lps: list[Any] | None = None, calls: list[dict[str, Any]] | None = None) -> bytes:
        logprobs = _logprobs(kind, lps, texts, offsets[index])
        if kind == "text":
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            if logprobs is not None:
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({"id": request_id, "object": obj, "created": created, "model": model,
                      "choices": [choice]})

    completion_tokens = [0] * len(generations)
    try:
        if kind == "chat":
            for index in range(len(generations)):
                yield chunk(index, None, None, first=True)
        async for index, item in merge(generations):
            if tap is not None:
                tap.add(item)
            if evidence is not None:
                evidence.item(index, item)
            completion_tokens[index] = item["completion_tokens"]
            finish = OPENAI_FINISH.get(item["finish_reason"]) if item["finished"] else None
            lps = item.get("delta_logprobs")
            if kind == "chat":
                for text, calls, end, part_lps in _chat_parts(readers[index], item, finish, lps):
                    yield chunk(index, text, end, lps=part_lps, calls=calls)
            elif item["delta_text"] or finish or lps:
                yield chunk(index, item["delta_text"], finish, lps=lps)
        if include_usage:
            yield event({"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
                         "usage": _usage(prompt_tokens, sum(completion_tokens), cached)})
    except ApiException as exc:
        if evidence is not None:
            evidence.failed(exc)
        yield event(exc.error.body())
    yield DONE
    if tap is not None:
        tap.end()  # after the live stream, never delaying it (a stream that failed is not copied)


def _chat_parts(reader: ToolCallReader, item: dict[str, Any], finish: str | None, lps: list[Any] | None,
                ) -> list[tuple[str | None, list[dict[str, Any]] | None, str | None, list[Any] | None]]:
    """The chat chunks of one output item as (content, tool_calls, finish_reason, logprobs): its
    content and tool-call pieces as `reader` reads them (held-back text waits for later items), the
    item's logprobs on the first chunk, the finish reason (`tool_calls` once the choice called a tool
    and stopped) on the last."""
    pieces = reader.feed(item["delta_text"] or "")
    if item["finished"]:
        pieces += reader.finish()
    if finish == "stop" and reader.called:
        finish = "tool_calls"
    parts: list[tuple[str | None, list[dict[str, Any]] | None]] = []
    for piece in pieces:
        if isinstance(piece, ContentDelta):
            if parts and parts[-1][1] is None:
                parts[-1] = ((parts[-1][0] or "") + piece.text, None)
            else:
                parts.append((piece.text, None))
        else:
            parts.append((None, [piece.wire()]))
    if not parts and (finish or lps):
        parts = [(None, None)]
    return [(text, calls, finish if i == len(parts) - 1 else None, lps if i == 0 else None)
            for i, (text, calls) in enumerate(parts)]


def _with_user(body: Any, header: str | None) -> Any:
    """The body with `user` from the x-lora-user header when it has none (the release split's key)."""
    return body if body.user is not None or header is None else body.model_copy(update={"user": header})

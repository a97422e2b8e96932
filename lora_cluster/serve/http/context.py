"""What every API route of the ingress shares: limits, tokenizers, model names, the dispatcher.

Several base models (replica groups on several bases) may tokenize differently: the context holds
each base's tokenizer (`tokenizers`, by the base's API name; the first base's is `tokenizer`). A
route first asks which base a request runs on (`request_base`: the base its `model` names, or that of
the group its adapter or merge goes to, as the dispatcher will pick it), then encodes, renders its
chat template, checks token ids, reads tool calls (`tool_parser`: `auto` reads that base's chat
template) and decodes with that base's tokenizer (every call below takes that `base`; None: the first
base), and sends its jobs with `base` set, so the dispatcher runs them on that base only.
`max_prompt_tokens` bounds every base's prompts; each engine refuses prompts over its own
`max_model_len` too. A text prompt or conversation over the limit is fitted to it
(`prompt_truncation: auto`, `truncation`) or refused (`disabled`); token ids over it are refused (the
schema states their bound).

Tokenization and chat templates never run on the event loop. The ingress is one process with one
event loop serving every request; a long prompt or a slow Jinja chat template would stall every
other request's stream while it ran. They run on a thread pool owned by the `ApiContext` instead
(`encode_threads` threads, not asyncio's default executor, which other libraries share): a fast
tokenizer's Rust core releases the GIL, and a Jinja template at least lets the loop run in between.
Each request has at most one job in the pool at a time (a request's prompts are encoded in turn), so
the pool's queue is bounded by the requests in flight, which Serve bounds with
`ingress_max_ongoing_requests`. A job whose request is cancelled still runs to its end in its thread
(a thread cannot be interrupted); its result is dropped. Decoding single tokens for LoRAX stream
events (`token_text`) is cheap and stays on the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Header

from lora_cluster.cluster.sla import SlaClass, SlaClasses, build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.errors import (
    AdapterNotFoundError,
    ConfigError,
    PromptTooLongError,
    RequestAbortedError,
    RequestError,
)
from lora_cluster.serve.http import prompt_limits, tool_calls, truncation
from lora_cluster.serve.http.registrations import AdapterRegistrations
from lora_cluster.serve.http.registry import LocalRegistrations, Registrations
from lora_cluster.serve.http.tools import MAX_TOOLS
from lora_cluster.serve.http.truncation import Prompt
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.ops import metrics
from lora_cluster.serve.ops.metrics_hub import SharedMetrics
from lora_cluster.serve.replica.model import served_name
from lora_cluster.serve.routing.auth import Authenticator, Caller, TenantsSource
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.quotas import Quotas

_END = object()
ENCODE_THREADS = 4
HEADER_PRIORITY = "x-lora-priority"  # request: the SLA class's name
HEADER_PRIORITY_CLASS = "x-lora-priority-class"  # response: the SLA class that served the request
# a route's `x_lora_priority: PriorityHeader = None` parameter reads the x-lora-priority header
PriorityHeader = Annotated[str | None, Header(description="The request's SLA class, by name.")]
R = TypeVar("R")


@dataclass
class ApiContext:
    """Shared by the routes of one ingress. Call `close()` when the ingress goes away."""

    config: ServeConfig
    tokenizer: Any  # the first base's
    dispatcher: Dispatcher | GroupedDispatcher
    tokenizers: dict[str, Any] = field(default_factory=dict)  # each base's, by API name (absent: the first's)
    # adapters loaded through the vLLM API: this process's, or shared by every ingress (http.registry);
    # an AdapterRegistrations given here is kept in this process
    registrations: Registrations | AdapterRegistrations = field(default_factory=LocalRegistrations)
    encode_threads: int = ENCODE_THREADS
    tenants: TenantsSource | None = None  # None: no tenants file, every route is open
    quotas: Quotas | None = None  # the tenants' quota ledger (None: quotas are not enforced)
    metrics_hub: SharedMetrics | None = None  # several ingress replicas: /metrics sums them (ops.metrics_hub)
    sla: SlaClasses = field(init=False, repr=False)
    authenticate: Authenticator = field(init=False, repr=False)  # THE auth dependency (routing.auth)
    _pool: ThreadPoolExecutor = field(init=False, repr=False)
    _chat_limits: dict[str | None, prompt_limits.ChatLimits] = field(init=False, repr=False,
                                                                     default_factory=dict)  # by base

    def __post_init__(self) -> None:
        if self.encode_threads < 1:
            raise ConfigError(f"encode_threads must be at least 1, got {self.encode_threads}")
        if isinstance(self.registrations, AdapterRegistrations):
            self.registrations = LocalRegistrations(self.registrations)
        self.sla = build_sla_classes(self.config)
        self.authenticate = Authenticator(self.tenants, self.quotas, self.config.open_routes)
        self._pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="lora-ingress-encode")

    def close(self) -> None:
        """Stop the tokenizer threads (jobs not started yet are dropped) and the metrics pushes."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.metrics_hub is not None:
            self.metrics_hub.stop()

    @property
    def base_name(self) -> str:
        """The API name of the (first group's) base model."""
        return served_name(self.config)

    @property
    def base_names(self) -> list[str]:
        """Every base model's API name (several with replica groups on several bases), first first."""
        bases = getattr(self.dispatcher, "bases", None) or []
        return list(dict.fromkeys([self.base_name, *bases]))

    def base_for(self, model: str | None) -> str | None:
        """The base model's API name when `model` names a base (by API name; the first base also by
        its `model`), else None (an adapter, or no `model`: the first base's group decides)."""
        if model == self.config.model:
            return self.base_name
        return model if model in self.base_names else None

    def tokenizer_of(self, base: str | None) -> Any:
        """The tokenizer of a base model, by API name (None, or the first base: `tokenizer`)."""
        return self.tokenizer if base is None else self.tokenizers.get(base, self.tokenizer)

    def vocab_size_of(self, base: str | None) -> int | None:
        """Token ids a prompt for that base may use: [0, vocab_size), its tokenizer's vocabulary with
        its added tokens (None: no tokenizer, e.g. a schema-only app, or one that does not say its size)."""
        tokenizer = self.tokenizer_of(base)
        return len(tokenizer) if isinstance(tokenizer, Sized) else None

    def prompt_limit_of(self, base: str | None) -> int:
        """The most tokens a prompt for that base may have (`prompt_limits.prompt_limit`)."""
        return prompt_limits.prompt_limit(self.config, self.tokenizer_of(base))

    @property
    def prompt_limit(self) -> int:
        """The largest prompt limit over the bases (the API schema's bound on token-id prompts; each
        request is checked against its own base's, `prompt_limit_of`)."""
        return max(self.prompt_limit_of(b) for b in [None, *self.tokenizers])

    def chat_limits_of(self, base: str | None) -> prompt_limits.ChatLimits:
        """The most messages and tools a chat request for that base may have
        (`prompt_limits.chat_limits`), measured once per base with its chat template, on the calling
        thread (`chat_limits` measures on the tokenizer threads)."""
        if base not in self._chat_limits:
            render = functools.partial(self._render_chat, base=base)
            limit = self.prompt_limit_of(base)
            self._chat_limits[base] = prompt_limits.chat_limits(self.config, limit, MAX_TOOLS, render)
        return self._chat_limits[base]

    async def chat_limits(self, base: str | None) -> prompt_limits.ChatLimits:
        """`chat_limits_of`, measured on the tokenizer threads the first time."""
        if base in self._chat_limits:
            return self._chat_limits[base]
        return await self._off_loop(self.chat_limits_of, base)

    @property
    def chat_limits_schema(self) -> prompt_limits.ChatLimits:
        """The largest chat limits over the bases (the API schema's `maxItems` of messages and tools)."""
        limits = [self.chat_limits_of(b) for b in [None, *self.tokenizers]]
        return prompt_limits.ChatLimits(max(x.messages for x in limits), max(x.tools for x in limits))

    @property
    def vocab_size(self) -> int | None:
        """The largest base vocabulary (the API schema's bound on token ids; each request is checked
        against its own base's, `vocab_size_of`)."""
        sizes = [self.vocab_size_of(b) for b in [None, *self.tokenizers]]
        return None if None in sizes else max(s for s in sizes if s is not None)

    def tool_parser(self, base: str | None) -> tool_calls.ParserName:
        """The tool-call parser of a base's outputs: its `tool_call_parser`, `auto` read from its chat
        template."""
        return tool_calls.parser_for(self.config.tool_call_parser,
                                     getattr(self.tokenizer_of(base), "chat_template", None))

    async def request_base(self, model: str | None, adapter: str | None, merged: Sequence[str] | None,
                           tenant: str | None) -> str | None:
        """The API name of the base model a request runs on (None: a one-base cluster, the first base):
        the base its `model` names, or that of the group its adapter (or merge) goes to. The dispatcher
        answers 404/409/400 here as it would when starting the request."""
        grouped = self.dispatcher
        if not isinstance(grouped, GroupedDispatcher) or not grouped.several_bases:
            return self.base_for(model)
        return await grouped.base_of(adapter, tenant, self.base_for(model), merged)

    def adapter_for(self, model: str | None, caller: Caller, *, merging: bool = False) -> str | None:
        """The adapter id a request's `model` names (None: the base model); a 404 with the body of an
        unknown adapter when the caller's tenant may not use it (existence does not leak). `merging`:
        the request merges adapters (`merged_adapters`) onto the base model it names; the merge's own
        adapter ids are checked then (`schemas.merge_of`), so a tenant without `base_model` access
        may merge adapters it owns."""
        adapter = None if model is None or self.base_for(model) is not None else model
        if not (merging and adapter is None) and not caller.may_use(adapter):
            raise ApiException(describe(AdapterNotFoundError(model or self.base_name, "not accessible")))
        return adapter

    def adapter_path(self, adapter_id: str | None) -> str | None:
        """The path of an adapter registered through vLLM's load_lora_adapter (None: not registered)."""
        return None if adapter_id is None else self.registrations.path(adapter_id)

    def priority_class(self, header: str | None, priority: int | None = None,
                       caller: Caller | None = None) -> SlaClass:
        """The request's SLA class: the `x-lora-priority` header's class (400 naming the known classes
        when there is no such class), else the class of the body's integer `priority`, else the
        caller's tenant's `priority_class`, else the default. A tenant's class is also the most urgent
        it gets: a more urgent class asked for is lowered to the tenant's (the response's
        `x-lora-priority-class` says which class served)."""
        tenant = None if caller is None else caller.principal.tenant
        floor = None if tenant is None else self.sla.by_name.get(tenant.priority_class or "")
        try:
            asked = self.sla.resolve(name=None if header is None else header.strip(), priority=priority)
        except RequestError as exc:
            raise ApiException(describe(RequestError(f"{HEADER_PRIORITY}: {exc}"))) from exc
        if floor is None:
            return asked
        if header is None and priority is None:
            return floor
        return floor if asked.priority < floor.priority else asked

    async def _off_loop(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` on the tokenizer threads; the loop serves other requests meanwhile."""
        loop = asyncio.get_running_loop()
        # the thread runs in a copy of this context, so its log lines keep the request id
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._pool, call)

    async def encode(self, prompt: str | list[int], *, special: bool = True, base: str | None = None,
                     ) -> Prompt:
        """Prompt token ids (as `base`'s engine would tokenize the text), within the prompt limit:
        a longer text keeps its last tokens with prompt_truncation auto (`truncation`), and is a 400
        prompt_too_long with disabled. Text is tokenized on the tokenizer threads; token ids are only
        checked (against that base's vocabulary, and the limit the schema states for them)."""
        if isinstance(prompt, str):
            return await self._off_loop(self._fit_text, prompt, special, base)
        ids = list(prompt)
        vocab = self.vocab_size_of(base)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ApiException(describe(RequestError(f"prompt token ids must be in [0, {vocab})")))
        return self._checked(Prompt(ids), base)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          base: str | None = None) -> Prompt:
        """Token ids of a conversation rendered with `base`'s chat template (+ generation prompt),
        rendered and tokenized on the tokenizer threads (one job). `tools` (OpenAI's function
        definitions) go to the template as `tools`, which the template renders as it was trained to.
        A conversation over the prompt limit drops its oldest messages with prompt_truncation auto
        (`truncation.fit_conversation`), and is a 400 prompt_too_long with disabled."""
        if not getattr(self.tokenizer_of(base), "chat_template", None):
            raise ApiException(describe(RequestError("the base model's tokenizer has no chat template")))
        return await self._off_loop(self._fit_chat, messages, tools, base)

    def _fit_text(self, text: str, special: bool, base: str | None) -> Prompt:
        """Runs on a tokenizer thread."""
        tokenizer = self.tokenizer_of(base)
        ids = tokenizer.encode(text, add_special_tokens=special)
        if self._truncates:
            return self._checked(truncation.keep_last(ids, self.prompt_limit_of(base), _bos(tokenizer)), base)
        return self._checked(Prompt(ids), base)

    def _fit_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  base: str | None) -> Prompt:
        """Runs on a tokenizer thread."""
        if not self._truncates:
            return self._checked(Prompt(self._render_chat(messages, tools, base)), base)
        render = functools.partial(self._render_chat, tools=tools, base=base)
        fitted = truncation.fit_conversation(messages, render, self.prompt_limit_of(base),
                                             _bos(self.tokenizer_of(base)))
        return self._checked(fitted, base)

    @property
    def _truncates(self) -> bool:
        return self.config.prompt_truncation == "auto"

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     base: str | None) -> list[int]:
        """Runs on a tokenizer thread."""
        tokenizer = self.tokenizer_of(base)
        extra = {} if tools is None else {"tools": tools}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 **extra)
        except Exception as exc:  # a template may reject roles or orders it does not support
            raise ApiException(describe(RequestError(f"cannot apply the chat template: {exc}"))) from exc
        return tokenizer.encode(text, add_special_tokens=False)

    def _checked(self, prompt: Prompt, base: str | None) -> Prompt:
        if not prompt.ids:
            raise ApiException(describe(RequestError("the prompt is empty")))
        limit = self.prompt_limit_of(base)
        if len(prompt.ids) > limit:
            raise ApiException(describe(PromptTooLongError(len(prompt.ids), limit)))
        if prompt.truncated:
            metrics.TRUNCATED_PROMPTS.inc()
            metrics.TRUNCATED_PROMPT_TOKENS.inc(prompt.truncated)
        return prompt

    async def decode(self, ids: list[int], base: str | None = None) -> str:
        """The text of token ids in `base`'s vocabulary (completions' `echo` of a token prompt), on the
        tokenizer threads."""
        return await self._off_loop(self.tokenizer_of(base).decode, ids)

    def token_text(self, token_id: int, base: str | None = None) -> str:
        return self.tokenizer_of(base).decode([token_id])

    def is_special(self, token_id: int, base: str | None = None) -> bool:
        return token_id in self.tokenizer_of(base).all_special_ids

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def _bos(tokenizer: Any) -> int | None:
    """The tokenizer's BOS token id, where it has one (kept first when a prompt is truncated)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if isinstance(bos, int) else None


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(index, item) of several generations as they arrive; cancels them all when left early."""
    if len(generations) == 1:
        async for item in generations[0].items():
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for item in generation.items():
                queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        except BaseException as exc:  # a cancelled choice ends the response with an error, not silently
            error = RequestAbortedError(f"choice {index} was cancelled ({type(exc).__name__})")
            queue.put_nowait((index, error))
            raise
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for g in generations:
            g.cancel()


async def finals(generations: list[Generation]) -> list[dict[str, Any]]:
    """Final items of every generation; on an error the others are cancelled and it is raised."""
    try:
        return list(await asyncio.gather(*(g.final() for g in generations)))
    except BaseException:
        for g in generations:
            g.cancel()
        raise

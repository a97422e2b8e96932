"""Each base model's tokenizer, used off the event loop: prompts encoded within the prompt limit, chat
templates rendered, tokens decoded, and the limits a prompt and a chat request may have.

Several base models (replica groups on several bases) may tokenize differently: `tokenizers` holds
each base's tokenizer by the base's API name (the first base's is `tokenizer`); every call takes the
request's `base` (None: the first base). `max_prompt_tokens` bounds every base's prompts; each engine
refuses prompts over its own `max_model_len` too. A text prompt or conversation over the limit is
fitted to it (`prompt_truncation: auto`, `truncation`) or refused (`disabled`); token ids over it are
refused (the schema states their bound).

Tokenization and chat templates never run on the event loop. The ingress is one process with one
event loop serving every request; a long prompt or a slow Jinja chat template would stall every
other request's stream while it ran. They run on a thread pool owned here instead (`threads`
threads, not asyncio's default executor, which other libraries share): a fast tokenizer's Rust core
releases the GIL, and a Jinja template at least lets the loop run in between. Each request has at
most one job in the pool at a time (a request's prompts are encoded in turn), so the pool's queue is
bounded by the requests in flight, which Serve bounds with `ingress_max_ongoing_requests`. A job whose
request is cancelled still runs to its end in its thread (a thread cannot be interrupted); its result
is dropped. Decoding single tokens for LoRAX stream events (`token_text`) is cheap and stays on the
loop. Call `close()` when the ingress goes away.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lora_cluster.config import ServeConfig
from lora_cluster.errors import ConfigError, PromptTooLongError, RequestError
from lora_cluster.serve.http import prompt_limits, tool_calls, truncation
from lora_cluster.serve.http.tools import MAX_TOOLS
from lora_cluster.serve.http.truncation import Prompt
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.ops import metrics

R = TypeVar("R")
ENCODE_THREADS = 4  # the tokenizer threads of one ingress


class Tokenization:
    """The tokenizers of one ingress's base models and the threads they run on."""

    def __init__(self, config: ServeConfig, tokenizer: Any, tokenizers: dict[str, Any] | None = None,
                 threads: int = ENCODE_THREADS):
        if threads < 1:
            raise ConfigError(f"encode_threads must be at least 1, got {threads}")
        self.config, self.tokenizer, self.tokenizers = config, tokenizer, dict(tokenizers or {})
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="lora-ingress-encode")
        self._chat_limits: dict[str | None, prompt_limits.ChatLimits] = {}  # by base

    def close(self) -> None:
        """Stop the tokenizer threads (jobs not started yet are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        return tool_calls.parser_for(self.config.api.tool_call_parser,
                                     getattr(self.tokenizer_of(base), "chat_template", None))

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
        return self.config.api.prompt_truncation == "auto"

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


def _bos(tokenizer: Any) -> int | None:
    """The tokenizer's BOS token id, where it has one (kept first when a prompt is truncated)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if isinstance(bos, int) else None

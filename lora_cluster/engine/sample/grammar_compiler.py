"""Compile output constraints (`GuidedSpec`) into llguidance matchers, off the event loop and the step loop.

Policy:
- The llguidance tokenizer of the base model is built once per engine, lazily: by the compile worker,
  before the first constrained request's grammar. Engine start and unconstrained requests never wait
  for it.
- A spec compiles once: spec -> llguidance grammar -> a validated `LLMatcher` whose first mask is
  computed (its lexer is built lazily, so that cost is paid here, not in a step). Each constrained
  sequence gets a copy of it (`CompiledGrammar.matcher`, under a microsecond). Results are cached in
  a bounded LRU keyed by the spec (`guided_grammar_cache_size`), refusals included, so a bad schema
  sent again is refused without compiling again.
- An invalid or unsupported constraint is a `RequestError` naming the construct (llguidance names
  the unimplemented keys, e.g. `Unimplemented keys: ["uniqueItems"]`; llguidance refuses what it
  cannot enforce rather than ignoring it).
- A compile that runs longer than `timeout_s` (its own time: not the wait for the tokenizer or for
  the worker) is a `RequestError` naming the bound, as soon as the bound passes (`Compile.outcome`)
  and for every later request with the same spec (the late result is replaced by the refusal). The
  worker thread cannot be interrupted: llguidance's parser limits bound what one compile can do.
- JSON whitespace: between two JSON tokens nothing, one space, or one line break with up to
  `JSON_INDENT_MAX` spaces or tabs (`json.dumps` output, compact or indented, fits), so that a model
  cannot loop on whitespace until `max_tokens` (llguidance's default allows any run of it).

Thread-safety: every method may be called from any thread (one lock over the cache).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from lora_cluster.errors import RequestError
from lora_cluster.request.guided_spec import GuidedKind, GuidedSpec

COMPILE_WORKERS = 2  # compile threads: one long compile does not queue every other spec behind it
JSON_INDENT_MAX = 16  # spaces or tabs of indentation after a line break inside JSON
# between two JSON tokens: nothing, one space, or one line break and its indentation
JSON_WHITESPACE = f"(\\r?\\n[ \\t]{{0,{JSON_INDENT_MAX}}}| )?"
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}
ERROR_CHARS = 400  # of llguidance's message in a RequestError


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar of `spec` (not validated: `LLMatcher` does that). A `grammar` spec is
    Lark, or GBNF (llama.cpp's syntax, which vLLM's `guided_grammar` also takes) converted to Lark."""
    kind = spec.kind
    try:
        if kind is GuidedKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
        if kind is GuidedKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
        if kind is GuidedKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if kind is GuidedKind.CHOICE:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choices)))
        return llguidance.grammar_from("grammar", spec.text)
    except ValueError as e:
        raise _refusal(spec, str(e)) from None


def _refusal(spec: GuidedSpec, message: str) -> RequestError:
    message = message.strip()
    if len(message) > ERROR_CHARS:
        message = message[:ERROR_CHARS] + "..."
    return RequestError(f"the {spec.kind.value} constraint is invalid or not supported: {message}")


def grammar_tokenizer(
    tokenizer: object, vocab_size: int, eos_token_ids: Collection[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer: `vocab_size` is the logits' width (ids past
    the tokenizer's own are never allowed); a grammar that accepts allows every id of `eos_token_ids`."""
    import llguidance.hf  # imports transformers: only where a tokenizer is built

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


class CompiledGrammar:
    """A validated grammar; `matcher()` gives each constrained sequence its own matcher."""

    def __init__(self, spec: GuidedSpec, pristine: llguidance.LLMatcher, compile_s: float):
        self.spec, self._pristine, self.compile_s = spec, pristine, compile_s

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one)."""
        return self._pristine.deep_copy()


class Compile:
    """One spec's compile, queued, running or done. `outcome()` says where it stands."""

    def __init__(self, spec: GuidedSpec, timeout_s: float, clock: Callable[[], float]):
        self.spec, self.timeout_s, self._clock = spec, timeout_s, clock
        self.future: Future[CompiledGrammar] = Future()
        self.started_at: float | None = None  # when the compile itself began (tokenizer ready)

    def outcome(self) -> CompiledGrammar | RequestError | None:
        """The compiled grammar, the refusal, or None while it compiles within its bound."""
        if self.future.done():
            error = self.future.exception()
            return error if isinstance(error, RequestError) else self.future.result()
        started = self.started_at
        if started is not None and self._clock() - started > self.timeout_s:
            return self.timeout_error()
        return None

    def timeout_error(self) -> RequestError:
        return RequestError(
            f"the {self.spec.kind.value} constraint took longer than guided_compile_timeout_s="
            f"{self.timeout_s:g} s to compile"
        )


class GrammarCompiler:
    """The compile cache and worker of one engine (one base model's tokenizer)."""

    def __init__(
        self,
        build_tokenizer: Callable[[], llguidance.LLTokenizer],
        *,
        cache_size: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._build = build_tokenizer  # `grammar_tokenizer` of the engine's tokenizer
        self.cache_size, self.timeout_s, self._clock = cache_size, timeout_s, clock
        self._cache: OrderedDict[GuidedSpec, Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self.tokenizer_build_s: float | None = None  # measured once built

    def compile(self, spec: GuidedSpec) -> Compile:
        """The cached compile of `spec`, or a new one queued on the worker (never blocks)."""
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                return entry
            entry = Compile(spec, self.timeout_s, self._clock)
            self._cache[spec] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # sequences keep their matchers; only the cache forgets
            tokenizer = self._tokenizer_future()
        tokenizer.add_done_callback(lambda t: self._queue(entry, t))
        return entry

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer_future(self) -> Future[llguidance.LLTokenizer]:
        """Started on first use (under the lock)."""
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._build_tokenizer)
        return self._tokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        started = time.perf_counter()
        built = self._build()
        self.tokenizer_build_s = time.perf_counter() - started
        return built

    def _queue(self, entry: Compile, tokenizer: Future[llguidance.LLTokenizer]) -> None:
        try:
            self._pool.submit(self._run, entry, tokenizer)
        except RuntimeError:  # closed: the engine is shutting down
            entry.future.set_exception(RequestError("the engine is shutting down"))

    def _run(self, entry: Compile, tokenizer: Future[llguidance.LLTokenizer]) -> None:
        """Compile `entry` on a worker thread; its future always ends set."""
        try:
            entry.started_at = self._clock()
            compiled = self._compile(entry.spec, tokenizer.result())
            if self._clock() - entry.started_at > entry.timeout_s:
                raise entry.timeout_error()
            entry.future.set_result(compiled)
        except RequestError as e:
            entry.future.set_exception(e)
        except Exception as e:  # the tokenizer could not be built, or llguidance failed internally
            entry.future.set_exception(RequestError(f"the {entry.spec.kind.value} constraint could not be "
                                                    f"compiled: {type(e).__name__}: {str(e)[:ERROR_CHARS]}"))

    def _compile(self, spec: GuidedSpec, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer now rather than in the first step
        if matcher.is_error():
            raise _refusal(spec, matcher.get_error())
        return CompiledGrammar(spec, matcher, time.perf_counter() - started)

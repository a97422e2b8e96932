"""Request bodies of the HTTP API (pydantic) and their mapping to the engine's SamplingParams.

Field names follow the APIs they imitate: OpenAI (plus vLLM's `top_k`, `ignore_eos`,
`stop_token_ids`), LoRAX/TGI, and vLLM's adapter admin routes. Parameters the engine cannot honour
(`suffix`, `typical_p`...) are refused with a 400 naming them rather than silently ignored.
Output constraints (`response_format`, vLLM's `structured_outputs` and `guided_*`, LoRAX's
`parameters.response_format`) are the request models of `structured_output`, mapped there to the
engine's `GuidedSpec`. `best_of`: OpenAI (vLLM) returns the n of best_of candidates with the highest
cumulative logprob; LoRAX the one with the highest mean logprob per token.
Unknown fields: the OpenAI bodies (completions, chat) refuse an unknown top-level field with a 400
naming it, as the OpenAI API does ("Unrecognized request argument supplied"), so that a typo or a
parameter this server does not implement is never silently dropped; their nested objects (messages,
stream_options) and the LoRAX and vLLM admin bodies ignore unknown fields, as LoRAX/TGI and vLLM do.
Input limits (400 naming the limit): `max_new_tokens`, `max_n`, `max_prompts` (prompts in one
completions request), `max_chat_messages` (messages in one chat request), `max_stop_sequences` and
`max_stop_length` (stop strings). Log-probabilities (OpenAI
`logprobs` / `top_logprobs`, LoRAX `details`, `decoder_input_details`, `return_k_alternatives`)
ask for at most `max_logprobs` alternatives per token (400 above). Values are validated strictly
(a boolean must be a JSON boolean, an integer a JSON integer), as the OpenAPI schema states them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from lora_cluster.adapter_format import ADAPTER_ID_PATTERN, MAX_ADAPTER_ID_LEN
from lora_cluster.config import ServeConfig
from lora_cluster.engine import SamplingParams
from lora_cluster.engine.guided_spec import GuidedSpec
from lora_cluster.engine.sampling import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX_TOKENS
from lora_cluster.serve.http.best_of import lorax_rule, lorax_stream_rule, openai_rules
from lora_cluster.serve.http.structured_output import (
    Choices,
    Grammar,
    LoraxResponseFormat,
    Pattern,
    ResponseFormat,
    SchemaOrText,
    StructuredOutputs,
    one_constraint_rule,
    openai_guided,
)
from lora_cluster.serve.http.tools import (
    MAX_TOOLS,
    MessageToolCall,
    ToolChoice,
    ToolDefinition,
    ToolUse,
    tool_rules,
    tool_use,
)
from lora_cluster.serve.http_errors import bad_request
from lora_cluster.store.merge import MERGED_PREFIX, SIGN_METHODS, STRATEGIES, MergeSpec

NonEmptyStr = Annotated[str, Field(min_length=1)]
TOKEN_ID_KEY = r"^(0|[1-9][0-9]*)$"  # a token id as a JSON object key: decimal, no sign or leading zero
SEED = "Any non-negative integer, taken modulo 2**63."
NonEmptyIds = Annotated[list[int], Field(min_length=1)]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]


def _only(schema: dict[str, Any], what: str) -> WithJsonSchema:
    """The schema of a parameter the server accepts only with these values (anything else is a 400
    naming it as unsupported), or null."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}], "description": f"Unsupported: {what}."})


# unsupported parameters, as the OpenAPI schema states them: the values that change nothing
ONE = _only({"type": "number", "minimum": 1, "maximum": 1}, "only 1 (the default)")
ONE_INT = _only({"type": "integer", "minimum": 1, "maximum": 1}, "only 1 (the default)")
EMPTY_STRING = _only({"type": "string", "maxLength": 0}, "only empty")
NULL = WithJsonSchema({"type": "null", "description": "Unsupported: only null."})
FALSE = WithJsonSchema({"type": "boolean", "enum": [False], "description": "Unsupported: only false."})


def _json_integers(value: Any) -> Any:
    """`value` with integral floats as ints: JSON Schema's integers include 2.0 (the body's depth is
    bounded before it is parsed, see `max_json_depth`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_json_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_integers(v) for k, v in value.items()}
    return value


class _Body(BaseModel):
    # strict: a value must have the type the OpenAPI schema states (no `"stream": 0` or `"n": "2"`,
    # which lax pydantic would coerce while the schema promises a 400); an int is still a number,
    # and an integral number (2.0) an integer, as in JSON Schema
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        return _json_integers(data)


class StreamOptions(_Body):
    include_usage: bool = False


_NOT_DARE = [s for s in STRATEGIES if not s.startswith("dare")]


class MergedAdaptersBody(_Body):
    """LoRAX's `merged_adapters` (lorax-client's `MergedAdapters`): merge these adapters for the request
    (see `lora_cluster.store.merge`)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # dare divides the kept entries by density
        {"properties": {"merge_strategy": {"enum": [*_NOT_DARE, None]}}},
        {"properties": {"density": {"exclusiveMinimum": 0}}}]})

    ids: list[Annotated[str, Field(json_schema_extra={"not": {"pattern": f"^{MERGED_PREFIX}"}})]] = Field(
        min_length=1, description="Adapters to merge (1 to max_merged_adapter_ids; not merged ones).")
    weights: list[float] = Field(min_length=1, description="One weight per adapter.")
    merge_strategy: Literal[STRATEGIES] | None = Field(  # type: ignore[valid-type]
        None, description="linear (default), ties, dare_linear or dare_ties.")
    density: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of entries kept by ties and dare, in "
                           "[0, 1] (above 0 for dare).")
    majority_sign_method: Literal[SIGN_METHODS] | None = Field(  # type: ignore[valid-type]
        None, description="total (default) or frequency.")

    def spec(self, limits: ServeConfig) -> MergeSpec:
        """The validated merge (RequestError naming the field: a 400)."""
        return MergeSpec.parse(self.ids, self.weights, self.merge_strategy, self.density,
                               self.majority_sign_method, max_ids=limits.max_merged_adapter_ids)


class _OpenAISampling(_Body):
    model_config = ConfigDict(extra="forbid")  # as the OpenAI API: unknown top-level fields are a 400

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="vLLM extension: -1 or 0 = no top-k cut.")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension.")
    seed: int | None = Field(None, ge=0, description=SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Minus this for every token already "
                                    "in the output (OpenAI).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Minus this times the token's count "
                                     "in the output (OpenAI).")
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0, description="vLLM extension: tokens of prompt "
                                      "and output: logit / p when positive, logit * p otherwise; 1 is off.")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: EOS and stop_token_ids cannot be "
                            "generated, and stop strings do not stop, before this many tokens; capped at "
                            "the request's max tokens.")
    logit_bias: dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)],
                     Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = Field(
        None, max_length=LOGIT_BIAS_MAX_TOKENS, description="Token id (a string) -> added to its logit, "
        f"in [-100, 100] (OpenAI); at most {LOGIT_BIAS_MAX_TOKENS} ids.")
    best_of: int | None = Field(None, ge=1, description="Generate this many candidates per prompt and "
                                "return the n with the highest cumulative logprob (vLLM); n <= best_of <= "
                                "max_n; not with stream unless equal to n.")
    user: str | None = None
    merged_adapters: MergedAdaptersBody | None = Field(
        None, description="LoRAX extension: merge these adapters for the request; `model` then names the "
        "base model.")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema "
                                                   "(OpenAI): the output's form, enforced while decoding.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension (0.10.2 and "
                                                         "later): one output constraint.")
    guided_json: SchemaOrText | None = Field(None, description="vLLM extension (before 0.12): the output "
                                             "is JSON that fits this schema.")
    guided_regex: Pattern | None = Field(None, description="vLLM extension (before 0.12).")
    guided_choice: Choices | None = Field(None, description="vLLM extension (before 0.12).")
    guided_grammar: Grammar | None = Field(None, description="vLLM extension (before 0.12).")
    priority: int | None = Field(
        None, description="vLLM extension: lower is more urgent; picks the SLA class with that priority "
        "(see SlaClasses.resolve) unless the x-lora-priority header names one.")

    def _check_shared(self, limits: ServeConfig) -> None:
        """What both routes check: best_of (n <= best_of <= max_n; a selection is not streamed, as in
        vLLM and OpenAI) and the output constraint (at most one)."""
        if self.best_of is not None:
            if self.best_of < self.n:
                raise bad_request(f"best_of={self.best_of} must be at least n={self.n}")
            if self.best_of > limits.max_n:
                raise bad_request(f"best_of={self.best_of} exceeds the limit of {limits.max_n} (max_n)")
            if self.stream and self.selects:
                raise bad_request("unsupported parameter(s): best_of with stream (the best choices are "
                                  "known only at the end)", code="unsupported_parameter")
        _ = self.output_constraint

    @property
    def candidates(self) -> int:
        """Generations per prompt: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def selects(self) -> bool:
        """Whether the n choices are selected among more candidates (best_of > n)."""
        return self.candidates > self.n

    @cached_property
    def output_constraint(self) -> GuidedSpec | None:
        """The output constraint of response_format, structured_outputs or a guided_* field (400 when
        more than one is given)."""
        return openai_guided(self.response_format, self.structured_outputs, self.guided_json,
                             self.guided_regex, self.guided_choice, self.guided_grammar)

    def sampling(self, limits: ServeConfig, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """Engine parameters of choice `choice` (choice i of a seeded request uses seed + i; with
        best_of, candidate i). Candidates to select among report their tokens' logprobs (the ranking)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        check_max_tokens(max_tokens, limits, "max_tokens")
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        logprobs = self.logprobs_k()
        if logprobs is None and self.selects:
            logprobs = 0
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), seed=seed, stop=check_stops(_stops(self.stop), limits),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_k(),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=min(self.min_tokens, max_tokens),
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            guided=self.output_constraint,
        )

    def logprobs_k(self) -> int | None:
        """Alternatives per generated token the request asks for (None: no logprobs)."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token the request asks for (None: no prompt logprobs)."""
        return None


class CompletionRequest(_OpenAISampling):
    model_config = ConfigDict(json_schema_extra={"examples": [  # the README's quickstart (demo zoo)
        {"model": "a3", "prompt": "the river", "max_tokens": 16, "temperature": 0},
        {"model": "demo", "prompt": "the river", "max_tokens": 4, "stream": True}],
        "allOf": [{"anyOf": [{"properties": {"echo": {"enum": [False]}}},  # echo is not streamed
                             {"properties": {"stream": {"enum": [False]}}}]}]})

    prompt: NonEmptyStr | NonEmpty[list[NonEmptyStr]] | NonEmptyIds | NonEmpty[list[NonEmptyIds]] = Field(
        description="A prompt, prompts, token ids, or lists of token ids; none of them empty.")
    echo: bool = Field(False, description="Prepend the prompt to each choice's text (and, with logprobs, "
                       "its tokens' logprobs, the first null); not with stream.")
    suffix: Annotated[str | None, EMPTY_STRING] = None
    logprobs: int | None = Field(None, ge=0, description="The chosen token's logprob and this many "
                                 "alternatives per token (at most max_logprobs).")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif p and all(isinstance(t, int) for t in p):
            out = [list(p)]
        else:
            out = list(p)
        if not out or any(len(x) == 0 for x in out):
            raise bad_request("prompt must not be empty")
        return out

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None

    def check(self, limits: ServeConfig) -> None:
        self._check_shared(limits)
        check_logprobs(self.logprobs, limits, "logprobs")
        if self.suffix:
            raise bad_request("unsupported parameter(s): suffix", code="unsupported_parameter")
        if self.echo and self.stream:
            raise bad_request("unsupported parameter(s): echo with stream", code="unsupported_parameter")
        check_n(self.n, limits)
        count = len(self.prompts())
        if count > limits.max_prompts:
            raise bad_request(f"{count} prompts exceed the limit of max_prompts={limits.max_prompts}")


class TextPart(_Body):
    """A part of a message's content: text only (another `type`, e.g. image_url, is a 400)."""

    type: Literal["text"]
    text: str = ""


class ChatMessage(_Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # a tool result names the call it answers
        {"properties": {"role": {"not": {"const": "tool"}}}},
        {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}]})

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(None, description="A `tool` message's answer to this call (required "
                                     "there).")
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "a3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
        {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
         "stream": True, "stream_options": {"include_usage": True}}],
        "allOf": [{"anyOf": [{"properties": {"top_logprobs": {"type": "null"}}},  # needs logprobs: true
                             {"properties": {"logprobs": {"enum": [True]}}, "required": ["logprobs"]}]}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, description="Alternatives per token with logprobs: "
                                     "true (at most max_logprobs; OpenAI allows 0-20).")
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS, description="Functions the "
                                              "model may call (OpenAI), passed to the chat template.")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools: calls "
                                           "read from the output), required or a named function (both "
                                           "enforced by the grammar).")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true).")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self, limits: ServeConfig) -> None:
        if len(self.messages) > limits.max_chat_messages:
            raise bad_request(f"{len(self.messages)} messages exceed the limit of "
                              f"max_chat_messages={limits.max_chat_messages}")
        self._check_shared(limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true")
        check_logprobs(self.top_logprobs, limits, "top_logprobs")
        self.tool_use()
        for message in self.messages:
            if message.role == "tool" and message.tool_call_id is None:
                raise bad_request("a message of role tool needs the tool_call_id it answers")
        if self.max_completion_tokens is not None:  # checked even when max_tokens wins
            check_max_tokens(self.max_completion_tokens, limits, "max_completion_tokens")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        check_n(self.n, limits)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: role and content, and an assistant's
        `tool_calls`, a tool result's `tool_call_id`, a `name` where the client sent them."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [call.for_template() for call in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out

    def tool_use(self) -> ToolUse:
        """What the request's tools ask for (400 naming the field when they do not fit together)."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling(self, limits: ServeConfig, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """As for every OpenAI request, plus the grammar of a forced tool call (`required` or a named
        function), which cannot be combined with another output constraint (a 400)."""
        params = super().sampling(limits, default_max_tokens, choice)
        forced = self.tool_use().guided()
        if forced is None:
            return params
        if params.guided is not None:
            raise bad_request("tool_choice required or a named function forces the output's form; it "
                              "cannot be combined with another output constraint (response_format, "
                              "structured_outputs, guided_*)")
        return replace(params, guided=forced)


class LoraxParameters(_Body):
    adapter_id: str | None = None
    adapter_source: Literal["hub", "local", "s3"] | None = None
    api_token: str | None = None
    merged_adapters: MergedAdaptersBody | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=1)
    ignore_eos_token: bool = False
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0, description="Tokens of prompt and "
                                             "output get logit / p when positive, logit * p otherwise.")
    return_full_text: bool = False
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, description=SEED)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncate: Annotated[int | None, NULL] = None
    typical_p: Annotated[float | None, ONE] = None
    best_of: int | None = Field(None, ge=1, description="Generate this many (at most max_n) and return the "
                                "one with the highest mean logprob per token (LoRAX); above 1 it needs "
                                "sampling, no seed, and no stream.")
    watermark: Annotated[bool, FALSE] = False
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = Field(None, ge=1, description="Alternatives per generated token "
                                              "(at most max_logprobs).")
    response_format: LoraxResponseFormat | None = Field(None, description="json_object or json_schema "
                                                        "with a JSON schema (without one, any JSON object)"
                                                        ", enforced while decoding; text is no constraint.")

    def check(self) -> None:
        unsupported = {
            "truncate": self.truncate is not None,
            "typical_p": self.typical_p not in (None, 1.0),
            "watermark": self.watermark,
            "adapter_source": self.adapter_source not in (None, "hub", "local", "s3"),
        }
        names = [name for name, bad in unsupported.items() if bad]
        if names:
            raise bad_request(f"unsupported parameter(s): {', '.join(names)}", code="unsupported_parameter")

    def check_best_of(self, limits: ServeConfig, streamed: bool) -> None:
        """LoRAX's rules for best_of above 1: sampling, no seed, no stream; and at most max_n."""
        if self.candidates == 1:
            return
        if self.candidates > limits.max_n:
            raise bad_request(f"best_of={self.best_of} exceeds the limit of {limits.max_n} (max_n)")
        if not self.sampled:
            raise bad_request("best_of above 1 needs sampling: do_sample, or a temperature, top_k or top_p")
        if self.seed is not None:
            raise bad_request("seed must not be set when best_of is above 1 (each candidate has its own)")
        if streamed:
            raise bad_request("unsupported parameter(s): best_of above 1 with a stream",
                              code="unsupported_parameter")

    @property
    def candidates(self) -> int:
        """Generations to choose the answer from."""
        return self.best_of or 1

    @property
    def sampled(self) -> bool:
        """TGI's rule: sampling when `do_sample` or any warper is set (temperature 0 = greedy)."""
        if self.temperature == 0.0:
            return False
        warped = self.temperature not in (None, 1.0) or self.top_k is not None
        warped = warped or self.top_p not in (None, 1.0)
        return self.do_sample or warped

    def sampling(self, limits: ServeConfig) -> tuple[SamplingParams, int | None]:
        """Engine parameters, and the seed to report (TGI reports the seed of every sampled request)."""
        max_new = self.max_new_tokens if self.max_new_tokens is not None else limits.default_max_tokens
        check_max_tokens(max_new, limits, "max_new_tokens")
        seed = None
        if self.sampled:
            seed = random.randrange(2**63) if self.seed is None else self.seed % 2**63
        if self.return_k_alternatives is not None and self.return_k_alternatives < 1:
            raise bad_request("return_k_alternatives must be strictly positive")
        check_logprobs(self.return_k_alternatives, limits, "return_k_alternatives")
        params = SamplingParams(
            max_new_tokens=max_new, temperature=(self.temperature or 1.0) if self.sampled else 0.0,
            top_p=self.top_p or 1.0, top_k=self.top_k or 0, seed=seed,
            stop=check_stops(list(self.stop), limits),
            ignore_eos=self.ignore_eos_token, logprobs=self.return_k_alternatives or 0,
            prompt_logprobs=0 if self.decoder_input_details else None,
            repetition_penalty=self.repetition_penalty or 1.0,
            guided=None if self.response_format is None else self.response_format.spec(),
        )
        return params, seed


class LoraxRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"inputs": "the river", "parameters": {"adapter_id": "a3", "max_new_tokens": 16}}]})

    inputs: str = Field(min_length=1)
    parameters: LoraxParameters = Field(default_factory=LoraxParameters)
    stream: bool = False


class LoraxStreamParameters(LoraxParameters):
    """The parameters of /generate_stream: best_of only 1 (a stream cannot choose among candidates)."""

    best_of: Annotated[int | None, Field(ge=1), ONE_INT] = None


class LoraxStreamRequest(LoraxRequest):
    """The body of /generate_stream."""

    parameters: LoraxStreamParameters = Field(default_factory=LoraxStreamParameters)


class LoadLoraAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_ID_LEN, pattern=ADAPTER_ID_PATTERN,
                           description="The adapter id to serve it as (letters, digits, '._-/').")
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_max_tokens(value: int, limits: ServeConfig, field: str) -> None:
    if value > limits.max_new_tokens:
        raise bad_request(f"{field}={value} exceeds the limit of {limits.max_new_tokens} new tokens")


def merge_of(merged: MergedAdaptersBody | None, named: str | None, limits: ServeConfig,
             admit: Callable[[str], object]) -> MergeSpec | None:
    """The request's merge (None: it asks for none). `named` is the adapter the request names otherwise
    (both at once are refused); `admit(id)` is the API's one adapter check point
    (`ApiContext.adapter_for`: unknown ids and tenants' access), run on every merged id."""
    if merged is None:
        return None
    if named is not None:
        raise bad_request(f"name at most one of an adapter ({named!r}) and merged_adapters (which then "
                          "merges onto the base model)")
    spec = merged.spec(limits)
    for adapter_id in spec.ids:
        admit(adapter_id)
    return spec


def check_logprobs(value: int | None, limits: ServeConfig, field: str) -> None:
    if value is not None and value > limits.max_logprobs:
        raise bad_request(f"{field}={value} exceeds the limit of {limits.max_logprobs} (max_logprobs)")


def check_stops(stops: list[str], limits: ServeConfig) -> list[str]:
    """`stops`, refused (400 naming the limit) when there are more than `max_stop_sequences` or one
    is longer than `max_stop_length` characters."""
    if len(stops) > limits.max_stop_sequences:
        raise bad_request(f"{len(stops)} stop sequences exceed the limit of "
                          f"max_stop_sequences={limits.max_stop_sequences}")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise bad_request(f"a stop sequence of {longest} characters exceeds the limit of "
                          f"max_stop_length={limits.max_stop_length}")
    return stops


def check_n(n: int, limits: ServeConfig) -> None:
    if n > limits.max_n:
        raise bad_request(f"n={n} exceeds the limit of {limits.max_n}")


FinishReason = Literal["length", "stop", "eos", "abort"]
OPENAI_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort"}
LORAX_FINISH = {"length": "length", "stop": "stop_sequence", "eos": "eos_token", "abort": "length"}


def token_ids_below(n: int) -> str:
    """A regex of the decimal integers in [0, n) written as `TOKEN_ID_KEY` writes them (n >= 1)."""
    top = str(n - 1)
    alternatives = ["0"]
    if len(top) > 1:  # fewer digits than n - 1
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # as many digits: equal to n - 1 up to i, then a smaller digit
        low, rest = (1 if i == 0 else 0), len(top) - i - 1
        if int(digit) > low:
            alternatives.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"


def constrain(components: dict[str, dict[str, Any]], limits: ServeConfig, base_models: list[str],
              vocab_size: int | None) -> None:
    """State the configured limits and the rules between fields in the OpenAPI schema's request
    bodies (`components`, edited in place), so that a body the schema accepts is served and one it
    refuses is answered 400. What JSON Schema cannot state is in the descriptions: a text prompt's
    token count (`max_prompt_tokens`, counted by the tokenizer), and adapters that must exist."""
    prompt_tokens = limits.max_model_len - 1 if limits.max_prompt_tokens is None else limits.max_prompt_tokens
    token = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    ids = {"type": "array", "minItems": 1, "maxItems": prompt_tokens, "items": token}
    stop = {"maxLength": limits.max_stop_length, "maxItems": limits.max_stop_sequences,
            "items": {"type": "string", "maxLength": limits.max_stop_length}}
    no_merge = {"properties": {"merged_adapters": {"type": "null"}}}
    on_base = {"properties": {"model": {"enum": base_models}}}
    token_key = TOKEN_ID_KEY if vocab_size is None else token_ids_below(vocab_size)  # logit_bias keys
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        body = components[name]
        props = body["properties"]
        props["max_tokens"]["maximum"] = limits.max_new_tokens
        props["n"]["maximum"] = limits.max_n
        props["stop"].update(stop)
        # merged_adapters merges onto the base model: `model` then names it
        body.setdefault("allOf", []).append({"anyOf": [no_merge, on_base]})
        next(s for s in props["best_of"]["anyOf"] if s.get("type") == "integer")["maximum"] = limits.max_n
        body["allOf"].extend([*openai_rules(limits.max_n), one_constraint_rule()])
        bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
        bias.clear()
        bias.update({"type": "object", "maxProperties": LOGIT_BIAS_MAX_TOKENS,
                     "propertyNames": {"pattern": token_key},
                     "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                              "maximum": LOGIT_BIAS_LIMIT}})
    completion = components["CompletionRequest"]["properties"]
    completion["logprobs"]["maximum"] = limits.max_logprobs
    _, texts, one, many = completion["prompt"]["anyOf"]
    texts["maxItems"] = limits.max_prompts
    one.update(ids)
    many.update({"maxItems": limits.max_prompts, "items": ids})
    completion["prompt"]["description"] += (f" A prompt has at most {prompt_tokens} tokens "
                                            "(max_prompt_tokens; a longer text is a 400 prompt_too_long).")
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"]["maxItems"] = limits.max_chat_messages
    chat["messages"]["description"] = (
        f"At most {limits.max_chat_messages} (max_chat_messages); rendered by the chat template, at most "
        f"{prompt_tokens} tokens (max_prompt_tokens; a longer conversation is a 400 prompt_too_long).")
    chat["max_completion_tokens"]["maximum"] = limits.max_new_tokens
    chat["top_logprobs"]["maximum"] = limits.max_logprobs
    components["ChatCompletionRequest"].setdefault("allOf", []).extend(tool_rules())
    adapter_is_base = {"properties": {"adapter_id": {"anyOf": [{"type": "null"}, {"enum": base_models}]}}}
    for name in ("LoraxParameters", "LoraxStreamParameters"):  # /generate_stream's: best_of only 1
        lorax = components[name]
        lorax["properties"]["max_new_tokens"]["maximum"] = limits.max_new_tokens
        lorax["properties"]["return_k_alternatives"]["maximum"] = limits.max_logprobs
        lorax["properties"]["stop"].update(stop)
        lorax.setdefault("allOf", []).append({"anyOf": [no_merge, adapter_is_base]})
    lorax = components["LoraxParameters"]
    candidates = next(s for s in lorax["properties"]["best_of"]["anyOf"] if s.get("type") == "integer")
    candidates["maximum"] = limits.max_n
    lorax["allOf"].append(lorax_rule())
    components["LoraxRequest"].setdefault("allOf", []).append(lorax_stream_rule())
    merged = components["MergedAdaptersBody"]
    most = limits.max_merged_adapter_ids
    merged["properties"]["ids"]["maxItems"] = most
    merged["properties"]["weights"]["maxItems"] = most
    merged.setdefault("allOf", []).append({"anyOf": [  # one weight per id
        {"properties": {"ids": {"minItems": k, "maxItems": k}, "weights": {"minItems": k, "maxItems": k}}}
        for k in range(1, most + 1)]})

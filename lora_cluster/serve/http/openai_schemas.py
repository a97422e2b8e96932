"""The OpenAI request bodies (completions, chat) and their mapping to the engine's SamplingParams.

Field names follow OpenAI, plus vLLM's extensions (`top_k`, `ignore_eos`, `stop_token_ids`,
`min_tokens`, `repetition_penalty`, `priority`, `structured_outputs` and `guided_*`) and LoRAX's
`merged_adapters`. Parameters the engine cannot honour (`suffix`) are refused with a 400 naming
them rather than silently ignored. An unknown top-level field is a 400 naming it, as the OpenAI API
does ("Unrecognized request argument supplied"), so that a typo or a parameter this server does not
implement is never silently dropped; nested objects (messages, stream_options) ignore unknown
fields. Output constraints (`response_format`, `structured_outputs`, `guided_*`, and the grammar of
a forced tool call) map to the engine's `GuidedSpec`. `best_of`: the n of best_of candidates with
the highest cumulative logprob (vLLM). Limits (400 naming the limit): those of `schemas`, plus
`max_prompts` (prompts in one completions request) and `max_chat_messages`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from lora_cluster.config import ServeConfig
from lora_cluster.request import SamplingParams
from lora_cluster.request.guided_spec import GuidedSpec
from lora_cluster.request.sampling_params import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX_TOKENS
from lora_cluster.serve.http.schemas import (
    EMPTY_STRING,
    SEED,
    TOKEN_ID_KEY,
    Body,
    MergedAdaptersBody,
    NonEmpty,
    NonEmptyIds,
    NonEmptyStr,
    StreamOptions,
    check_logprobs,
    check_max_tokens,
    check_n,
    check_stops,
)
from lora_cluster.serve.http.structured_output import (
    ONE_CONSTRAINT,
    Choices,
    Grammar,
    Pattern,
    ResponseFormat,
    SchemaOrText,
    StructuredOutputs,
    openai_guided,
)
from lora_cluster.serve.http.tools import (
    MAX_TOOLS,
    MessageToolCall,
    ToolChoice,
    ToolDefinition,
    ToolUse,
    tool_use,
)
from lora_cluster.serve.http_errors import bad_request

OPENAI_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort"}


class _OpenAISampling(Body):
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
    best_of: int | None = Field(None, ge=1, description="Generate this many candidates per prompt (at most "
                                "max_n; below n it is raised to n) and return the n with the highest "
                                "cumulative logprob (vLLM). With stream, the n chosen arrive once every "
                                "candidate is done, each choice in one chunk.")
    user: str | None = None
    merged_adapters: MergedAdaptersBody | None = Field(
        None, description="LoRAX extension: merge these adapters for the request; `model` must then name "
        "the base model (another model with merged_adapters is a 400 naming both).")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema "
                                                   "(OpenAI): the output's form, enforced while decoding. "
                                                   f"{ONE_CONSTRAINT}")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension (0.10.2 and "
                                                         f"later): one output constraint. {ONE_CONSTRAINT}")
    guided_json: SchemaOrText | None = Field(None, description="vLLM extension (before 0.12): the output "
                                             f"is JSON that fits this schema. {ONE_CONSTRAINT}")
    guided_regex: Pattern | None = Field(None, description=f"vLLM extension (before 0.12). {ONE_CONSTRAINT}")
    guided_choice: Choices | None = Field(None, description=f"vLLM extension (before 0.12). {ONE_CONSTRAINT}")
    guided_grammar: Grammar | None = Field(None,
                                           description=f"vLLM extension (before 0.12). {ONE_CONSTRAINT}")
    priority: int | None = Field(
        None, description="vLLM extension: lower is more urgent; picks the SLA class with that priority "
        "(see SlaClasses.resolve) unless the x-lora-priority header names one.")

    def _check_shared(self, limits: ServeConfig) -> None:
        """What both routes check: best_of (at most max_n), the output constraint (at most one) and
        merged_adapters only onto the base model (`merge_of`)."""
        if self.best_of is not None and self.best_of > limits.api.max_n:
            raise bad_request(f"best_of={self.best_of} exceeds the limit of {limits.api.max_n} (max_n)")
        _ = self.output_constraint

    @property
    def candidates(self) -> int:
        """Generations per prompt: best_of raised to n (every choice is a candidate), else n."""
        return max(self.best_of or 0, self.n)

    @property
    def whole(self) -> bool:
        """Whether a streamed request's choices are sent whole once generated (one chunk each): a
        best_of selection is known only when every candidate is done."""
        return self.stream and self.selects

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
        {"model": "demo", "prompt": "the river", "max_tokens": 4, "stream": True}]})

    prompt: NonEmptyStr | NonEmpty[list[NonEmptyStr]] | NonEmptyIds | NonEmpty[list[NonEmptyIds]] = Field(
        description="A prompt, prompts, token ids, or lists of token ids; none of them empty.")
    echo: bool = Field(False, description="Prepend the prompt to each choice's text (and, with logprobs, "
                       "its tokens' logprobs, the first null); with stream, each choice arrives in one "
                       "chunk once generated (the prompt's logprobs are known at the end).")
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

    @property
    def whole(self) -> bool:
        """As for every OpenAI request, and also with echo (the prompt's logprobs come at the end)."""
        return self.stream and (self.selects or self.echo)

    def check(self, limits: ServeConfig) -> None:
        self._check_shared(limits)
        check_logprobs(self.logprobs, limits, "logprobs")
        if self.suffix:
            raise bad_request("unsupported parameter(s): suffix", code="unsupported_parameter")
        check_n(self.n, limits)
        count = len(self.prompts())
        if count > limits.api.max_prompts:
            raise bad_request(f"{count} prompts exceed the limit of max_prompts={limits.api.max_prompts}")


class TextPart(Body):
    """A part of a message's content: text only (another `type`, e.g. image_url, is a 400)."""

    type: Literal["text"]
    text: str = ""


class ChatMessage(Body):
    model_config = ConfigDict(json_schema_extra={  # a tool result names the call it answers
        "if": {"properties": {"role": {"const": "tool"}}},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}})

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
         "stream": True, "stream_options": {"include_usage": True}}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, description="Alternatives per token (at most "
                                     "max_logprobs; OpenAI allows 0-20); needs logprobs: true (a 400 "
                                     "naming both otherwise).")
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS, description="Functions the "
                                              "model may call (OpenAI), passed to the chat template; of "
                                              "two of one name, the first.")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools: calls "
                                           "read from the output), required (needs tools; a 400 naming "
                                           "both otherwise) or a named function (both enforced by the "
                                           "grammar; a name not among the tools is a function without "
                                           "parameters, called with {}). A forced choice is an output "
                                           f"constraint: {ONE_CONSTRAINT}")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true).")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self, limits: ServeConfig) -> None:
        if len(self.messages) > limits.api.max_chat_messages:
            raise bad_request(f"{len(self.messages)} messages exceed the limit of "
                              f"max_chat_messages={limits.api.max_chat_messages}")
        self._check_shared(limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true (logprobs is "
                              f"{'false' if self.logprobs is False else 'not set'})")
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


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

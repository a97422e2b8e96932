"""Request bodies of the HTTP API (pydantic) and their mapping to the engine's SamplingParams.

Field names follow the APIs they imitate: OpenAI (plus vLLM's `top_k`, `ignore_eos`,
`stop_token_ids`), LoRAX/TGI, and vLLM's adapter admin routes. Parameters the engine cannot honour
(log-probabilities, penalties, `best_of`, tools...) are refused with a 400 naming them rather than
silently ignored; unknown extra fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lora_cluster.config import ServeConfig
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.http_errors import bad_request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
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
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    priority: int | None = Field(
        None, description="vLLM extension: lower is more urgent; picks the SLA class with that priority "
        "(see SlaClasses.resolve) unless the x-lora-priority header names one.")

    def _refuse_unsupported(self, logprobs: object) -> None:
        unsupported = {
            "logprobs": logprobs not in (None, False, 0),
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "best_of": self.best_of not in (None, 1),
        }
        names = [name for name, bad in unsupported.items() if bad]
        if names:
            raise bad_request(f"unsupported parameter(s): {', '.join(names)}", code="unsupported_parameter")

    def sampling(self, limits: ServeConfig, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """Engine parameters of choice `choice` (choice i of a seeded request uses seed + i)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        check_max_tokens(max_tokens, limits, "max_tokens")
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), seed=seed, stop=_stops(self.stop),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None

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

    def check(self, limits: ServeConfig) -> None:
        self._refuse_unsupported(self.logprobs)
        if self.echo or self.suffix:
            raise bad_request("unsupported parameter(s): echo/suffix", code="unsupported_parameter")
        check_n(self.n, limits)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise bad_request(f"unsupported content part type {part.get('type')!r} (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check(self, limits: ServeConfig) -> None:
        self._refuse_unsupported(self.logprobs)
        if self.tools:
            raise bad_request("unsupported parameter(s): tools", code="unsupported_parameter")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request("unsupported parameter(s): response_format", code="unsupported_parameter")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        check_n(self.n, limits)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class LoraxParameters(_Body):
    adapter_id: str | None = None
    adapter_source: str | None = None
    api_token: str | None = None
    merged_adapters: dict[str, Any] | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=1)
    ignore_eos_token: bool = False
    repetition_penalty: float | None = None
    return_full_text: bool = False
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncate: int | None = None
    typical_p: float | None = None
    best_of: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        unsupported = {
            "merged_adapters": self.merged_adapters is not None,
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "truncate": self.truncate is not None,
            "typical_p": self.typical_p not in (None, 1.0),
            "best_of": self.best_of not in (None, 1),
            "watermark": self.watermark,
            "return_k_alternatives": self.return_k_alternatives is not None,
            "response_format": self.response_format is not None,
            "adapter_source": self.adapter_source not in (None, "hub", "local", "s3"),
        }
        names = [name for name, bad in unsupported.items() if bad]
        if names:
            raise bad_request(f"unsupported parameter(s): {', '.join(names)}", code="unsupported_parameter")

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
        seed = (self.seed if self.seed is not None else random.randrange(2**63)) if self.sampled else None
        params = SamplingParams(
            max_new_tokens=max_new, temperature=(self.temperature or 1.0) if self.sampled else 0.0,
            top_p=self.top_p or 1.0, top_k=self.top_k or 0, seed=seed, stop=list(self.stop),
            ignore_eos=self.ignore_eos_token,
        )
        return params, seed


class LoraxRequest(_Body):
    inputs: str = Field(min_length=1)
    parameters: LoraxParameters = Field(default_factory=LoraxParameters)
    stream: bool = False


class LoadLoraAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
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


def check_n(n: int, limits: ServeConfig) -> None:
    if n > limits.max_n:
        raise bad_request(f"n={n} exceeds the limit of {limits.max_n}")


FinishReason = Literal["length", "stop", "eos", "abort"]
OPENAI_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort"}
LORAX_FINISH = {"length": "length", "stop": "stop_sequence", "eos": "eos_token", "abort": "length"}

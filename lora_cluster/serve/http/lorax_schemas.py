"""The LoRAX/TGI request bodies (`/generate`, `/generate_stream`) and their mapping to the engine's
SamplingParams.

Field names follow LoRAX (lorax-client's `Parameters`); unknown fields are ignored, as LoRAX/TGI
does. Parameters the engine cannot honour (`truncate`, `typical_p` other than 1, `watermark`) are a
400 naming them. Sampling follows TGI: a request samples when `do_sample` or any warper is set
(temperature 0 is greedy), and every sampled request reports its seed. `best_of` above 1 returns the
candidate with the highest mean logprob per token, and needs sampling, no seed and no stream.
`response_format` (json_object, json_schema) is enforced while decoding.
"""

from __future__ import annotations

import random
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from lora_cluster.config import ServeConfig
from lora_cluster.request import SamplingParams
from lora_cluster.serve.http.schemas import (
    FALSE,
    NULL,
    ONE,
    ONE_INT,
    SEED,
    Body,
    MergedAdaptersBody,
    check_logprobs,
    check_max_tokens,
    check_stops,
)
from lora_cluster.serve.http.structured_output import LoraxResponseFormat
from lora_cluster.serve.http_errors import bad_request

LORAX_FINISH = {"length": "length", "stop": "stop_sequence", "eos": "eos_token", "abort": "length"}


class LoraxParameters(Body):
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
        if self.candidates > limits.api.max_n:
            raise bad_request(f"best_of={self.best_of} exceeds the limit of {limits.api.max_n} (max_n)")
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
        max_new = self.max_new_tokens if self.max_new_tokens is not None else limits.api.default_max_tokens
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


class LoraxRequest(Body):
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

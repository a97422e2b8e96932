"""Sampling parameters: how the engine picks tokens and when it stops, validated where they are made.

Policy (the sampler is `engine.sample.sampling`): temperature 0 is greedy (argmax, deterministic), and so is
a temperature below `GREEDY_BELOW` (dividing logits by 1e-145 overflows them to inf, whose softmax is
NaN; vLLM uses the same threshold). Otherwise logits are divided by the temperature, cut to the
`top_k` most likely tokens and then to the smallest set whose probability reaches `top_p`, and one
token is drawn with the request's own generator, so that a request with a `seed` gives the same
tokens whatever else shares its batch. The logit controls (`min_tokens`, `logit_bias`,
`repetition_penalty`, `presence_penalty`, `frequency_penalty`) change the logits of the rows that
set them first (`engine.sample.logit_controls`). Invalid values raise `RequestError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lora_cluster.errors import RequestError
from lora_cluster.request.guided_spec import GuidedSpec

GREEDY_BELOW = 1e-5  # temperatures below this are greedy: the division would overflow the logits
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # each logit_bias value lies in [-100, 100] (OpenAI's range)
LOGIT_BIAS_MAX_TOKENS = 1024  # entries in one request's logit_bias
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # 1 is off; below 0.01 logit / p could overflow float32 to inf


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise `RequestError` naming the field."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for prompt tokens (see engine.sample.logprobs)
    # logit controls (engine.sample.logit_controls); the defaults change nothing
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # transformers/CTRL: tokens of prompt + output, logit / p (> 0) or * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop token ids cannot be sampled before this many output tokens
    guided: GuidedSpec | None = None  # the output must match this constraint (request.guided_spec)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > 16:
            raise RequestError(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
                raise RequestError(f"{name} must be None or an integer >= 0, got {k!r}")
        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise RequestError(f"{name} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], "
                                   f"got {value!r}")  # fmt: skip
        rp = self.repetition_penalty
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(rp) or not low <= rp <= high:
            raise RequestError(f"repetition_penalty must be a number in [{low:g}, {high:g}], got {rp!r}")
        if not isinstance(self.logit_bias, dict):
            kind = type(self.logit_bias).__name__
            raise RequestError(f"logit_bias must map token ids to numbers, got a {kind}")
        if len(self.logit_bias) > LOGIT_BIAS_MAX_TOKENS:
            raise RequestError(f"logit_bias may hold at most {LOGIT_BIAS_MAX_TOKENS} token ids, "
                               f"got {len(self.logit_bias)}")  # fmt: skip
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise RequestError(f"logit_bias[{token}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                                   f"{LOGIT_BIAS_LIMIT:g}], got {bias!r}")  # fmt: skip
        mt = self.min_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or not 0 <= mt <= self.max_new_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                               f"got {mt!r}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_logit_controls(self) -> bool:
        """Any logit control set to other than its default (min_tokens counts while it lasts)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )  # fmt: skip


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

"""Sampling parameters and the sampler.

Policy: temperature 0 is greedy (argmax, deterministic), and so is a temperature below
`GREEDY_BELOW` (dividing logits by 1e-145 overflows them to inf, whose softmax is NaN; vLLM uses the
same threshold). Otherwise logits are divided by the
temperature, cut to the `top_k` most likely tokens and then to the smallest set whose probability
reaches `top_p`, and one token is drawn with the request's own generator, so that a request with a
`seed` gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lora_cluster.errors import RequestError

GREEDY_BELOW = 1e-5  # temperatures below this are greedy: the division would overflow the logits


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
    prompt_logprobs: int | None = None  # the same for prompt tokens (see engine.logprobs)

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The per-request generator; None for greedy requests, which need none."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus of one row [V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p; the first one always stays
        # (explicitly: with a tiny top_p, rounding in cumsum would otherwise drop every token)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of `logits` [N, V] (float32) with that row's parameters."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        scaled = _filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens

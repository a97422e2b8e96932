"""The sampler: picks each row's next token as its `SamplingParams` (`request.sampling_params`) say.

Policy: temperature 0 is greedy (argmax, deterministic), and so is a temperature below
`GREEDY_BELOW` (dividing logits by 1e-145 overflows them to inf, whose softmax is NaN; vLLM uses the
same threshold). Otherwise logits are divided by the
temperature, cut to the `top_k` most likely tokens and then to the smallest set whose probability
reaches `top_p`, and one token is drawn with the request's own generator, so that a request with a
`seed` gives the same tokens whatever else shares its batch.

Before all of that the logit controls (`min_tokens`, `logit_bias`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`) change the logits of the rows that set them
(`engine.sample.logit_controls`); greedy picks the argmax of the controlled logits.
"""

from __future__ import annotations

import torch

from lora_cluster.request.sampling_params import SamplingParams


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

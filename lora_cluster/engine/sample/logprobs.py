"""Log-probabilities of tokens, computed from the logits the step's sampler receives.

Which distribution: the raw model distribution, `log_softmax(logits)` in float32 over the whole
vocabulary, before temperature, top-k and top-p (vLLM's default, `logprobs_mode="raw_logprobs"`).
A token's logprob therefore does not depend on the request's sampling parameters: it is what the
model (base plus adapter) assigns, which is what evaluation and classification need, and it equals
PEFT's `log_softmax` of the same forward pass. The sampled token may have been drawn from a
temperature-scaled or truncated distribution; its reported logprob is still the raw one. The same
holds for the logit controls (`engine.sample.logit_controls`: penalties, `logit_bias`, `min_tokens`): they
change what is sampled, not the logprobs reported (vLLM's raw logprobs are taken before them too).
A constrained row (structured output, `engine.sample.token_mask`) is the exception: its logits are masked
first, so its logprobs are those of the model's distribution over the tokens the grammar allows
(the others are -inf), as in vLLM, where the grammar's bitmask is applied before the sampler.

Per generated token a request that asked for `logprobs=k` gets the chosen token's logprob and the
k most likely tokens (`k = 0`: the chosen one only). With `prompt_logprobs=k`, every prompt token
but the first (which has no context) gets the same, from the prefill's logits; the first is None.
`k` is bounded by `EngineConfig.max_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lora_cluster.request.output import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], ks: list[int | None]
) -> list[TokenLogprob | None]:
    """Logprob of `tokens[i]` under row i of `logits` [N, V] with the `ks[i]` most likely tokens;
    None for the rows whose k is None (the request did not ask). One log_softmax over the rows
    that asked."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(ks)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
    got = _describe(logits.index_select(0, index), chosen, [ks[i] or 0 for i in rows])
    for i, lp in zip(rows, got, strict=True):
        out[i] = lp
    return out


def _describe(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprobs of `chosen[j]` under rows `logits[j]`, each with its `ks[j]` alternatives."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    picked = lps.gather(1, chosen[:, None])[:, 0].tolist()
    k_max = min(max(ks), lps.shape[-1])
    top_v: list[list[float]] = [[] for _ in ks]
    top_i: list[list[int]] = [[] for _ in ks]
    if k_max > 0:
        values, ids = torch.topk(lps, k_max, dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    chosen_ids = chosen.tolist()
    return [
        TokenLogprob(tid, lp, tuple(zip(top_i[j][: ks[j]], top_v[j][: ks[j]], strict=True)))
        for j, (tid, lp) in enumerate(zip(chosen_ids, picked, strict=True))
    ]


def prompt_token_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens `next_ids[j]` under the logits of the position before each [n, V]."""
    if not next_ids:
        return []
    chosen = torch.tensor(next_ids, device=logits.device)
    return _describe(logits, chosen, [k] * len(next_ids))


def record_prompt_logprobs(logits: torch.Tensor, spans: Sequence[tuple[Any, int, int]]) -> None:
    """Append prompt-token logprobs to each span's sequence: `spans` are (sequence, first position,
    count) in the order of the rows of `logits` (the forward's rows after the sampled ones)."""
    row = 0
    for seq, first, count in spans:
        next_ids = seq.prompt_ids[first + 1 : first + 1 + count]
        seq.prompt_logprobs.extend(
            prompt_token_logprobs(logits[row : row + count], next_ids, seq.sampling.prompt_logprobs))
        row += count

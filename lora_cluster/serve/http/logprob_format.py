"""The engine's token logprobs in the shapes of the APIs: OpenAI completions and chat, LoRAX.

Every logprob is of the raw model distribution (base plus adapter, before temperature, top-k and
top-p; see `lora_cluster.engine.sample.logprobs`). Token texts are each token decoded alone (`text_of`);
a token that is part of a multi-byte character decodes to U+FFFD, and its `bytes` are those of
that text. Within one response a token id is decoded once (`TokenTexts`).

- Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; each
  `top_logprobs` entry maps token text to logprob for the k most likely tokens plus the chosen one
  (so up to k + 1 entries, as OpenAI documents); `text_offset` counts characters (of the token texts)
  from the start of the choice's text (streamed chunks continue the count). With `echo` the prompt's
  tokens come first, the first one with null logprob and alternatives.
- Chat (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}`.
- LoRAX: each token's `logprob` and, with `return_k_alternatives`, `alternative_tokens`
  (`[{"id", "text", "logprob"}]`, most likely first); `decoder_input_details` gives `prefill`
  (`[{"id", "text", "logprob"}]`, the first logprob null).

A constrained row's disallowed tokens have logprob -inf, which JSON cannot carry: every logprob these
shapes report is at least `LOGPROB_FLOOR` (-9999.0, what vLLM's OpenAI server reports for them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lora_cluster.request.output import TokenLogprob

LOGPROB_FLOOR = -9999.0  # a -inf logprob (a token a grammar masks), as JSON can carry it


def json_logprob(value: float) -> float:
    """`value`, or `LOGPROB_FLOOR` when it is lower (-inf included)."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(lp: TokenLogprob) -> list[tuple[int, float]]:
    return [(tid, json_logprob(value)) for tid, value in lp.top]


class TokenTexts:
    """Token id -> text for one response, each id decoded once (bounded by the response's tokens)."""

    def __init__(self, text_of: Callable[[int], str]):
        self._text_of = text_of
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._memo[token_id] = self._text_of(token_id)
        return text


def completion_logprobs(lps: Sequence[TokenLogprob], text: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs` of these tokens; `offset` is the text offset of the first one."""
    tokens, offsets = [], []
    for lp in lps:
        tokens.append(text(lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    top = []
    for lp in lps:
        alternatives = {text(tid): value for tid, value in _top(lp)}
        alternatives.setdefault(text(lp.token_id), json_logprob(lp.logprob))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [json_logprob(lp.logprob) for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: Sequence[int], lps: Sequence[TokenLogprob | None] | None,
                  text: TokenTexts) -> dict[str, Any]:
    """Completions `logprobs` of the prompt tokens (`echo`): the first token's logprob and alternatives
    are null, as OpenAI's; `text_offset` counts from 0."""
    lps = lps or [None] * len(prompt_ids)
    tokens = [text(tid) for tid in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    top: list[dict[str, float] | None] = []
    for tid, lp in zip(prompt_ids, lps, strict=True):
        if lp is None:
            top.append(None)
            continue
        alternatives = {text(t): value for t, value in _top(lp)}
        alternatives.setdefault(text(tid), json_logprob(lp.logprob))
        top.append(alternatives)
    values = [None if lp is None else json_logprob(lp.logprob) for lp in lps]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def _chat_entry(token_text: str, logprob: float) -> dict[str, Any]:
    return {"token": token_text, "logprob": json_logprob(logprob), "bytes": list(token_text.encode("utf-8"))}


def chat_logprobs(lps: Sequence[TokenLogprob], text: TokenTexts) -> dict[str, Any]:
    """OpenAI chat `choices[].logprobs` of these tokens."""
    content = []
    for lp in lps:
        entry = _chat_entry(text(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_entry(text(tid), value) for tid, value in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def lorax_alternatives(lp: TokenLogprob, text: TokenTexts) -> list[dict[str, Any]]:
    """LoRAX's `alternative_tokens` of one generated token."""
    return [{"id": tid, "text": text(tid), "logprob": value} for tid, value in _top(lp)]


def lorax_prefill(prompt_ids: Sequence[int], lps: Sequence[TokenLogprob | None] | None,
                  text: TokenTexts) -> list[dict[str, Any]]:
    """LoRAX's `prefill`: every prompt token with its logprob (None for the first, or when not computed)."""
    values = ([None if lp is None else json_logprob(lp.logprob) for lp in lps] if lps
              else [None] * len(prompt_ids))
    return [{"id": tid, "text": text(tid), "logprob": value}
            for tid, value in zip(prompt_ids, values, strict=True)]

"""Fitting a prompt longer than its base's prompt limit, as `prompt_truncation: auto` serves it.

A prompt's token count is the one request limit an OpenAPI schema cannot state: it depends on the
text and the tokenizer. With `prompt_truncation: auto` (the default) a schema-valid request is
served rather than refused, on the prompt's most recent part, and says so (the
`x-lora-truncated-tokens` header; `usage.prompt_tokens` counts what ran). With `disabled` a longer
prompt is a 400 prompt_too_long, as OpenAI's and vLLM's.

Policy:
- A text prompt keeps its last tokens (vLLM's `truncate_prompt_tokens`, TGI's `truncate`), and its
  first token where that is the tokenizer's BOS, so the model still sees a sequence start.
- A conversation keeps its leading system/developer messages and its most recent messages: it drops
  whole messages from the oldest on, starting what it keeps at a user message (a template may require
  user/assistant turns, and a tool result is never kept without the call before it) or at the last
  message. It keeps as many as fit (a binary search over the starts: O(log n) renders).
- When even the leading messages and the last message do not fit, the last of those tokens, as for
  a text prompt: the request is still answered, on what fits.

Invariant: the ids returned are never more than `limit`, never empty where the input was not, and
`truncated` is the number of tokens the full prompt had beyond them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HEADER_TRUNCATED = "x-lora-truncated-tokens"  # response: tokens cut from the request's prompts
LEADING_ROLES = ("system", "developer")
# a conversation's token ids as the chat template renders it (tools bound by the caller)
RenderMessages = Callable[[list[dict[str, Any]]], list[int]]


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids as they run, and how many tokens were cut from the full prompt to fit."""

    ids: list[int]
    truncated: int = 0


def keep_last(ids: list[int], limit: int, bos: int | None = None) -> Prompt:
    """The last `limit` tokens of `ids` (and its first, where that is `bos`)."""
    if len(ids) <= limit:
        return Prompt(ids)
    if bos is not None and ids[0] == bos and limit > 1:
        kept = [bos, *ids[len(ids) - limit + 1:]]
    else:
        kept = ids[len(ids) - limit:]
    return Prompt(kept, len(ids) - len(kept))


def fit_conversation(messages: list[dict[str, Any]], render: RenderMessages, limit: int,
                     bos: int | None = None) -> Prompt:
    """The conversation rendered whole when it fits in `limit` tokens; otherwise its leading
    system/developer messages and as many of its most recent messages as fit (see the module)."""
    full = render(messages)
    if len(full) <= limit or len(messages) < 2:
        return keep_last(full, limit, bos)
    head = 0
    while head < len(messages) - 1 and messages[head].get("role") in LEADING_ROLES:
        head += 1
    last = len(messages) - 1
    starts = [i for i in range(head + 1, last) if messages[i].get("role") == "user"] + [last]

    def rendered(start: int) -> list[int] | None:
        try:
            ids = render(messages[:head] + messages[start:])
        except Exception:  # a template that refuses this order: not a fit
            return None
        return ids if len(ids) <= limit else None

    low, high, best = 0, len(starts) - 1, None
    while low <= high:  # the earliest start whose rendering fits
        middle = (low + high) // 2
        ids = rendered(starts[middle])
        if ids is None:
            low = middle + 1
        else:
            best, high = ids, middle - 1
    if best is not None:
        return Prompt(best, len(full) - len(best))
    try:
        shortest = render(messages[:head] + messages[last:])
    except Exception:
        shortest = full
    kept = keep_last(shortest, limit, bos)
    return Prompt(kept.ids, len(full) - len(kept.ids))


def truncation_headers(prompts: list[Prompt]) -> dict[str, str]:
    """`x-lora-truncated-tokens` (the tokens cut from a request's prompts) where any were cut."""
    cut = sum(p.truncated for p in prompts)
    return {HEADER_TRUNCATED: str(cut)} if cut else {}

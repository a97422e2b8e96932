"""How long a prompt may be for one base model: in tokens, and in chat messages and tools.

The engine refuses a prompt of more than max_model_len - 1 tokens, and max_model_len is at most the
model's context (its tokenizer's `model_max_length`, where it states one). The ingress refuses the
same prompts first, with the same error (with replica groups of their own max_model_len, over the
largest), and the OpenAPI schema states the same bound on token-id
prompts, so a client generated from the schema never sends a prompt the engine must refuse.

A chat prompt's tokens cannot be stated in a schema, its counts can (`maxItems`). The counts are
bounded so that a conversation of short parts always fits, whatever its other fields hold:
messages get half the prompt limit, at the chat template's cost of a short message
(`SHORT_MESSAGE`, the schema's own example), and tools a quarter, at the template's cost of a tool
without parameters; each capped by its configured limit (`max_chat_messages`, OpenAI's 128 tools)
and at least 1. The server enforces both counts as the schema states them (a 400 naming the
limits); a conversation within them can still be too long for its contents: it is then fitted
(`truncation`, prompt_truncation auto) or refused (disabled: a 400 prompt_too_long). Where the
template cannot say (no template, or one that refuses two user messages in a row), the configured
limits alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_cluster.config import ServeConfig

SHORT_MESSAGE: dict[str, Any] = {"role": "user", "content": "hello"}
BARE_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "f"}}
_NO_CONTEXT = 2**31  # tokenizers without a stated context report a huge model_max_length
# a chat prompt's token ids, as the template renders (messages, tools)
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]


@dataclass(frozen=True)
class ChatLimits:
    """The most messages and tools a chat request may have, for one base."""

    messages: int
    tools: int


def prompt_limit(config: ServeConfig, tokenizer: Any) -> int:
    """The most tokens a prompt may have: max_prompt_tokens, at most max_model_len - 1 (the largest
    of the top level's and the replica groups' own: an engine still refuses over its own), at most the
    model's context less one."""
    groups = (group.engine.get("max_model_len", 0) for group in config.replica_groups)
    limit = max([config.engine.max_model_len, *groups]) - 1
    if config.api.max_prompt_tokens is not None:
        limit = min(limit, config.api.max_prompt_tokens)
    context = getattr(tokenizer, "model_max_length", None)
    if isinstance(context, int) and 1 < context < _NO_CONTEXT:
        limit = min(limit, context - 1)
    return limit


def _fits(budget: int, fixed: int, each: int, most: int) -> int:
    """How many parts of `each` tokens fit in `budget` after `fixed`: at least 1, at most `most`."""
    return min(most, max(1, (budget - fixed) // max(1, each)))


def chat_limits(config: ServeConfig, limit: int, max_tools: int, render: Render) -> ChatLimits:
    """The counts of a chat request for a base whose prompt limit is `limit` tokens."""
    try:
        one, two = (len(render([SHORT_MESSAGE] * k, None)) for k in (1, 2))
        with_tools = [len(render([SHORT_MESSAGE], [BARE_TOOL] * k)) for k in (1, 2)]
    except Exception:  # no template, or one with rules of its own: the configured limits alone
        return ChatLimits(config.api.max_chat_messages, max_tools)
    per_message, per_tool = two - one, with_tools[1] - with_tools[0]
    messages = _fits(limit // 2, one - per_message, per_message, config.api.max_chat_messages)
    tools = max_tools if per_tool <= 0 else _fits(limit // 4, 0, per_tool, max_tools)
    return ChatLimits(messages, tools)

"""The configured limits and the rules between fields, stated in the OpenAPI schema's request bodies.

`constrain` edits the generated components so that a body the schema accepts is served and one it
refuses is answered 400 (tests/serve/test_fuzz_api.py checks both ways, and the schemathesis CLI against a
real server). Each body is a plain object: `properties`, `required`, bounds, and `anyOf`/`oneOf` only
where a field takes several shapes. A rule across fields is written where the field it constrains
is described, and also as that field's entry of JSON Schema's `dependentSchemas` (`rules`: applies
when the field is present), which generators and validators read as a dependency of that one field
rather than as a composition of the whole body. What JSON Schema cannot state is in the
descriptions: a text prompt's token count (`max_prompt_tokens`; with `prompt_truncation: auto`, the
default, a longer text or conversation is served on its latest part, so a schema-valid body is still
served), and adapters that must exist.
"""

from __future__ import annotations

from typing import Any

from lora_cluster.config import ServeConfig
from lora_cluster.request.sampling_params import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX_TOKENS
from lora_cluster.serve.http import rules
from lora_cluster.serve.http.prompt_limits import ChatLimits
from lora_cluster.serve.http.schemas import TOKEN_ID_KEY, token_ids_below


def constrain(components: dict[str, dict[str, Any]], limits: ServeConfig, base_models: list[str],
              vocab_size: int | None, prompt_tokens: int, counts: ChatLimits) -> None:
    """State the configured limits and the rules between fields in the OpenAPI schema's request
    bodies (`components`, edited in place), so that a body the schema accepts is served and one it
    refuses is answered 400. What JSON Schema cannot state is in the descriptions: a text prompt's
    token count (at most `prompt_tokens`, `Tokenization.prompt_limit`), and adapters that must exist.
    `counts`: the most messages and tools a chat request may have (`prompt_limits`)."""
    token = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    ids = {"type": "array", "minItems": 1, "maxItems": prompt_tokens, "items": token}
    stop = {"maxLength": limits.api.max_stop_length, "maxItems": limits.api.max_stop_sequences,
            "items": {"type": "string", "maxLength": limits.api.max_stop_length}}
    token_key = TOKEN_ID_KEY if vocab_size is None else token_ids_below(vocab_size)  # logit_bias keys
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _openai_body(components[name], limits, stop, token_key,
                     rules.openai_rules(base_models, chat=name == "ChatCompletionRequest"))
    _completion_prompt(components["CompletionRequest"]["properties"], limits, ids, prompt_tokens)
    _chat_counts(components["ChatCompletionRequest"], limits, prompt_tokens, counts)
    for name in ("LoraxParameters", "LoraxStreamParameters"):  # /generate_stream's: best_of only 1
        lorax = components[name]
        lorax["properties"]["max_new_tokens"]["maximum"] = limits.api.max_new_tokens
        lorax["properties"]["return_k_alternatives"]["maximum"] = limits.engine.max_logprobs
        lorax["properties"]["stop"].update(stop)
        lorax["dependentSchemas"] = rules.lorax_rules(base_models)
    lorax = components["LoraxParameters"]
    candidates = next(s for s in lorax["properties"]["best_of"]["anyOf"] if s.get("type") == "integer")
    candidates["maximum"] = limits.api.max_n
    for name in ("LoraxRequest", "LoraxStreamRequest"):
        components[name]["dependentSchemas"] = rules.lorax_stream_rules()
    merged = components["MergedAdaptersBody"]
    most = limits.engine.max_merged_adapter_ids
    merged["properties"]["ids"]["maxItems"] = most
    merged["properties"]["weights"]["maxItems"] = most
    merged["dependentSchemas"] = rules.merge_rules(most)


def _openai_body(body: dict[str, Any], limits: ServeConfig, stop: dict[str, Any], token_key: str,
                 dependent: dict[str, dict[str, Any]]) -> None:
    """What both OpenAI bodies share: token, choice and stop limits, logit_bias's keys and values,
    and the rules between fields (`dependent`: `rules.openai_rules`)."""
    props = body["properties"]
    props["max_tokens"]["maximum"] = limits.api.max_new_tokens
    props["n"]["maximum"] = limits.api.max_n
    props["stop"].update(stop)
    next(s for s in props["best_of"]["anyOf"] if s.get("type") == "integer")["maximum"] = limits.api.max_n
    bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
    bias.clear()
    bias.update({"type": "object", "maxProperties": LOGIT_BIAS_MAX_TOKENS,
                 "propertyNames": {"pattern": token_key},
                 "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                          "maximum": LOGIT_BIAS_LIMIT}})
    body["dependentSchemas"] = dependent


def _completion_prompt(completion: dict[str, Any], limits: ServeConfig, ids: dict[str, Any],
                       prompt_tokens: int) -> None:
    """/v1/completions' logprobs bound and its prompt's shapes (`ids`: one prompt's token ids), with
    the token limit, which JSON Schema cannot state of a text, in the prompt's description."""
    completion["logprobs"]["maximum"] = limits.engine.max_logprobs
    _, texts, one, many = completion["prompt"]["anyOf"]
    texts["maxItems"] = limits.api.max_prompts
    one.update(ids)
    many.update({"maxItems": limits.api.max_prompts, "items": ids})
    longer = ("keeps its last tokens (prompt_truncation: auto; the x-lora-truncated-tokens header says how "
              "many were cut)" if limits.api.prompt_truncation == "auto" else "is a 400 prompt_too_long")
    completion["prompt"]["description"] += (f" A prompt has at most {prompt_tokens} tokens "
                                            f"(max_prompt_tokens; a longer text {longer}).")


def _chat_counts(chat_body: dict[str, Any], limits: ServeConfig, prompt_tokens: int,
                 counts: ChatLimits) -> None:
    """/v1/chat/completions' messages and tools (`counts`), token bounds and tool_choice rule."""
    chat = chat_body["properties"]
    chat["messages"]["maxItems"] = counts.messages
    chat["messages"]["description"] = (
        f"At most {counts.messages} (max_chat_messages, {limits.api.max_chat_messages}, and as many short "
        "messages as fit in half the prompt limit); rendered by the chat template, at most "
        f"{prompt_tokens} tokens (max_prompt_tokens; a longer conversation "
        + ("keeps its system messages and as many of its latest messages as fit (prompt_truncation: auto; "
           "the x-lora-truncated-tokens header says how many tokens were cut)."
           if limits.api.prompt_truncation == "auto" else "is a 400 prompt_too_long)."))
    chat["tools"]["anyOf"][0]["maxItems"] = counts.tools
    chat["tools"]["description"] += (f" At most {counts.tools} (OpenAI's 128, and as many tools without "
                                     "parameters as fit in a quarter of the prompt limit).")
    chat["max_completion_tokens"]["maximum"] = limits.api.max_new_tokens
    chat["top_logprobs"]["maximum"] = limits.engine.max_logprobs
    chat_body.update(rules.required_tool_choice())

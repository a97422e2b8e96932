"""The configured limits and the rules between fields, stated in the OpenAPI schema's request bodies.

`constrain` edits the generated components so that a body the schema accepts is served and one it
refuses is answered 400 (tests/test_fuzz_api.py checks both ways). What JSON Schema cannot state is
in the descriptions: a text prompt's token count (`max_prompt_tokens`), and adapters that must exist.
"""

from __future__ import annotations

from typing import Any

from lora_cluster.config import ServeConfig
from lora_cluster.engine.sampling import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX_TOKENS
from lora_cluster.serve.http.best_of import lorax_rule, lorax_stream_rule, openai_rules
from lora_cluster.serve.http.schemas import TOKEN_ID_KEY, token_ids_below
from lora_cluster.serve.http.structured_output import one_constraint_rule
from lora_cluster.serve.http.tools import tool_rules


def constrain(components: dict[str, dict[str, Any]], limits: ServeConfig, base_models: list[str],
              vocab_size: int | None) -> None:
    """State the configured limits and the rules between fields in the OpenAPI schema's request
    bodies (`components`, edited in place), so that a body the schema accepts is served and one it
    refuses is answered 400. What JSON Schema cannot state is in the descriptions: a text prompt's
    token count (`max_prompt_tokens`, counted by the tokenizer), and adapters that must exist."""
    prompt_tokens = limits.max_model_len - 1 if limits.max_prompt_tokens is None else limits.max_prompt_tokens
    token = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    ids = {"type": "array", "minItems": 1, "maxItems": prompt_tokens, "items": token}
    stop = {"maxLength": limits.max_stop_length, "maxItems": limits.max_stop_sequences,
            "items": {"type": "string", "maxLength": limits.max_stop_length}}
    no_merge = {"properties": {"merged_adapters": {"type": "null"}}}
    on_base = {"properties": {"model": {"enum": base_models}}}
    token_key = TOKEN_ID_KEY if vocab_size is None else token_ids_below(vocab_size)  # logit_bias keys
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        body = components[name]
        props = body["properties"]
        props["max_tokens"]["maximum"] = limits.max_new_tokens
        props["n"]["maximum"] = limits.max_n
        props["stop"].update(stop)
        # merged_adapters merges onto the base model: `model` then names it
        body.setdefault("allOf", []).append({"anyOf": [no_merge, on_base]})
        next(s for s in props["best_of"]["anyOf"] if s.get("type") == "integer")["maximum"] = limits.max_n
        body["allOf"].extend([*openai_rules(limits.max_n), one_constraint_rule()])
        bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
        bias.clear()
        bias.update({"type": "object", "maxProperties": LOGIT_BIAS_MAX_TOKENS,
                     "propertyNames": {"pattern": token_key},
                     "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                              "maximum": LOGIT_BIAS_LIMIT}})
    completion = components["CompletionRequest"]["properties"]
    completion["logprobs"]["maximum"] = limits.max_logprobs
    _, texts, one, many = completion["prompt"]["anyOf"]
    texts["maxItems"] = limits.max_prompts
    one.update(ids)
    many.update({"maxItems": limits.max_prompts, "items": ids})
    completion["prompt"]["description"] += (f" A prompt has at most {prompt_tokens} tokens "
                                            "(max_prompt_tokens; a longer text is a 400 prompt_too_long).")
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"]["maxItems"] = limits.max_chat_messages
    chat["messages"]["description"] = (
        f"At most {limits.max_chat_messages} (max_chat_messages); rendered by the chat template, at most "
        f"{prompt_tokens} tokens (max_prompt_tokens; a longer conversation is a 400 prompt_too_long).")
    chat["max_completion_tokens"]["maximum"] = limits.max_new_tokens
    chat["top_logprobs"]["maximum"] = limits.max_logprobs
    components["ChatCompletionRequest"].setdefault("allOf", []).extend(tool_rules())
    adapter_is_base = {"properties": {"adapter_id": {"anyOf": [{"type": "null"}, {"enum": base_models}]}}}
    for name in ("LoraxParameters", "LoraxStreamParameters"):  # /generate_stream's: best_of only 1
        lorax = components[name]
        lorax["properties"]["max_new_tokens"]["maximum"] = limits.max_new_tokens
        lorax["properties"]["return_k_alternatives"]["maximum"] = limits.max_logprobs
        lorax["properties"]["stop"].update(stop)
        lorax.setdefault("allOf", []).append({"anyOf": [no_merge, adapter_is_base]})
    lorax = components["LoraxParameters"]
    candidates = next(s for s in lorax["properties"]["best_of"]["anyOf"] if s.get("type") == "integer")
    candidates["maximum"] = limits.max_n
    lorax["allOf"].append(lorax_rule())
    components["LoraxRequest"].setdefault("allOf", []).append(lorax_stream_rule())
    merged = components["MergedAdaptersBody"]
    most = limits.max_merged_adapter_ids
    merged["properties"]["ids"]["maxItems"] = most
    merged["properties"]["weights"]["maxItems"] = most
    merged.setdefault("allOf", []).append({"anyOf": [  # one weight per id
        {"properties": {"ids": {"minItems": k, "maxItems": k}, "weights": {"minItems": k, "maxItems": k}}}
        for k in range(1, most + 1)]})

"""The rules between a request body's fields, as the OpenAPI schema states them.

Each rule is an entry of JSON Schema's `dependentSchemas` keyed by the field it constrains: it
applies when that field is present, and its first alternative is the field's null (null is "not
set" everywhere in these bodies). The body stays a plain object, so schema-driven generators and
code generators read it field by field; the server answers a body that breaks a rule with a 400
naming both fields, and each field's description says the same in words.

Rules (OpenAI bodies): at most one output constraint (`response_format` json_object/json_schema,
`structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and in chat a
forced `tool_choice`); `merged_adapters` only with `model` naming a base model; chat `top_logprobs`
only with `logprobs: true`; `tool_choice: required` only with tools (a top-level `if`/`then`).
LoRAX parameters: `merged_adapters` only without an adapter (or with a base model's name);
`best_of` above 1 only sampled (do_sample, or a temperature, top_k or top_p that warps) and without
a seed; `/generate` with `stream: true` only with best_of at most 1. `merged_adapters`: one weight
per id, and a dare strategy only with a density above 0.
"""

from __future__ import annotations

from typing import Any

from lora_cluster.request.merge_spec import STRATEGIES

NULL: dict[str, Any] = {"type": "null"}
ONE_OR_NULL: dict[str, Any] = {"anyOf": [NULL, {"type": "integer", "maximum": 1}]}
# the output constraints of an OpenAI body: (field, its values that constrain, its values that do not)
_JSON_FORMAT = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object",
                                                                                        "json_schema"]}}}
_TEXT_FORMAT = {"anyOf": [NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]}
_UNFORCED = {"anyOf": [NULL, {"enum": ["none", "auto"]}]}
CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def _free(name: str) -> dict[str, Any]:
    """The values of constraint field `name` that constrain nothing."""
    return {"response_format": _TEXT_FORMAT, "tool_choice": _UNFORCED}.get(name, NULL)


def _unless_null(name: str, rule: dict[str, Any]) -> dict[str, Any]:
    """`rule`, where field `name` is set (not null)."""
    return {"anyOf": [{"properties": {name: NULL}}, rule]}


def openai_rules(base_models: list[str], chat: bool) -> dict[str, dict[str, Any]]:
    """The `dependentSchemas` of an OpenAI completions (`chat` False) or chat body."""
    fields = [*CONSTRAINTS, "tool_choice"] if chat else list(CONSTRAINTS)
    out = {name: {"anyOf": [{"properties": {name: _free(name)}},
                            {"properties": {other: _free(other) for other in fields if other != name}}]}
           for name in fields}
    out["merged_adapters"] = _unless_null("merged_adapters", {"properties": {"model": {"enum": base_models}}})
    if chat:
        out["top_logprobs"] = _unless_null("top_logprobs", {"required": ["logprobs"],
                                                            "properties": {"logprobs": {"const": True}}})
    return out


def required_tool_choice() -> dict[str, Any]:
    """A chat body's `if`/`then`: `tool_choice: required` needs at least one tool."""
    return {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


def lorax_rules(base_models: list[str]) -> dict[str, dict[str, Any]]:
    """The `dependentSchemas` of LoRAX's `parameters`."""
    sampled = {"properties": {"seed": NULL, "temperature": {"not": {"const": 0}}}, "anyOf": [
        {"properties": {"do_sample": {"const": True}}, "required": ["do_sample"]},
        {"properties": {"temperature": {"type": "number", "not": {"const": 1}}}, "required": ["temperature"]},
        {"properties": {"top_k": {"type": "integer"}}, "required": ["top_k"]},
        {"properties": {"top_p": {"type": "number", "not": {"const": 1}}}, "required": ["top_p"]}]}
    adapter_is_base = {"properties": {"adapter_id": {"anyOf": [NULL, {"enum": base_models}]}}}
    return {"merged_adapters": _unless_null("merged_adapters", adapter_is_base),
            "best_of": {"anyOf": [{"properties": {"best_of": ONE_OR_NULL}}, sampled]}}


def lorax_stream_rules() -> dict[str, dict[str, Any]]:
    """The `dependentSchemas` of a LoRAX body: with `stream: true`, best_of at most 1."""
    return {"stream": {"anyOf": [{"properties": {"stream": {"const": False}}},
                                 {"properties": {"parameters": {"properties": {"best_of": ONE_OR_NULL}}}}]}}


def merge_rules(max_ids: int) -> dict[str, dict[str, Any]]:
    """The `dependentSchemas` of `merged_adapters`: one weight per id (each count spelled out up to
    `max_ids`), and dare only with a density above 0 (it divides the kept entries by it)."""
    same = [{"properties": {"ids": {"minItems": k, "maxItems": k}, "weights": {"minItems": k, "maxItems": k}}}
            for k in range(1, max_ids + 1)]
    not_dare = [s for s in STRATEGIES if not s.startswith("dare")]
    return {"ids": {"anyOf": same},
            "merge_strategy": {"anyOf": [{"properties": {"merge_strategy": {"enum": [*not_dare, None]}}},
                                         {"properties": {"density": {"exclusiveMinimum": 0}}}]}}

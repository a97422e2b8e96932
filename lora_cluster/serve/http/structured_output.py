"""Structured-output request fields of the HTTP APIs, and their one mapping to the engine's `GuidedSpec`.

OpenAI chat and completions:
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}` (OpenAI's
  shape; `name` is 1-64 letters, digits, `_` or `-`; the schema is always enforced, `strict` or not).
  LoRAX's OpenAI routes also take `{"type": "json_object", "schema": {...}}`: a JSON schema.
- vLLM's extra fields, in the form of vLLM 0.10.2 and later: `structured_outputs` with exactly one of
  `json` (a schema, as an object or as JSON text), `regex`, `choice` (strings), `grammar` (Lark or
  GBNF text) or `json_object: true`; its options (`disable_any_whitespace`,
  `disable_additional_properties`, `whitespace_pattern`, `structural_tag`) only at their defaults.
- vLLM's older fields (vLLM up to 0.10.1; deprecated in 0.10.2, removed in 0.12.0; clients still send
  them): `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with the same meanings.

LoRAX `/generate` and `/generate_stream`: `parameters.response_format` `{"type": "json_object" |
"json_schema", "schema": {...}}` (lorax-client's `ResponseFormat`); without a schema, any JSON
object (LoRAX's default); `{"type": "text"}` is no constraint.

Invariants: a request carries at most one constraint, whichever field it comes from (two are a 400
naming both); every object here refuses unknown keys (a misplaced schema is a 400, never silently
unconstrained). Whether a schema or grammar is supported is known only when the engine compiles it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from lora_cluster.request.guided_spec import GUIDED_CHOICES_MAX, GUIDED_TEXT_MAX_BYTES, GuidedSpec
from lora_cluster.serve.http_errors import bad_request

_BOUND = f"at most {GUIDED_TEXT_MAX_BYTES} bytes"
FORMAT_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for json_schema.name
JsonSchema = Annotated[dict[str, Any], Field(description=f"A JSON schema ({_BOUND} as compact JSON).")]
# `format`s of the OpenAPI schema: `regex` is JSON Schema's; `json-schema` (the JSON text of a schema
# object) and `grammar` (Lark or GBNF) are this API's names for what JSON Schema cannot spell
SchemaText = Annotated[str, Field(min_length=2, json_schema_extra={"format": "json-schema"})]
SchemaOrText = Annotated[dict[str, Any] | SchemaText, Field(description="A JSON schema: an object, or its "
                                                            f"JSON text ({_BOUND}).")]
Pattern = Annotated[str, Field(min_length=1, json_schema_extra={"format": "regex"}, description=(
    f"A regular expression ({_BOUND}) that the whole output matches."))]
Grammar = Annotated[str, Field(min_length=1, json_schema_extra={"format": "grammar"}, description=(
    f"A context-free grammar, Lark or GBNF ({_BOUND})."))]
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(
    min_length=1, max_length=GUIDED_CHOICES_MAX, description="The output is exactly one of these strings.")]
ONLY_FALSE = WithJsonSchema({"type": "boolean", "enum": [False], "description": "Unsupported: only false."})
ONLY_NULL = WithJsonSchema({"type": "null", "description": "Unsupported: only null."})
ONE_CONSTRAINT = ("At most one output constraint per request: response_format (json_object, "
                  "json_schema), structured_outputs, guided_json, guided_regex, guided_choice, "
                  "guided_grammar, and a forced tool_choice (chat); two are a 400 naming both.")


CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # of structured_outputs


def _sets(name: str) -> dict[str, Any]:
    """JSON Schema: the object has `name`, not null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


class _Shape(BaseModel):
    """An object of a structured-output field: strict types, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaSpec(_Shape):
    name: str = Field(pattern=FORMAT_NAME, description="The format's name (OpenAI: 1-64 of a-z, A-Z, 0-9, "
                      "_ and -).")
    description: str | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class TextFormat(_Shape):
    type: Literal["text"]


class JsonObjectFormat(_Shape):
    type: Literal["json_object"]
    schema_: JsonSchema | None = Field(None, alias="schema", description="LoRAX extension: constrain the "
                                       "object to this JSON schema.")


class JsonSchemaFormat(_Shape):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Shape):
    """vLLM's `structured_outputs` (its `StructuredOutputsParams`): exactly one constraint."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [_sets(name) for name in CONSTRAINT_KEYS]})

    json_: SchemaOrText | None = Field(None, alias="json")
    regex: Pattern | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: Literal[True] | None = Field(None, description="true: any JSON object.")
    disable_any_whitespace: Annotated[bool, ONLY_FALSE] = False
    disable_additional_properties: Annotated[bool, ONLY_FALSE] = False
    whitespace_pattern: Annotated[str | None, ONLY_NULL] = None
    structural_tag: Annotated[str | None, ONLY_NULL] = None

    def constraints(self) -> dict[str, GuidedSpec]:
        """The constraints it sets, by field name (`structured_outputs.<name>`)."""
        unsupported = [name for name in ("disable_any_whitespace", "disable_additional_properties",
                                         "whitespace_pattern", "structural_tag") if getattr(self, name)]
        if unsupported:
            names = ", ".join(f"structured_outputs.{name}" for name in unsupported)
            raise bad_request(f"unsupported parameter(s): {names}", code="unsupported_parameter")
        found = {
            "json": None if self.json_ is None else schema_spec(self.json_, "structured_outputs.json"),
            "regex": None if self.regex is None else GuidedSpec.regex(self.regex),
            "choice": None if self.choice is None else GuidedSpec.choice(self.choice),
            "grammar": None if self.grammar is None else GuidedSpec.grammar(self.grammar),
            "json_object": GuidedSpec.json_object() if self.json_object else None,
        }
        out = {f"structured_outputs.{name}": spec for name, spec in found.items() if spec is not None}
        if not out:
            raise bad_request("structured_outputs sets no constraint: give one of json, regex, choice, "
                              "grammar or json_object")
        return out


class LoraxResponseFormat(_Shape):
    """LoRAX's `parameters.response_format` (lorax-client's `ResponseFormat`)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # a schema only with a JSON type
        {"properties": {"type": {"enum": ["json_object", "json_schema"]}}},
        {"properties": {"schema": {"type": "null"}}}]})

    type: Literal["text", "json_object", "json_schema"]
    schema_: JsonSchema | None = Field(None, alias="schema", description="The JSON schema; without it, any "
                                       "JSON object (json_object, json_schema); not with text.")

    def spec(self) -> GuidedSpec | None:
        if self.type == "text":
            if self.schema_ is not None:
                raise bad_request("response_format: a schema needs type json_object or json_schema, not text")
            return None
        return GuidedSpec.json_object() if self.schema_ is None else GuidedSpec.json_schema(self.schema_)


def schema_spec(schema: dict[str, Any] | str, field: str) -> GuidedSpec:
    """A JSON-schema constraint from an object or its JSON text (vLLM takes both)."""
    if isinstance(schema, str):
        if len(schema.encode()) > GUIDED_TEXT_MAX_BYTES:  # before parsing it
            raise bad_request(f"{field} is {len(schema.encode())} bytes; at most {GUIDED_TEXT_MAX_BYTES} "
                              "are allowed")
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{field} is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise bad_request(f"{field} must be a JSON schema object, got JSON {type(schema).__name__}")
    return GuidedSpec.json_schema(schema)


def response_format_spec(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> GuidedSpec | None:
    """The constraint of an OpenAI `response_format` (None: text, or none given)."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return GuidedSpec.json_object() if fmt.schema_ is None else GuidedSpec.json_schema(fmt.schema_)
    return GuidedSpec.json_schema(fmt.json_schema.schema_)


def openai_guided(response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None,
                  structured: StructuredOutputs | None, guided_json: dict[str, Any] | str | None,
                  guided_regex: str | None, guided_choice: list[str] | None,
                  guided_grammar: str | None) -> GuidedSpec | None:
    """The one constraint of an OpenAI request, from whichever field sets it; two or more are a 400
    naming them (vLLM refuses more than one kind of constraint)."""
    found: dict[str, GuidedSpec] = {}
    spec = response_format_spec(response_format)
    if spec is not None:
        found["response_format"] = spec
    if structured is not None:
        found.update(structured.constraints())
    legacy = {
        "guided_json": None if guided_json is None else schema_spec(guided_json, "guided_json"),
        "guided_regex": None if guided_regex is None else GuidedSpec.regex(guided_regex),
        "guided_choice": None if guided_choice is None else GuidedSpec.choice(guided_choice),
        "guided_grammar": None if guided_grammar is None else GuidedSpec.grammar(guided_grammar),
    }
    found.update({name: s for name, s in legacy.items() if s is not None})
    if len(found) > 1:
        raise bad_request(f"at most one structured-output constraint per request; got {len(found)}: "
                          f"{', '.join(found)}")
    return next(iter(found.values()), None)

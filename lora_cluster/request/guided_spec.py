"""What a request's output must match: the constraint a client asked for, before compilation.

The HTTP layer turns `response_format`, vLLM's structured-output fields, LoRAX's
`parameters.response_format` and forced tool calls into one `GuidedSpec`; the engine compiles it
(once per distinct spec, cached) into a grammar and masks each constrained row's logits with it.

Invariants: a spec is immutable and hashable (it is the compile cache's key); its text is bounded
by `GUIDED_TEXT_MAX_BYTES` so that a client cannot make the cache hold arbitrary amounts of memory;
a `choice` spec has 1..`GUIDED_CHOICES_MAX` non-empty strings. Invalid specs raise `RequestError`
naming the field; whether a schema or grammar is *supported* is only known when it compiles.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from lora_cluster.errors import RequestError

GUIDED_TEXT_MAX_BYTES = 256 * 1024  # a schema, regex or grammar larger than this is refused
GUIDED_CHOICES_MAX = 1024  # strings in one `choice` constraint


class GuidedKind(enum.StrEnum):
    """The kinds of constraint, with what `GuidedSpec.text` holds for each."""

    JSON_SCHEMA = "json_schema"  # text: the JSON schema, compact JSON in the client's key order
    JSON_OBJECT = "json_object"  # text: "" (any JSON object)
    REGEX = "regex"  # text: the regular expression the whole output matches
    CHOICE = "choice"  # text: "" (the output is exactly one of `choices`)
    GRAMMAR = "grammar"  # text: a context-free grammar (Lark syntax, or GBNF as vLLM/llama.cpp write it)


@dataclass(frozen=True)
class GuidedSpec:
    """One request's output constraint; equal specs compile to the same cached grammar."""

    kind: GuidedKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidedKind):
            raise RequestError(f"unknown structured-output kind {self.kind!r}")
        if len(self.text.encode()) > GUIDED_TEXT_MAX_BYTES:
            raise RequestError(
                f"the {self.kind.value} constraint is {len(self.text.encode())} bytes; "
                f"at most {GUIDED_TEXT_MAX_BYTES} are allowed"
            )
        if self.kind in (GuidedKind.REGEX, GuidedKind.GRAMMAR, GuidedKind.JSON_SCHEMA) and not self.text:
            raise RequestError(f"the {self.kind.value} constraint is empty")
        if self.kind is GuidedKind.CHOICE:
            if not 1 <= len(self.choices) <= GUIDED_CHOICES_MAX:
                raise RequestError(
                    f"a choice constraint needs 1 to {GUIDED_CHOICES_MAX} strings, got {len(self.choices)}"
                )
            if not all(isinstance(c, str) and c for c in self.choices):
                raise RequestError("every string of a choice constraint must be a non-empty string")
            if sum(len(c.encode()) for c in self.choices) > GUIDED_TEXT_MAX_BYTES:
                raise RequestError(
                    f"the choice constraint's strings exceed {GUIDED_TEXT_MAX_BYTES} bytes in all"
                )

    @classmethod
    def json_schema(cls, schema: object) -> GuidedSpec:
        """A spec from a parsed JSON schema (a dict, or True for any JSON value). Keys keep the client's
        order: the order of `properties` is the order the output writes them in (a field the model
        should reason in before another comes first), so it is part of the constraint and of its key."""
        if not isinstance(schema, dict | bool):
            raise RequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(GuidedKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GuidedSpec:
        return cls(GuidedKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> GuidedSpec:
        return cls(GuidedKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> GuidedSpec:
        return cls(GuidedKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> GuidedSpec:
        return cls(GuidedKind.GRAMMAR, text)

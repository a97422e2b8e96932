"""Seeded random JSON schemas for the structured-output tests and benchmark: nested objects, arrays with
minItems/maxItems, enums, integers and numbers with bounds, strings (maxLength, patterns), required
fields and anyOf. Every schema is closed (additionalProperties false) and bounded, so that an output can
complete: a string has at most 8 characters, an array at most 3 items, nesting at most 3 levels."""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]
WORDS = ["id", "name", "kind", "count", "price", "tags", "ok", "level", "code", "items", "note", "size"]


def random_schema(rng: random.Random) -> Schema:
    """An object schema of 1-4 properties (the top level of an extraction answer)."""
    return _object(rng, depth=0)


def _object(rng: random.Random, depth: int) -> Schema:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 3))
    props = {name: _value(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> Schema:
    kinds = ["integer", "number", "string", "enum", "boolean", "array", "object", "anyOf", "null"]
    weights = [3, 2, 3, 3, 1, 2 if depth < 3 else 0, 2 if depth < 3 else 0, 2 if depth < 3 else 0, 1]
    kind = rng.choices(kinds, weights)[0]
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.choice([0, -1, 10])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 100])}
    if kind == "string":
        if rng.random() < 0.3:
            return {"type": "string", "pattern": "^[a-z]{2,5}$"}
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "enum":
        pool = ["red", "green", "blue", "x", "yes", 1, 2, 42, None, True]
        return {"enum": rng.sample(pool, rng.randint(2, 5))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 1)}
    if kind == "object":
        return _object(rng, depth)
    return {"anyOf": [_value(rng, depth + 1), _value(rng, depth + 1)]}

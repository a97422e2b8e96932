"""Query parameters read exactly as the schema declares them: one value each, in JSON's own spelling.

FastAPI, left alone, takes the last of a repeated parameter (`?adapter=a&adapter=b` reads `b`) and
parses a typed one leniently through pydantic (`version=0.0`, `1_0` or ` +1` read as integers,
`fresh=yes` as a boolean). A client that sends such a query meant something the route cannot know, and
the schema's `integer`, `number` and `boolean` say otherwise, so both are refused as invalid requests
naming the parameter (FastAPI's 422, which the ingress answers as its 400 `invalid_parameter`,
`serve.http_errors`): a route with query parameters lists `Depends(single_values)` (a repeated name),
and annotates its typed ones with `INTEGER`, `NUMBER` or `BOOLEAN` (the value's spelling: JSON's grammar
for numbers, `true` or `false`), their bounds beside them in the same `Annotated`
(`Annotated[int | None, Query(), Field(ge=0), INTEGER]`: FastAPI's `Query(ge=...)` on an annotated type
would write `ge` into the schema instead of `minimum`). The declared schema is unchanged by either.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_BOOLEANS = ("true", "false")


def _spelled(pattern: re.Pattern[str], kind: str) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, str) and pattern.fullmatch(value) is None:
            raise ValueError(f"{value[:32]!r} is not {kind} as JSON writes it")
        return value

    return check


def _boolean(value: Any) -> Any:
    if isinstance(value, str) and value not in _BOOLEANS:
        raise ValueError(f"{value[:32]!r} is not a boolean: true or false")
    return value


INTEGER = BeforeValidator(_spelled(_INTEGER, "an integer"))
NUMBER = BeforeValidator(_spelled(_NUMBER, "a number"))
BOOLEAN = BeforeValidator(_boolean)


def single_values(request: Request) -> None:
    """Refuse (as invalid) a query that names a parameter more than once: the route declares one value."""
    seen: set[str] = set()
    for name, _ in request.query_params.multi_items():
        if name in seen:
            raise RequestValidationError([{
                "type": "repeated_parameter", "loc": ("query", name),
                "msg": f"query parameter {name[:64]!r} is given more than once; it takes one value",
                "input": [v[:64] for v in request.query_params.getlist(name)[:8]]}])
        seen.add(name)


__all__ = ["BOOLEAN", "INTEGER", "NUMBER", "single_values"]

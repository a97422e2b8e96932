"""Query parameters read exactly as the schema declares them: one value each, in JSON's own spelling.

FastAPI, left alone, takes the last of a repeated parameter (`?adapter=a&adapter=b` reads `b`) and
parses a typed one leniently through pydantic (`version=1_0`, `00` or ` 1` read as integers,
`fresh=yes` as a boolean). A client that sends such a query meant something the route cannot know, and
the schema's `integer`, `number` and `boolean` say otherwise, so both are refused as invalid requests
naming the parameter (FastAPI's 422, which the ingress answers as its 400 `invalid_parameter`,
`serve.http_errors`). A route with query parameters lists `Depends(single_values)` (a repeated name)
and annotates its typed ones with `INTEGER`, `NUMBER` or `BOOLEAN`: a number in JSON's grammar; an
integer is one without a fraction, as JSON Schema's `integer` reads it (`15`, and also `15.0` or
`1.5e1`, which schemathesis sends as valid integers; not `15.5`); a boolean `true` or `false`. Their
bounds go beside them in the same `Annotated` (`Annotated[int | None, Query(), Field(ge=0), INTEGER]`:
FastAPI's `Query(ge=...)` on an annotated type would write `ge` into the schema instead of `minimum`).
The declared schema is unchanged by either.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_BOOLEANS = ("true", "false")
_MAX_INTEGER = Decimal(2**63)  # beyond every bound a route declares; keeps int() of `1e999999999` off


def _number(value: Any) -> Any:
    if isinstance(value, str) and _NUMBER.fullmatch(value) is None:
        raise ValueError(f"{value[:32]!r} is not a number as JSON writes it")
    return value


def _integer(value: Any) -> Any:
    """A JSON number without a fraction, as JSON Schema's `integer` reads it (`15`, `15.0`, `1.5e1`)."""
    if not isinstance(value, str):
        return value
    try:
        exact = Decimal(_number(value))
        out_of_range = abs(exact) >= _MAX_INTEGER
        whole = out_of_range or exact == exact.to_integral_value()
    except ArithmeticError:  # an exponent beyond what Decimal holds
        out_of_range, whole = True, True
    if out_of_range:
        raise ValueError(f"{value[:32]!r} is out of range")
    if not whole:
        raise ValueError(f"{value[:32]!r} is not an integer: it has a fraction")
    return int(exact)


def _boolean(value: Any) -> Any:
    if isinstance(value, str) and value not in _BOOLEANS:
        raise ValueError(f"{value[:32]!r} is not a boolean: true or false")
    return value


INTEGER = BeforeValidator(_integer)
NUMBER = BeforeValidator(_number)
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

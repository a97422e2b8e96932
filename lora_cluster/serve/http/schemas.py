"""What the HTTP API's request bodies share (pydantic): the strict `Body` base, the bodies of more
than one API (`stream_options`, LoRAX's `merged_adapters`, vLLM's adapter admin routes), the input
limit checks, and the schema fragments of unsupported parameters. The bodies of each API are in
`openai_schemas` and `lorax_schemas`; the limits the OpenAPI schema states in `schema_limits`.

Input limits (400 naming the limit): `max_new_tokens`, `max_n`, `max_stop_sequences` and
`max_stop_length` (stop strings), `max_logprobs` alternatives per token, `max_merged_adapter_ids`.
Values are validated strictly (a boolean must be a JSON boolean, an integer a JSON integer), as the
OpenAPI schema states them; an integral number (2.0) is an integer, as in JSON Schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from lora_cluster.config import ServeConfig
from lora_cluster.request.merge_spec import MERGED_PREFIX, SIGN_METHODS, STRATEGIES, MergeSpec
from lora_cluster.serve.http_errors import bad_request

NonEmptyStr = Annotated[str, Field(min_length=1)]
TOKEN_ID_KEY = r"^(0|[1-9][0-9]*)$"  # a token id as a JSON object key: decimal, no sign or leading zero
SEED = "Any non-negative integer, taken modulo 2**63."
NonEmptyIds = Annotated[list[int], Field(min_length=1)]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]


def _only(schema: dict[str, Any], what: str) -> WithJsonSchema:
    """The schema of a parameter the server accepts only with these values (anything else is a 400
    naming it as unsupported), or null."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}], "description": f"Unsupported: {what}."})


# unsupported parameters, as the OpenAPI schema states them: the values that change nothing
ONE = _only({"type": "number", "minimum": 1, "maximum": 1}, "only 1 (the default)")
ONE_INT = _only({"type": "integer", "minimum": 1, "maximum": 1}, "only 1 (the default)")
EMPTY_STRING = _only({"type": "string", "maxLength": 0}, "only empty")
NULL = WithJsonSchema({"type": "null", "description": "Unsupported: only null."})
FALSE = WithJsonSchema({"type": "boolean", "enum": [False], "description": "Unsupported: only false."})


def _json_integers(value: Any) -> Any:
    """`value` with integral floats as ints: JSON Schema's integers include 2.0 (the body's depth is
    bounded before it is parsed, see `max_json_depth`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_json_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_integers(v) for k, v in value.items()}
    return value


class Body(BaseModel):
    # strict: a value must have the type the OpenAPI schema states (no `"stream": 0` or `"n": "2"`,
    # which lax pydantic would coerce while the schema promises a 400); an int is still a number,
    # and an integral number (2.0) an integer, as in JSON Schema
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        return _json_integers(data)


class StreamOptions(Body):
    include_usage: bool = False


class MergedAdaptersBody(Body):
    """LoRAX's `merged_adapters` (lorax-client's `MergedAdapters`): merge these adapters for the request
    (see `lora_cluster.store.merge`)."""

    ids: list[Annotated[str, Field(json_schema_extra={"not": {"pattern": f"^{MERGED_PREFIX}"}})]] = Field(
        min_length=1, description="Adapters to merge (1 to max_merged_adapter_ids; not merged ones).")
    weights: list[float] = Field(min_length=1, description="One weight per adapter.")
    merge_strategy: Literal[STRATEGIES] | None = Field(  # type: ignore[valid-type]
        None, description="linear (default), ties, dare_linear or dare_ties.")
    density: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of entries kept by ties and dare, in "
                           "[0, 1] (above 0 for dare).")
    majority_sign_method: Literal[SIGN_METHODS] | None = Field(  # type: ignore[valid-type]
        None, description="total (default) or frequency.")

    def spec(self, limits: ServeConfig) -> MergeSpec:
        """The validated merge (RequestError naming the field: a 400)."""
        return MergeSpec.parse(self.ids, self.weights, self.merge_strategy, self.density,
                               self.majority_sign_method, max_ids=limits.engine.max_merged_adapter_ids)


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def check_max_tokens(value: int, limits: ServeConfig, field: str) -> None:
    if value > limits.api.max_new_tokens:
        raise bad_request(f"{field}={value} exceeds the limit of {limits.api.max_new_tokens} new tokens")


def merge_of(merged: MergedAdaptersBody | None, named: str | None, limits: ServeConfig,
             admit: Callable[[str], object]) -> MergeSpec | None:
    """The request's merge (None: it asks for none). `named` is the adapter the request names otherwise
    (both at once are refused); `admit(id)` is the API's one adapter check point
    (`ModelNames.adapter_for`: unknown ids and tenants' access), run on every merged id."""
    if merged is None:
        return None
    if named is not None:
        raise bad_request(f"name at most one of an adapter ({named!r}) and merged_adapters (which then "
                          "merges onto the base model)")
    spec = merged.spec(limits)
    for adapter_id in spec.ids:
        admit(adapter_id)
    return spec


def check_logprobs(value: int | None, limits: ServeConfig, field: str) -> None:
    if value is not None and value > limits.engine.max_logprobs:
        raise bad_request(f"{field}={value} exceeds the limit of {limits.engine.max_logprobs} (max_logprobs)")


def check_stops(stops: list[str], limits: ServeConfig) -> list[str]:
    """`stops`, refused (400 naming the limit) when there are more than `max_stop_sequences` or one
    is longer than `max_stop_length` characters."""
    if len(stops) > limits.api.max_stop_sequences:
        raise bad_request(f"{len(stops)} stop sequences exceed the limit of "
                          f"max_stop_sequences={limits.api.max_stop_sequences}")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.api.max_stop_length:
        raise bad_request(f"a stop sequence of {longest} characters exceeds the limit of "
                          f"max_stop_length={limits.api.max_stop_length}")
    return stops


def check_n(n: int, limits: ServeConfig) -> None:
    if n > limits.api.max_n:
        raise bad_request(f"n={n} exceeds the limit of {limits.api.max_n}")


def token_ids_below(n: int) -> str:
    """A regex of the decimal integers in [0, n) written as `TOKEN_ID_KEY` writes them (n >= 1)."""
    top = str(n - 1)
    alternatives = ["0"]
    if len(top) > 1:  # fewer digits than n - 1
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # as many digits: equal to n - 1 up to i, then a smaller digit
        low, rest = (1 if i == 0 else 0), len(top) - i - 1
        if int(digit) > low:
            alternatives.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"

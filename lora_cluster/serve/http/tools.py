"""A chat request's tools: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and the
history's tool calls and results, as the server takes them.

Policy (OpenAI's meaning, vLLM's mechanics):

* `tool_choice` defaults to `auto` when there are tools, `none` otherwise. The tools go to the chat
  template (`apply_chat_template(..., tools=...)`) whatever the choice, as vLLM does.
* `auto`: the model decides; its output is read for calls in the model's format (`tool_calls`).
* `required` and a named function are enforced by the grammar (`SamplingParams.guided`): a named
  function's output is its arguments object (the function's `parameters` schema); `required`'s is
  a JSON array of `{"name": <one of the tools>, "parameters": <its schema>}` objects, at least one,
  exactly one with `parallel_tool_calls: false`. The tools' `$defs` move to the array's root so
  that their `#/$defs/...` references still resolve (the same name with two schemas is a 400).
* `none`: no calls are read; the output is content.

Refused with a 400 naming the field: `required` without tools, a `tool` message without
`tool_call_id`. A named function that is not among the tools is the function as the choice defines
it, without parameters (OpenAI: omitting `parameters` defines a function with an empty parameter
list): the call's arguments are `{}`. Of two tools of one name the first is used (the template and
the grammar see it alone). These are the rules JSON Schema cannot compare, so the schema a client
reads states every rule the server enforces. Names follow OpenAI's rule (letters, digits, `_` and
`-`, at most 64); at most `MAX_TOOLS` tools (OpenAI's limit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lora_cluster.errors import RequestError
from lora_cluster.request.guided_spec import GuidedSpec
from lora_cluster.serve.http_errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit of tools in one request
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without parameters
ToolMode = Literal["none", "auto", "required", "named"]


class _ToolBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_ToolBody):
    name: str = Field(pattern=FUNCTION_NAME, description="Letters, digits, `_` or `-`; at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema (none: no "
                                              "arguments).")
    strict: bool | None = Field(None, description="Accepted; forced calls (`required`, a named function) "
                                "always follow the schema.")


class ToolDefinition(_ToolBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_ToolBody):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_ToolBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_ToolBody):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class MessageToolCall(_ToolBody):
    """A call an assistant message of the history made."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """As chat templates read it (vLLM's form): the arguments parsed when they are a JSON object."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask of the server."""

    mode: ToolMode
    tools: tuple[ToolDefinition, ...]
    name: str | None = None  # mode "named": the function
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as `apply_chat_template(tools=...)` takes them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def guided(self) -> GuidedSpec | None:
        """The grammar that forces the call (None: `auto` and `none` are not forced)."""
        if self.mode == "named":
            function = next((t.function for t in self.tools if t.function.name == self.name), None)
            parameters = function.parameters if function is not None else None
            return _spec(parameters or EMPTY_PARAMETERS, self.name or "")
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            parameters = dict(tool.function.parameters or EMPTY_PARAMETERS)
            for key, schema in (parameters.pop("$defs", None) or {}).items():
                if key in defs and defs[key] != schema:
                    raise bad_request(f"tools: the $defs entry {key!r} has different schemas in two tools; "
                                      "tool_choice required needs one")
                defs[key] = schema
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                         "parameters": parameters}})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return _spec(schema, "tool_choice required")


def _spec(schema: dict[str, Any], what: str) -> GuidedSpec:
    try:
        return GuidedSpec.json_schema(schema)
    except RequestError as exc:
        raise bad_request(f"tools ({what}): {exc}") from exc


def tool_use(tools: list[ToolDefinition] | None, choice: ToolChoice | None,
             parallel: bool | None) -> ToolUse:
    """The request's tool use, checked (400 naming the field); of two tools of one name, the first."""
    first: dict[str, ToolDefinition] = {}
    for tool in tools or []:
        first.setdefault(tool.function.name, tool)
    tools = list(first.values())
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        return ToolUse("named", tuple(tools), choice.function.name, parallel is not False)
    if choice == "required" and not tools:
        raise bad_request("tool_choice required needs at least one tool in tools")
    return ToolUse(choice, tuple(tools), None, parallel is not False)

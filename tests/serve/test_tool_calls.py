"""Reading tool calls out of a chat model's output (serve/http/tool_calls.py), on fixed strings:
Hermes and Llama 3 JSON for `tool_choice: auto`, the grammar-forced shapes of `required` and a named
function, streamed in every split and read whole; and the request side (serve/http/tools.py): the
JSON schema a forced call is decoded under, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from lora_cluster.request.guided_spec import GuidedKind
from lora_cluster.serve.http.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallReader,
    collect,
    parser_for,
    reader_for,
)
from lora_cluster.serve.http.tools import FunctionDefinition, NamedToolChoice, ToolDefinition, tool_use
from lora_cluster.serve.http_errors import ApiException

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES_ONE = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>'


def _auto(parser: str, parallel: bool = True) -> ToolCallReader:
    return reader_for("auto", parser, parallel=parallel)  # type: ignore[arg-type]


def _streamed(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """Feed `pieces` one by one: (content, calls assembled as a streaming client does, all deltas)."""
    deltas: list[Any] = []
    for piece in pieces:
        deltas += reader.feed(piece)
    deltas += reader.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return content, list(calls.values()), deltas


def _chars(text: str) -> list[str]:
    return list(text)


def test_hermes_call_is_read_with_its_name_and_arguments():
    content, calls = collect(_auto("hermes"), HERMES_ONE)
    assert content is None, "an output that is only a call has no content (OpenAI's null)"
    assert len(calls) == 1, "one <tool_call> block is one call"
    assert calls[0]["type"] == "function", "a call is of type function"
    assert calls[0]["function"]["name"] == "get_weather", "the call's name is the block's"
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER, "arguments are the block's, as JSON text"
    assert calls[0]["id"].startswith("call_"), "ids look like OpenAI's call_..."


def test_hermes_keeps_the_text_around_calls_as_content_and_reads_several_calls():
    text = f"Let me check.\n{HERMES_ONE}\n" + HERMES_ONE.replace("Paris", "Oslo") + "\nDone."
    content, calls = collect(_auto("hermes"), text)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"], (
        "two blocks are two calls, in order")
    assert len({c["id"] for c in calls}) == 2, "each call has its own id"
    assert content == "Let me check.\nDone.", (
        "text before and after calls is content; whitespace just before a call is formatting")


def test_hermes_malformed_blocks_are_content_with_their_markers():
    for body in ("{not json}", '{"arguments": {}}', '{"name": "f", "arguments": [1, 2]}', ""):
        text = f"Hi <tool_call>{body}</tool_call>"
        content, calls = collect(_auto("hermes"), text)
        assert calls == [], f"{body!r} is not a call"
        assert content == text, f"a malformed block {body!r} is kept as content, nothing lost"


def test_hermes_reads_a_block_left_open_at_the_end_and_arguments_given_as_text():
    content, calls = collect(_auto("hermes"), '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert [c["function"]["name"] for c in calls] == ["f"], "a block cut at the end of the output is read"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}, "arguments given as JSON text are kept"
    assert content is None, "nothing else was said"


def test_hermes_plain_text_that_looks_like_a_marker_is_content():
    for text in ("a < b and <tool", "x <tool_cal", "<b>bold</b>"):
        content, calls = collect(_auto("hermes"), text)
        assert calls == [], f"{text!r} has no call"
        assert content == text, f"{text!r} comes back whole"


@pytest.mark.parametrize("split", ["chars", "tokens"])
def test_hermes_streaming_never_sends_part_of_a_marker_and_equals_the_whole_read(split):
    text = f"Sure. {HERMES_ONE}\n{HERMES_ONE.replace('Paris', 'Rome')}"
    pieces = _chars(text) if split == "chars" else [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls, deltas = _streamed(_auto("hermes"), pieces)
    sent = [d.text for d in deltas if isinstance(d, ContentDelta)]
    assert not any("<" in piece for piece in sent), f"no piece of a marker is sent as content: {sent}"
    assert content == "Sure.", "the content before the calls arrives"
    _, whole_calls = collect(_auto("hermes"), text)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls], (
        "streamed calls equal the calls read from the whole output")
    firsts = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [d.index for d in firsts] == [0, 1], "calls are numbered 0, 1 in order"


def test_hermes_streaming_sends_content_as_it_comes():
    reader = _auto("hermes")
    assert reader.feed("Hello") == [ContentDelta("Hello")], "plain text is sent at once"
    assert reader.feed(" <tool") == [], "what may begin a marker is held back (and the space before it)"
    assert reader.feed("box>") == [ContentDelta(" <toolbox>")], "held text is sent once it is not a marker"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = HERMES_ONE + HERMES_ONE.replace("Paris", "Rome")
    _, calls = collect(_auto("hermes", parallel=False), text)
    assert len(calls) == 1, "parallel_tool_calls false: at most one call"
    assert json.loads(calls[0]["function"]["arguments"])["city"] == "Paris", "the first call is kept"


def test_llama3_json_calls_with_and_without_python_tag():
    one = json.dumps({"name": "get_weather", "parameters": WEATHER})
    two = json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}})
    for text in (one, f"<|python_tag|>{one}", f"  {one}; {two}", f"<|python_tag|>{one};{two}"):
        content, calls = collect(_auto("llama3_json"), text)
        assert content is None, f"{text!r} is only calls"
        assert calls[0]["function"]["name"] == "get_weather", f"{text!r}: the first call's name"
        assert json.loads(calls[0]["function"]["arguments"]) == WEATHER, f"{text!r}: parameters are arguments"
        if ";" in text:
            assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"], (
                f"{text!r}: ;-separated calls are all read")


def test_llama3_json_text_and_malformed_output_is_content():
    for text in ("The weather is fine.", '{"name": "f"', '{"city": "Paris"}',
                 '{"name": "f", "parameters": 3}', '{"name": "f", "parameters": {}} trailing words',
                 "<|python_tag|>print(1)"):
        content, calls = collect(_auto("llama3_json"), text)
        assert calls == [], f"{text!r} has no call"
        assert content == text, f"{text!r} comes back whole as content"


def test_llama3_json_streaming_holds_a_call_and_streams_text():
    one = json.dumps({"name": "f", "parameters": {"x": 1}})
    content, calls, _ = _streamed(_auto("llama3_json"), _chars("<|python_tag|>" + one))
    assert content == "", "nothing of a call is sent as content"
    assert [c["name"] for c in calls] == ["f"], "the call arrives at the end"
    reader = _auto("llama3_json")
    assert reader.feed("Hi") == [ContentDelta("Hi")], "text that cannot start a call is sent at once"
    assert reader.feed(" {") == [ContentDelta(" {")], "once text, always text"


def test_named_function_output_streams_as_its_arguments():
    reader = reader_for("named", "hermes", name="get_weather")
    first = reader.feed('{"city"')
    rest = reader.feed(': "Paris"}')
    assert first == [ToolCallDelta(0, '{"city"', first[0].id, "get_weather")], (
        "the first piece has the id, the name and the first arguments")
    assert rest == [ToolCallDelta(0, ': "Paris"}')], "later pieces carry arguments only"
    assert reader.finish() == [], "nothing is left at the end"
    _, calls = collect(reader_for("named", "hermes", name="get_weather"), '{"city": "Paris"}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}, "read whole: the same call"


def test_required_output_array_is_read_item_by_item():
    items = [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": {"z": "}]"}}]
    text = json.dumps(items)
    content, calls, _ = _streamed(reader_for("required", "hermes"), _chars(text))
    assert content == "", "a whole array is only calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (i["name"], i["parameters"]) for i in items], "each item is a call; brackets in strings do not count"
    reader = reader_for("required", "hermes")
    cut = text.index("get_time") - 10
    sent = reader.feed(text[:cut])
    assert [d.name for d in sent if isinstance(d, ToolCallDelta) and d.id] == ["get_weather"], (
        "the second call has not started before its name is in")


def test_required_arguments_stream_once_the_name_is_in():
    reader = reader_for("required", "hermes")
    assert reader.feed('[{"name": "f", "param') == [], "nothing is sent before the arguments start"
    first = reader.feed('eters": {"a"')
    assert [(d.index, d.name, d.arguments) for d in first] == [(0, "f", ""), (0, None, '{"a"')], (
        "the call starts with its id and name, then its arguments so far")
    assert first[0].id.startswith("call_"), "the first delta carries the call's id"
    assert reader.feed(": 1}\n  ") == [ToolCallDelta(0, ": 1}")], "arguments come as they are generated"
    assert reader.feed("}]") == [], "the item's closing brace and the whitespace before it are not arguments"
    assert reader.finish() == [], "nothing is left at the end"


def test_required_output_cut_short_keeps_what_it_has():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param'
    content, calls = collect(reader_for("required", "hermes"), text)
    assert [c["function"]["name"] for c in calls] == ["f"], "the finished item is a call"
    assert content == ', {"name": "g", "param', "an item cut before its call started is content, not lost"
    content, calls = collect(reader_for("required", "hermes"), '[{"name": "f", "parameters": {"a": 1')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"a": 1')], (
        "a call cut inside its arguments keeps them cut, as a named function's")
    assert content is None, "and nothing else"


def test_no_tools_reader_is_plain_content():
    content, calls = collect(reader_for("none", "hermes"), HERMES_ONE)
    assert calls == [], "tool_choice none reads no calls"
    assert content == HERMES_ONE, "the output is content as it is"
    assert collect(reader_for("none", "hermes"), "")[0] == "", "an empty output is empty content"


def test_parser_choice_from_the_chat_template_and_configuration():
    assert parser_for("auto", "... <tool_call>\\n{{ tool }} ...") == "hermes", "a Hermes template: hermes"
    llama = '{"name": function name, "parameters": dictionary} <|python_tag|>'
    assert parser_for("auto", llama) == "llama3_json", "a Llama 3.1 template: llama3_json"
    assert parser_for("auto", None) == "hermes", "no template: hermes"
    assert parser_for("llama3_json", "<tool_call>") == "llama3_json", "the configured parser wins"


# ----- request side: the forced grammar and what is refused -------------------------------------------------

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer",
          "minimum": 1}}, "required": ["city"], "additionalProperties": False}


def _tool(name: str, parameters: dict[str, Any] | None = PARAMS) -> ToolDefinition:
    return ToolDefinition(type="function", function=FunctionDefinition(name=name, parameters=parameters))


def _named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_named_choice_is_forced_to_the_functions_parameters():
    spec = tool_use([_tool("a"), _tool("b", None)], _named("a"), None).guided()
    assert spec is not None and spec.kind is GuidedKind.JSON_SCHEMA, "a named choice is a JSON schema"
    assert json.loads(spec.text) == PARAMS, "the schema is the named function's parameters (vLLM)"
    empty = tool_use([_tool("a"), _tool("b", None)], _named("b"), None).guided()
    assert json.loads(empty.text) == {"type": "object", "properties": {}}, (
        "a function without parameters takes an empty object")


def test_required_choice_is_an_array_of_named_calls():
    schema = json.loads(tool_use([_tool("a"), _tool("b")], "required", None).guided().text)
    valid = [{"name": "a", "parameters": {"city": "x"}},
             {"name": "b", "parameters": {"city": "y", "days": 2}}]
    jsonschema.validate(valid, schema)
    for bad, why in (([], "at least one call"),
                     ([{"name": "c", "parameters": {"city": "x"}}], "a known name"),
                     ([{"name": "a", "parameters": {"days": 1}}], "the function's own schema"),
                     ([{"name": "a"}], "parameters present")):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad), f"the schema requires {why}"
    one = json.loads(tool_use([_tool("a")], "required", False).guided().text)
    assert not jsonschema.Draft202012Validator(one).is_valid(valid[:1] * 2), (
        "parallel_tool_calls false: exactly one call")


def test_required_choice_moves_defs_to_the_root():
    with_defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
                 "$defs": {"P": {"type": "integer"}}}
    schema = json.loads(tool_use([_tool("a", with_defs)], "required", None).guided().text)
    jsonschema.validate([{"name": "a", "parameters": {"p": 3}}], schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid([{"name": "a", "parameters": {"p": "x"}}]), (
        "a $ref of a tool's parameters still resolves to its definition")
    clash = {**with_defs, "$defs": {"P": {"type": "string"}}}
    with pytest.raises(ApiException) as info:
        tool_use([_tool("a", with_defs), _tool("b", clash)], "required", None).guided()
    assert "P" in info.value.error.message, "two tools defining P differently is a 400 naming it"


def test_auto_and_none_are_not_forced_and_defaults_follow_openai():
    assert tool_use([_tool("a")], "auto", None).guided() is None, "auto is not constrained"
    assert tool_use([_tool("a")], None, None).mode == "auto", "with tools the default is auto"
    assert tool_use(None, None, None).mode == "none", "without tools the default is none"


def test_a_named_function_not_among_the_tools_is_called_without_parameters():
    use = tool_use([_tool("a")], _named("b"), None)
    assert use.mode == "named" and use.name == "b", "the named function is forced, not refused"
    assert use.guided() is not None, "its call is forced by a grammar (arguments: an empty parameter list)"


def test_of_two_tools_of_one_name_the_first_is_used():
    first = {"type": "function", "function": {"name": "a", "description": "first"}}
    second = {"type": "function", "function": {"name": "a", "description": "second"}}
    tools = [ToolDefinition.model_validate(first), ToolDefinition.model_validate(second)]
    use = tool_use(tools, "auto", None)
    assert [t.function.description for t in use.tools] == ["first"], "the first definition of a name is kept"


@pytest.mark.parametrize(("tools", "choice", "needle"), [
    ([], "required", "at least one tool"),
])
def test_inconsistent_tools_are_a_400_naming_the_problem(tools, choice, needle):
    choice_value: Any = {"named": _named("a"), "named-b": _named("b")}.get(choice, choice)
    with pytest.raises(ApiException) as info:
        tool_use([_tool(n) for n in tools], choice_value, None)
    assert info.value.error.status == 400, f"{tools} with {choice}: the client's error"
    assert needle in info.value.error.message, f"the message names the problem: {info.value.error.message}"

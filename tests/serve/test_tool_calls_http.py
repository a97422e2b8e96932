"""Tool calls through the OpenAI chat route (the ingress app in process, `app_client.serving`) with a
scripted replica: each choice's output is fixed text arriving in fixed pieces, so that what the server
makes of a model's tool calls (Hermes, Llama 3 JSON, the grammar-forced shapes) is checked exactly,
streamed and not, raw and through the `openai` client. What reaches the chat template (tools, calls
and results of the history) and the grammar a forced call is decoded under are checked on the job."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from app_client import FakeDispatcher, FakeStream, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.request.guided_spec import GuidedKind
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
USER = [{"role": "user", "content": "weather in Paris?"}]
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


class ToolsTokenizer(FakeTokenizer):
    """The fake tokenizer whose chat template takes tools; it records what it was given."""

    chat_template = "<tool_call> (a Hermes template)"

    def __init__(self) -> None:
        self.rendered: list[tuple[list[dict[str, Any]], Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            tokenize: bool, tools: list[dict[str, Any]] | None = None) -> str:
        self.rendered.append((messages, tools))
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


class ScriptedDispatcher(FakeDispatcher):
    """A replica whose every choice generates `pieces` (one output item each) and ends with EOS."""

    def __init__(self, pieces: list[str]):
        super().__init__()
        self.pieces = pieces

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        items, text = [], ""
        for i, piece in enumerate(self.pieces, start=1):
            text += piece
            done = i == len(self.pieces)
            items.append({"text": text if done else None, "delta_text": piece, "delta_token_ids": [1],
                          "token_ids": [1] * i if done else None, "finished": done,
                          "finish_reason": "eos" if done else None, "prompt_tokens": len(job.prompt),
                          "completion_tokens": i, "ttft_s": 0.0})
        items[0] = {"replica": "r1", "hit": True, **items[0]}
        return Generation(job=job, replica="r1", hit=True, first=items[0], stream=FakeStream(items[1:]))


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


async def _chat(pieces: list[str], config: ServeConfig | None = None, **body: Any,
                ) -> tuple[httpx.Response, ScriptedDispatcher, ToolsTokenizer]:
    dispatcher, tokenizer = ScriptedDispatcher(pieces), ToolsTokenizer()
    async with serving(tokenizer, dispatcher, config) as client:
        response = await client.post("/v1/chat/completions", json={"model": "base", "messages": USER, **body})
    return response, dispatcher, tokenizer


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", "the stream ends with [DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_auto_reads_hermes_calls_into_openai_tool_calls():
    response, dispatcher, tokenizer = await _chat(_pieces(HERMES), tools=[WEATHER, TIME])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"], "both calls, in order"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}, "arguments as JSON text"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls), "OpenAI's call shape"
    assert choice["message"]["content"] is None, "an answer that only calls tools has null content"
    assert choice["finish_reason"] == "tool_calls", "a choice that called tools finishes with tool_calls"
    assert tokenizer.rendered[-1][1] == [WEATHER, TIME], "the tools are passed to the chat template"
    assert dispatcher.jobs[0].sampling.guided is None, "auto is not constrained by a grammar"


async def test_auto_streams_hermes_calls_as_tool_call_deltas_and_no_marker_as_content():
    text = "Checking. " + HERMES
    response, _, _ = await _chat(_pieces(text, 2), tools=[WEATHER, TIME], stream=True)
    events = _events(response)
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking.", f"only the text before the calls is content: {content!r}"
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    firsts = [p for p in pieces if "id" in p]
    assert [(p["index"], p["function"]["name"]) for p in firsts] == [(0, "get_weather"), (1, "get_time")], (
        "each call's first delta carries its index, id and name")
    assert all(p["type"] == "function" for p in firsts), "a call's first delta says type function"
    arguments = {i: "".join(p["function"]["arguments"] for p in pieces if p["index"] == i) for i in (0, 1)}
    assert json.loads(arguments[1]) == {"zone": "CET"}, "the arguments arrive as JSON text"
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"], "the last chunk finishes with tool_calls"


async def test_llama3_json_parser_is_configurable():
    config = ServeConfig(model="base", tool_call_parser="llama3_json")
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    response, _, _ = await _chat(_pieces(text), config, tools=[WEATHER])
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}], (
        "the Llama 3 JSON call is read with the configured parser")
    hermes, _, _ = await _chat(_pieces(HERMES), config, tools=[WEATHER])
    assert hermes.json()["choices"][0]["message"]["content"] == HERMES, (
        "with llama3_json configured, Hermes blocks are plain content")


async def test_plain_answers_and_tool_choice_none_are_content():
    response, _, _ = await _chat(_pieces("Hello there"), tools=[WEATHER])
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "Hello there", "an answer without calls is content"
    assert "tool_calls" not in choice["message"], "no calls, no tool_calls"
    assert choice["finish_reason"] == "stop", "it stops as usual"
    none, _, tokenizer = await _chat(_pieces(HERMES), tools=[WEATHER], tool_choice="none")
    assert none.json()["choices"][0]["message"]["content"] == HERMES, "tool_choice none reads no calls"
    assert tokenizer.rendered[-1][1] == [WEATHER], "the tools still reach the template (vLLM's default)"


async def test_a_named_function_is_forced_by_its_schema_and_streamed_as_arguments():
    named = {"type": "function", "function": {"name": "get_weather"}}
    response, dispatcher, _ = await _chat(_pieces('{"city": "Rome"}'), tools=[WEATHER, TIME],
                                          tool_choice=named, stream=True)
    guided = dispatcher.jobs[0].sampling.guided
    assert guided is not None and guided.kind is GuidedKind.JSON_SCHEMA, "a named function is a JSON schema"
    assert json.loads(guided.text) == WEATHER["function"]["parameters"], "the function's parameters schema"
    pieces = [p for e in _events(response) for p in e["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather", "the first delta names the function"
    assert len(pieces) > 1, "the arguments are streamed in several deltas"
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Rome"}, (
        "the streamed arguments join into the output")


async def test_required_is_forced_to_an_array_of_calls_and_read_as_calls():
    text = json.dumps([{"name": "get_time", "parameters": {"zone": "UTC"}},
                       {"name": "get_weather", "parameters": {"city": "Lima"}}])
    response, dispatcher, _ = await _chat(_pieces(text), tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(dispatcher.jobs[0].sampling.guided.text)
    assert schema["type"] == "array" and schema["minItems"] == 1, "required: an array of at least one call"
    choice = response.json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time", "get_weather"], (
        "each item is a call")
    assert choice["finish_reason"] == "tool_calls", "the choice finishes with tool_calls"
    _, single, _ = await _chat(_pieces(text), tools=[WEATHER], tool_choice="required",
                               parallel_tool_calls=False)
    assert json.loads(single.jobs[0].sampling.guided.text)["maxItems"] == 1, (
        "parallel_tool_calls false: exactly one call")


async def test_the_history_s_calls_and_results_reach_the_template():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    dispatcher, tokenizer = ScriptedDispatcher(["It is sunny."]), ToolsTokenizer()
    async with serving(tokenizer, dispatcher) as client:
        response = await client.post("/v1/chat/completions", json={"model": "base", "messages": history,
                                                                   "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    messages = tokenizer.rendered[-1][0]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}, (
        "an assistant's call reaches the template with its arguments as an object (vLLM's form)")
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}, (
        "a tool result reaches the template with the call it answers")


@pytest.mark.parametrize(("body", "needle"), [
    ({"tool_choice": "required"}, "at least one tool"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
])
async def test_inconsistent_tool_requests_are_a_400_naming_the_field(body, needle):
    response, dispatcher, _ = await _chat(["x"], **body)
    assert response.status_code == 400, f"{body}: {response.text}"
    assert needle in response.json()["error"]["message"], f"the error names it: {response.text}"
    assert dispatcher.jobs == [], "nothing was generated"


async def test_the_openai_client_reads_tool_calls_streamed_and_not():
    openai = pytest.importorskip("openai")
    for stream in (False, True):
        dispatcher, tokenizer = ScriptedDispatcher(_pieces(HERMES)), ToolsTokenizer()
        async with serving(tokenizer, dispatcher) as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http)
            if stream:
                async with client.chat.completions.stream(model="base", messages=USER,
                                                          tools=[WEATHER, TIME]) as events:
                    async for _ in events:
                        pass
                    completion = await events.get_final_completion()
            else:
                completion = await client.chat.completions.create(model="base", messages=USER,
                                                                  tools=[WEATHER, TIME])
        message = completion.choices[0].message
        assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"], (
            f"stream={stream}: the client reads both calls")
        assert json.loads(message.tool_calls[1].function.arguments) == {"zone": "CET"}, (
            f"stream={stream}: the client reads the arguments")
        assert completion.choices[0].finish_reason == "tool_calls", f"stream={stream}: finish reason"


async def test_required_streams_each_call_s_arguments_as_they_come():
    text = json.dumps([{"name": "get_time", "parameters": {"zone": "UTC"}},
                       {"name": "get_weather", "parameters": {"city": "Lima"}}])
    response, _, _ = await _chat(_pieces(text, 4), tools=[WEATHER, TIME], tool_choice="required", stream=True)
    events = _events(response)
    pieces = [p for e in events for p in e["choices"][0]["delta"].get("tool_calls", [])]
    starts = [(p["index"], p["function"]["name"]) for p in pieces if "id" in p]
    assert starts == [(0, "get_time"), (1, "get_weather")], "each call starts with its index, id and name"
    arguments = {i: [p["function"]["arguments"] for p in pieces if p["index"] == i] for i in (0, 1)}
    assert len(arguments[1]) > 2, f"the arguments come in several deltas: {arguments[1]}"
    assert json.loads("".join(arguments[1])) == {"city": "Lima"}, "they join into the call's arguments"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls", "the stream finishes with tool_calls"

"""Tool calls end to end through Ray Serve (the several-bases app, conftest's `bases_app`: its `llama`
group is one LoRA replica on CPU of the tiny demo zoo and its tool-capable chat template) with the real
`openai` client, streamed and not.

The demo model's weights are random, so what it says is gibberish; `tool_choice: required` and a named
function are enforced by the engine's grammar, so their calls must still be well formed: every call
names one of the tools and its arguments validate against that function's schema (`jsonschema`), for
several adapters in one batch, greedy and sampled.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import jsonschema
import pytest

pytestmark = pytest.mark.e2e

ADAPTERS = ["a0", "a1", "a2", "a3"]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["guests"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
MAX_TOKENS = 140  # the tiny model has 512 positions; the prompt with both tools is 368 tokens


@pytest.fixture(scope="module")
def client(bases_app):
    """The demo adapters' group is one replica whose batch holds a whole `_batch` (16 requests, 4
    adapters) at once (`shared_apps.bases_config`)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{bases_app}/v1", api_key="unused", timeout=300, max_retries=0)


def _ask(client: Any, adapter: str, stream: bool, seed: int | None, **tools: Any) -> dict[str, Any]:
    """One chat completion with tools, as the client reads it: finish reason, content and calls (id,
    name, arguments); streamed, the calls are assembled from the deltas by their index."""
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    body = {"model": adapter, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **sampling, **tools}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {"finish": choice.finish_reason, "content": choice.message.content, "calls": calls}
    finish, content, pieces = None, "", {}
    for chunk in client.chat.completions.create(**body, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                pieces[piece.index] = [piece.id, piece.function.name, ""]
            pieces[piece.index][2] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"finish": finish, "content": content or None, "calls": [tuple(c) for c in pieces.values()]}


def _check_calls(answer: dict[str, Any], where: str) -> list[tuple[str, str, str]]:
    """Every call of the answer names a tool and its arguments fit that tool's schema; an answer cut
    off by max_tokens (`length`) may end in a call whose arguments are cut. A completed answer is
    only calls."""
    cut = answer["finish"] == "length"
    for index, (call_id, name, arguments) in enumerate(answer["calls"]):
        assert call_id.startswith("call_"), f"{where}: an OpenAI call id: {call_id}"
        assert name in SCHEMAS, f"{where}: the call names a tool: {name}"
        if not (cut and index == len(answer["calls"]) - 1):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert answer["finish"] in ("tool_calls", "length"), f"{where}: forced calls end so: {answer}"
    if answer["finish"] == "tool_calls":
        assert answer["calls"], f"{where}: a completed forced choice calls a tool: {answer}"
        assert answer["content"] is None, f"{where}: a completed forced choice is only calls: {answer}"
    return answer["calls"]


def _completed(answers: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The answers whose grammar completed within max_tokens: most, and never none (the random model
    may spend up to 18 tokens on whitespace between two JSON tokens, as the engine allows)."""
    done = [answer for _, answer in answers if answer["finish"] == "tool_calls"]
    assert len(done) * 2 > len(answers), f"most forced calls complete: {[a for _, a in answers]}"
    return done


def _batch(client: Any, **tools: Any) -> list[tuple[str, dict[str, Any]]]:
    """The same request for every adapter, streamed and not, greedy and sampled, all at once."""
    cases = [(a, stream, seed) for a in ADAPTERS for stream in (False, True) for seed in (None, 7)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: _ask(client, *c, **tools), cases))
    return [(f"adapter {a}, stream={s}, seed={seed}", answer)
            for (a, s, seed), answer in zip(cases, answers, strict=True)]


def test_required_calls_are_valid_for_their_functions(client):
    answers = _batch(client, tools=TOOLS, tool_choice="required")
    for where, answer in answers:
        _check_calls(answer, where)
    _completed(answers)


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "book"}}
    answers = _batch(client, tools=TOOLS, tool_choice=named)
    for where, answer in answers:
        calls = _check_calls(answer, where)
        assert [name for _, name, _ in calls] in ([], ["book"]), f"{where}: only the named function"
    assert all(len(a["calls"]) == 1 for a in _completed(answers)), "a completed named choice is one call"


def test_required_without_parallel_calls_makes_exactly_one_call(client):
    answers = _batch(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for where, answer in answers:
        assert len(_check_calls(answer, where)) <= 1, f"{where}: at most one call without parallel calls"
    assert all(len(a["calls"]) == 1 for a in _completed(answers)), "a completed answer is one call"


def test_a_conversation_with_calls_and_results_continues(client):
    first = client.chat.completions.create(model="a1", messages=MESSAGES, tools=[WEATHER], temperature=0.0,
                                           max_tokens=MAX_TOKENS, tool_choice="required",
                                           parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="a1", messages=history, tools=[WEATHER], max_tokens=8,
                                            temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), (
        f"the model answers after the tool's result: {answer.choices[0]}")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens, (
        "the call and its result are part of the second prompt")


def test_a_tool_schema_the_grammar_cannot_enforce_is_a_400_naming_it(client):
    import openai

    unique = {"type": "function", "function": {"name": "tags", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "tags"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="a2", messages=MESSAGES, tools=[unique], tool_choice=choice,
                                           max_tokens=8)
        assert "uniqueItems" in str(info.value), f"{choice}: the 400 names the construct: {info.value}"

"""A prompt over the prompt limit: fitted to its latest part with prompt_truncation auto (the default),
refused with disabled; token-id prompts over it are refused either way (the schema states their bound).

The policy (`serve.http.truncation`) is tested on its own with a counting renderer, then through the
ingress's FastAPI app in process (one token per character, `role: content` lines)."""

from __future__ import annotations

from typing import Any

import pytest
from app_client import FakeDispatcher
from test_input_limits import CHAT, LORAX, OK, limited_app, refusal

from lora_cluster.serve.http.truncation import HEADER_TRUNCATED, fit_conversation, keep_last


def render(messages: list[dict[str, Any]]) -> list[int]:
    """One token per character of `role: content` lines, like app_client's tokenizer."""
    return [ord(c) for m in messages for c in f"{m['role']}: {m['content']}\n"]


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def test_keep_last_keeps_the_latest_tokens_and_a_leading_bos():
    assert keep_last([1, 2, 3], 3).ids == [1, 2, 3], "a prompt within the limit is unchanged"
    assert keep_last([1, 2, 3, 4, 5], 3).ids == [3, 4, 5], "a longer prompt keeps its last tokens"
    assert keep_last([1, 2, 3, 4, 5], 3).truncated == 2, "it counts the tokens cut"
    assert keep_last([9, 2, 3, 4, 5], 3, bos=9).ids == [9, 4, 5], "a leading BOS stays first"


def test_a_conversation_drops_its_oldest_turns_and_keeps_the_system_message():
    turns = [msg("system", "s"), msg("user", "u" * 20), msg("assistant", "a" * 20), msg("user", "q1"),
             msg("assistant", "a2"), msg("user", "q2")]
    full = len(render(turns))
    fitted = fit_conversation(turns, render, full - 1)
    kept = render([turns[0], *turns[3:]])
    assert fitted.ids == kept, "it keeps the system message and the latest turns, from a user message"
    assert fitted.truncated == full - len(kept), "it counts the tokens cut from the whole conversation"
    assert fit_conversation(turns, render, full).ids == render(turns), "a conversation that fits is whole"


def test_a_conversation_keeps_as_many_recent_messages_as_fit():
    turns = [msg("user", f"q{i}") for i in range(10, 50)]  # 10 tokens each
    for limit in (10, 35, 100, 399):
        fitted = fit_conversation(turns, render, limit)
        kept = limit // 10
        assert fitted.ids == render(turns[len(turns) - kept:]), f"the latest {kept} messages at limit {limit}"


def test_a_last_message_longer_than_the_limit_keeps_its_end():
    turns = [msg("system", "s"), msg("user", "x" * 50)]
    fitted = fit_conversation(turns, render, 10)
    assert fitted.ids == render(turns)[-10:], "the last tokens of the shortest conversation"
    assert fitted.truncated == len(render(turns)) - 10, "the cut is counted"


def test_a_template_refusing_an_order_is_not_a_fit():
    def strict(messages: list[dict[str, Any]]) -> list[int]:
        if messages and messages[0]["role"] != "user":
            raise ValueError("conversations start with a user message")
        return render(messages)

    turns = [msg("user", "q" * 20), msg("assistant", "a"), msg("tool", "t"), msg("user", "q2")]
    fitted = fit_conversation(turns, strict, len(render(turns)) - 1)
    assert fitted.ids == render(turns[3:]), "it starts at a user message, never at the tool result"


async def test_a_long_text_prompt_is_served_on_its_last_tokens_and_says_so():
    dispatcher = FakeDispatcher()
    async with limited_app(dispatcher) as client:
        r = await client.post("/v1/completions", json={**OK, "prompt": "a" * 10 + "b" * 24})
    assert r.status_code == 200, f"served: {r.text}"
    assert dispatcher.jobs[0].prompt == [ord("b")] * 24, "the engine gets the prompt's last 24 tokens"
    assert r.headers.get(HEADER_TRUNCATED) == "10", "the header counts the tokens cut"
    assert r.json()["usage"]["prompt_tokens"] == 24, "usage counts the prompt as it ran"


async def test_a_long_conversation_is_served_on_its_latest_turns():
    dispatcher = FakeDispatcher()
    old = [{"role": "user", "content": "o" * 30}]
    async with limited_app(dispatcher, max_prompt_tokens=30) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "messages": old + CHAT["messages"]})
    assert r.status_code == 200, f"served: {r.text}"
    assert dispatcher.jobs[0].prompt == [ord(c) for c in "user: hi\nassistant: "], "the latest message"
    assert int(r.headers[HEADER_TRUNCATED]) == len("user: ") + 30 + 1, "the header counts the oldest message"


async def test_lorax_inputs_are_fitted_too():
    dispatcher = FakeDispatcher()
    async with limited_app(dispatcher) as client:
        r = await client.post("/generate", json={**LORAX, "inputs": "z" * 30})
    assert r.status_code == 200, f"served: {r.text}"
    assert len(dispatcher.jobs[0].prompt) == 24, "the engine gets the last 24 tokens"
    assert r.headers.get(HEADER_TRUNCATED) == "6", "the header counts the tokens cut"


async def test_a_prompt_that_fits_has_no_truncation_header():
    async with limited_app() as client:
        r = await client.post("/v1/completions", json=OK)
    assert HEADER_TRUNCATED not in r.headers, "nothing cut, no header"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {**OK, "prompt": "x" * 25}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 25}]}),
    ("/generate", {**LORAX, "inputs": "x" * 25}),
])
async def test_disabled_refuses_a_long_prompt_naming_the_limit(path, body):
    async with limited_app(prompt_truncation="disabled") as client:
        r = await client.post(path, json=body)
    refusal(r, "prompt_too_long", "24")


async def test_token_ids_over_the_limit_are_refused_even_with_auto():
    async with limited_app() as client:
        r = await client.post("/v1/completions", json={**OK, "prompt": [120] * 25})
    refusal(r, "prompt_too_long", "25 tokens", "24")

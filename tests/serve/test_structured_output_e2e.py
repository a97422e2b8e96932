"""Structured output and best_of end to end through Ray Serve: one app (ingress + 2 LoRA replicas on CPU,
the demo zoo) shared by every test here and test_serve_e2e.py (conftest's `demo_app`:
`shared_apps.demo_config`, n and best_of at most 4); clients: the real `openai` SDK, `lorax-client`, httpx.

The demo model is random: its text is gibberish and its JSON is whatever the grammar lets it write, so the
tests check structure (the output parses and validates against the schema), never content. Several
adapters are asked at once (threads), so their constrained rows share the replicas' batches.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

ADAPTERS = ["a0", "a1", "a2", "a3"]
PROMPT = "the quick brown fox"
MAX_TOKENS = 200  # the schemas below are bounded: a grammar-complete document is far shorter


class Verdict(BaseModel):
    """A classification: every field bounded, so a random model finishes the document."""

    label: Literal["spam", "ham", "unsure"]
    score: int = Field(ge=0, le=100)
    urgent: bool
    note: str = Field(max_length=8)


# its schema closed to other keys (as openai's parse sends it), or a random model may add a key with a
# free-text value and write it until max_tokens
SCHEMA = {**Verdict.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def base_url(demo_app):
    return demo_app


@pytest.fixture(scope="module")
def client(base_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=180, max_retries=0)


def in_parallel(fn, args: list) -> list:
    """`fn(arg)` for every arg at once (one thread each), results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def messages(adapter: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"classify this message for {adapter}: {PROMPT}"}]


def test_openai_parse_returns_a_parsed_object_for_several_adapters_at_once(client):
    def parse(adapter: str):
        return client.chat.completions.parse(model=adapter, messages=messages(adapter),
                                             response_format=Verdict, max_tokens=MAX_TOKENS, temperature=0.8,
                                             seed=1)

    completions = in_parallel(parse, ADAPTERS)
    for adapter, completion in zip(ADAPTERS, completions, strict=True):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", f"{adapter}: the document ended by its grammar: {choice}"
        assert isinstance(choice.message.parsed, Verdict), f"{adapter}: parse returns a Verdict: {choice}"
        assert completion.model == adapter, f"{adapter}: answered by the adapter asked for"
    texts = {c.choices[0].message.content for c in completions}
    assert len(texts) > 1, f"four adapters do not all write the same document: {texts}"


def test_openai_streamed_parse_returns_a_parsed_object_for_several_adapters_at_once(client):
    stream = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream

    def streamed(adapter: str):
        with stream(model=adapter, messages=messages(adapter), response_format=Verdict, max_tokens=MAX_TOKENS,
                    temperature=0.8, seed=2) as events:
            deltas = [e.delta for e in events if e.type == "content.delta"]
            return deltas, events.get_final_completion()

    for adapter, (deltas, final) in zip(ADAPTERS, in_parallel(streamed, ADAPTERS), strict=True):
        choice = final.choices[0]
        assert isinstance(choice.message.parsed, Verdict), f"{adapter}: the stream parses: {choice}"
        assert len(deltas) > 1, f"{adapter}: the document came in several chunks: {deltas}"
        assert "".join(deltas) == choice.message.content, f"{adapter}: the chunks join to the document"


def test_json_object_and_vllm_fields_constrain_the_output(client):
    def ask(case: tuple[str, dict]):
        adapter, extra = case
        return client.completions.create(model=adapter, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8,
                                         seed=3, extra_body=extra).choices[0]

    cases = [
        ("a0", {"response_format": {"type": "json_object"}}),
        ("a1", {"structured_outputs": {"choice": ["positive", "negative"]}}),
        ("a2", {"guided_regex": r"(INV|PO)-[0-9]{4,8}"}),
        ("a3", {"guided_json": SCHEMA}),
        ("a0", {"structured_outputs": {"grammar": 'start: NUM "+" NUM\nNUM: /[0-9]{1,3}/'}}),
    ]
    first, choice, regex, schema, grammar = in_parallel(ask, cases)
    assert isinstance(json.loads(first.text), dict), f"json_object: a JSON object: {first.text!r}"
    assert choice.text in ("positive", "negative"), f"choice: one of the strings: {choice.text!r}"
    assert re.fullmatch(r"(INV|PO)-[0-9]{4,8}", regex.text), f"guided_regex: a full match: {regex.text!r}"
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", grammar.text), f"grammar: its language: {grammar.text!r}"


def test_an_unsupported_schema_is_a_400_naming_the_construct_and_others_are_served(base_url):
    bad = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": "a1", "messages": messages("a1"), "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "Bad", "schema": {"type": "object", "not": {"required": ["x"]}}}}})
    good = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "a1", "prompt": PROMPT, "max_tokens": 4})
    assert bad.status_code == 400, f"an unsupported construct is the client's error: {bad.text}"
    assert "not" in bad.json()["error"]["message"], f"the message names the construct: {bad.text}"
    assert good.status_code == 200, f"the adapter keeps serving: {good.text}"


def test_lorax_client_response_format_works_unmodified(base_url):
    lorax = pytest.importorskip("lorax", reason="pip install --no-deps lorax-client")
    client = lorax.Client(base_url, timeout=180)
    def generate(adapter: str):
        return client.generate(PROMPT, adapter_id=adapter, max_new_tokens=MAX_TOKENS,
                               response_format={"type": "json_object", "schema": SCHEMA})

    for adapter, response in zip(ADAPTERS, in_parallel(generate, ADAPTERS), strict=True):
        jsonschema.validate(json.loads(response.generated_text), SCHEMA)
        assert response.details.finish_reason.value != "length", f"{adapter}: ended by its grammar"
    typed = lorax.types.ResponseFormat(type="json_object", schema=SCHEMA)
    events = list(client.generate_stream(PROMPT, adapter_id="a3", max_new_tokens=MAX_TOKENS,
                                         response_format=typed))
    streamed = "".join(e.token.text for e in events)
    assert streamed == events[-1].generated_text, "the stream's tokens join to the generated text"
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_openai_best_of_returns_the_best_candidates_best_first(client):
    completion = client.completions.create(model="a2", prompt=PROMPT, max_tokens=6, temperature=1.0, n=2,
                                           best_of=4, logprobs=0, seed=5)
    sums = [sum(c.logprobs.token_logprobs) for c in completion.choices]
    assert len(sums) == 2, "n choices come back"
    assert sums[0] >= sums[1], f"best first, by cumulative logprob: {sums}"
    assert completion.usage.completion_tokens == 4 * 6, "the usage counts the 4 candidates' tokens"
    candidates = client.completions.create(model="a2", prompt=PROMPT, max_tokens=6, temperature=1.0, n=4,
                                           logprobs=0, seed=5)
    every = sorted((sum(c.logprobs.token_logprobs) for c in candidates.choices), reverse=True)
    assert sums == pytest.approx(every[:2], abs=1e-4), (
        f"the two best of the four seeded candidates (seeds 5..8, as n=4 samples them): {sums} vs {every}")


def test_lorax_best_of_answers_the_best_mean_and_lists_the_other(base_url):
    lorax = pytest.importorskip("lorax", reason="pip install --no-deps lorax-client")
    response = lorax.Client(base_url, timeout=180).generate(PROMPT, adapter_id="a1", max_new_tokens=6,
                                                            best_of=2, do_sample=True)
    others = response.details.best_of_sequences
    assert len(others) == 1, f"the other candidate is listed: {others}"

    def mean(tokens) -> float:
        return sum(t.logprob for t in tokens) / len(tokens)

    assert mean(response.details.tokens) >= mean(others[0].tokens), "the answer has the higher mean logprob"
    assert response.details.seed != others[0].seed, "each candidate sampled with its own seed"

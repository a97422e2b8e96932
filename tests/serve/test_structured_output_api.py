"""Structured output and best_of at the HTTP layer, without Ray: the ingress app (`build_fastapi`)
around a fake replica, in process (tests/app_client.py).

What a request body asks for reaches the engine as `SamplingParams.guided` (the engine's
`GuidedSpec`): OpenAI's `response_format`, vLLM's `structured_outputs` and older `guided_*` fields,
LoRAX's `parameters.response_format`; shapes that do not fit are 400s naming the field, and nothing is
sent to a replica. best_of: the candidates run, and the answer holds the ones the ranking picks (OpenAI
as vLLM: the n with the highest cumulative logprob; LoRAX: the one with the highest mean logprob per
token). The served end to end (the engine's constrained decoding, the `openai` and `lorax-client`
clients) is in tests/serve/test_structured_output_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from app_client import FakeDispatcher, FakeStream, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.request.guided_spec import GuidedKind, GuidedSpec
from lora_cluster.request.output import TokenLogprob
from lora_cluster.serve.http.best_of import best_n, best_one
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "a1", "prompt": "hi", "max_tokens": 2}
LORAX = {"inputs": "hi", "parameters": {"adapter_id": "a1", "max_new_tokens": 2}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CONFIG = ServeConfig(model="base", max_n=4)


def lorax(**parameters: Any) -> dict[str, Any]:
    return {**LORAX, "parameters": {**LORAX["parameters"], **parameters}}


async def guided_of(route: str, body: dict[str, Any]) -> GuidedSpec | None:
    """The constraint the engine is asked for when `body` is posted to `route` (a 200 asserted)."""
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        r = await client.post(route, json=body)
    assert r.status_code == 200, f"{route} {body}: served, got {r.status_code} {r.text}"
    assert len(dispatcher.jobs) == 1, f"one job was sent: {dispatcher.jobs}"
    return dispatcher.jobs[0].sampling.guided


# ----- what reaches the engine ------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body", "want"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "Person", "schema": SCHEMA, "strict": True}}}, GuidedSpec.json_schema(SCHEMA)),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "Person", "description": "a person", "schema": SCHEMA}}}, GuidedSpec.json_schema(SCHEMA)),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, GuidedSpec.json_object()),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object", "schema": SCHEMA}},
     GuidedSpec.json_schema(SCHEMA)),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, None),
    ("/v1/chat/completions", CHAT, None),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}}, GuidedSpec.json_object()),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": SCHEMA}},
     GuidedSpec.json_schema(SCHEMA)),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": json.dumps(SCHEMA)}},
     GuidedSpec.json_schema(SCHEMA)),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[0-9]{3}"}},
     GuidedSpec.regex("[0-9]{3}")),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["yes", "no"]}},
     GuidedSpec.choice(["yes", "no"])),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": 'start: "a"+'}},
     GuidedSpec.grammar('start: "a"+')),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json_object": True,
                                                             "disable_any_whitespace": False}},
     GuidedSpec.json_object()),
    ("/v1/completions", {**COMPLETION, "guided_json": SCHEMA}, GuidedSpec.json_schema(SCHEMA)),
    ("/v1/chat/completions", {**CHAT, "guided_json": json.dumps(SCHEMA)}, GuidedSpec.json_schema(SCHEMA)),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a|b"}, GuidedSpec.regex("a|b")),
    ("/v1/chat/completions", {**CHAT, "guided_choice": ["x", "y z"]}, GuidedSpec.choice(["x", "y z"])),
    ("/v1/completions", {**COMPLETION, "guided_grammar": 'start: "b"'}, GuidedSpec.grammar('start: "b"')),
    ("/generate", lorax(response_format={"type": "json_object", "schema": SCHEMA}),
     GuidedSpec.json_schema(SCHEMA)),
    ("/generate", lorax(response_format={"type": "json_schema", "schema": SCHEMA}),
     GuidedSpec.json_schema(SCHEMA)),
    ("/generate", lorax(response_format={"type": "json_object"}), GuidedSpec.json_object()),
    ("/generate", lorax(response_format={"type": "text"}), None),
    ("/generate_stream", lorax(response_format={"type": "json_object", "schema": SCHEMA}),
     GuidedSpec.json_schema(SCHEMA)),
])
async def test_each_form_of_a_constraint_reaches_the_engine_as_its_guided_spec(route, body, want):
    got = await guided_of(route, body)
    assert got == want, f"{route} {body}: the engine is asked for {want}, got {got}"


async def test_a_schema_is_the_same_spec_whatever_field_or_form_carries_it():
    a = await guided_of("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "P", "schema": SCHEMA}}})
    b = await guided_of("/v1/completions", {**COMPLETION, "guided_json": json.dumps(SCHEMA)})
    c = await guided_of("/generate", lorax(response_format={"type": "json_object", "schema": SCHEMA}))
    assert a == b, "a schema object and its JSON text are one spec (the engine's compile cache key)"
    assert a == c, "the OpenAI and LoRAX forms of a schema are one spec"
    assert a.kind is GuidedKind.JSON_SCHEMA, "a JSON-schema constraint"


async def test_every_choice_and_candidate_carries_the_constraint():
    dispatcher = FakeDispatcher()
    body = {**COMPLETION, "prompt": ["a", "b"], "n": 2, "best_of": 3, "guided_regex": "[ab]+"}
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, f"served: {r.text}"
    assert len(dispatcher.jobs) == 6, "3 candidates for each of 2 prompts"
    assert {job.sampling.guided for job in dispatcher.jobs} == {GuidedSpec.regex("[ab]+")}, (
        "every candidate of every prompt is constrained")


# ----- shapes that do not fit: 400s naming the field, nothing sent ---------------------------------------


@pytest.mark.parametrize(("route", "body", "needle"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format, guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_json": SCHEMA, "guided_choice": ["a"]},
     "guided_json, guided_choice"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a"}, "guided_regex": "a"},
     "structured_outputs.regex, guided_regex"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "grammar": "start: a"}},
     "structured_outputs.regex, structured_outputs.grammar"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {}}, "sets no constraint"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json_object": False}},
     "structured_outputs.json_object"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "structural_tag": "t"}},
     "structured_outputs.structural_tag"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "backend": "xgrammar"}},
     "structured_outputs.backend"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, "guided_json is not valid JSON"),
    ("/v1/completions", {**COMPLETION, "guided_json": "[1, 2]"}, "guided_json must be a JSON schema object"),
    ("/v1/completions", {**COMPLETION, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {**COMPLETION, "guided_regex": ""}, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/chat/completions", {**CHAT, "response_format": {}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA}}}, "json_schema.name"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "P"}}}, "json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "has space", "schema": SCHEMA}}}, "json_schema.name"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "P", "schema": SCHEMA, "strict": "yes"}}}, "json_schema.strict"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object", "json_schema": {}}},
     "response_format.json_object.json_schema"),
    ("/generate", lorax(response_format={"type": "text", "schema": SCHEMA}), "not text"),
    ("/generate", lorax(response_format={"type": "json_object", "json_schema": SCHEMA}),
     "response_format.json_schema"),
    ("/generate", lorax(response_format={"type": "regex"}), "response_format.type"),
    ("/generate", lorax(response_format={"schema": SCHEMA}), "response_format.type"),
])
async def test_a_constraint_that_does_not_fit_is_a_400_naming_it(route, body, needle):
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        r = await client.post(route, json=body)
    assert r.status_code == 400, f"{body}: a 400, got {r.status_code} {r.text}"
    assert needle in r.json()["error"]["message"], f"the message names {needle!r}: {r.text}"
    assert not dispatcher.jobs, "nothing is sent to a replica"


async def test_an_oversized_schema_text_is_refused_before_it_is_parsed():
    dispatcher = FakeDispatcher()
    huge = json.dumps({"description": "x" * (300 * 1024)})
    config = ServeConfig(model="base", max_body_bytes=1 << 21)
    async with serving(FakeTokenizer(), dispatcher, config) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "guided_json": huge})
    assert r.status_code == 400, f"a 400: {r.status_code} {r.text}"
    assert "262144" in r.json()["error"]["message"], f"the message names the byte limit: {r.text}"


# ----- best_of -----------------------------------------------------------------------------------------


class ScoredDispatcher(FakeDispatcher):
    """Job k (in start order) generates `plan[k]`: (tokens, logprob of each), its text the letter
    chr(97 + k) repeated; logprobs reported as the engine does when the job asks for them."""

    def __init__(self, plan: list[tuple[int, float]]):
        super().__init__()
        self.plan = plan

    async def start(self, job: GenerateJob, route: str) -> Generation:
        k = len(self.jobs)
        self.jobs.append(job)
        length, value = self.plan[k]
        char = chr(ord("a") + k)
        lp = TokenLogprob(ord(char), value) if job.sampling.logprobs is not None else None
        items = []
        for i in range(1, length + 1):
            done = i == length
            items.append({
                "text": char * i if done else None, "delta_text": char, "delta_token_ids": [ord(char)],
                "token_ids": [ord(char)] * i if done else None, "finished": done,
                "finish_reason": "length" if done else None, "prompt_tokens": len(job.prompt),
                "completion_tokens": i, "ttft_s": 0.0, "delta_logprobs": None if lp is None else [lp],
                "logprobs": [lp] * i if done and lp is not None else None})
        first = {"replica": "r1", "hit": True, **items[0]}
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(items[1:]))


async def post(dispatcher: FakeDispatcher, route: str, body: dict[str, Any]) -> Any:
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        return await client.post(route, json=body)


async def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob_best_first():
    # cumulative: a -3.0, b -1.0 (best), c -2.0, d -0.8 over 4 tokens but -0.2 mean (c's mean is -1.0)
    dispatcher = ScoredDispatcher([(3, -1.0), (1, -1.0), (2, -1.0), (4, -0.2)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "max_tokens": 4, "n": 2, "best_of": 4,
                                                   "seed": 7})
    assert r.status_code == 200, f"served: {r.text}"
    body = r.json()
    assert len(dispatcher.jobs) == 4, "best_of candidates are generated"
    assert [job.sampling.seed for job in dispatcher.jobs] == [7, 8, 9, 10], (
        "candidate i of a seeded request uses seed + i, as choices do")
    assert [c["text"] for c in body["choices"]] == ["dddd", "b"], (
        "the 2 of 4 with the highest cumulative logprob (-0.8, -1.0), best first")
    assert [c["index"] for c in body["choices"]] == [0, 1], "the choices are indexed 0..n-1"
    assert body["choices"][0]["logprobs"] is None, "logprobs ranked them but were not asked for"
    assert body["usage"]["completion_tokens"] == 3 + 1 + 2 + 4, "the usage counts every candidate's tokens"
    assert all(job.sampling.logprobs == 0 for job in dispatcher.jobs), (
        "the engine is asked for the chosen tokens' logprobs, which rank the candidates")


async def test_best_of_keeps_asked_logprobs_and_selects_per_prompt():
    dispatcher = ScoredDispatcher([(1, -2.0), (1, -1.0), (1, -0.5), (1, -3.0)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "prompt": ["p", "q"], "max_tokens": 1,
                                                   "best_of": 2, "logprobs": 0})
    assert r.status_code == 200, f"served: {r.text}"
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["b", "c"], "the best of each prompt's own two candidates"
    assert choices[0]["logprobs"]["token_logprobs"] == [-1.0], "asked logprobs are in the answer"


async def test_best_of_chat_returns_the_best_message():
    dispatcher = ScoredDispatcher([(2, -1.0), (2, -0.1), (2, -0.5)])
    r = await post(dispatcher, "/v1/chat/completions", {**CHAT, "best_of": 3})
    assert r.status_code == 200, f"served: {r.text}"
    messages = [c["message"]["content"] for c in r.json()["choices"]]
    assert messages == ["bb"], f"the candidate with the highest cumulative logprob: {messages}"


async def test_best_of_equal_to_n_streams_every_choice():
    dispatcher = ScoredDispatcher([(1, -1.0), (1, -1.0)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "max_tokens": 1, "n": 2, "best_of": 2,
                                                   "stream": True})
    assert r.status_code == 200, f"served: {r.text}"
    assert r.text.count('"finish_reason":"length"') == 2, "both choices are streamed to their end"


async def test_best_of_below_n_is_raised_to_n():
    dispatcher = ScoredDispatcher([(1, -1.0), (1, -0.5), (1, -2.0)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "max_tokens": 1, "n": 3, "best_of": 2})
    assert r.status_code == 200, f"best_of below n is served (raised to n): {r.text}"
    assert len(dispatcher.jobs) == 3, "n candidates run: every choice is a candidate"
    assert len(r.json()["choices"]) == 3, "n choices come back"


async def test_a_streamed_best_of_selection_sends_each_chosen_choice_whole():
    dispatcher = ScoredDispatcher([(2, -1.0), (3, -0.1), (1, -0.5)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "max_tokens": 3, "best_of": 3,
                                                   "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, f"served: {r.text}"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", f"the stream ends with [DONE]: {events}"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["bbb"], (
        f"the best candidate, whole, in one chunk: {chunks}")
    assert chunks[-1]["usage"]["completion_tokens"] == 2 + 3 + 1, "the usage chunk counts every candidate"
    assert all(not job.stream for job in dispatcher.jobs), "the candidates run to their end unstreamed"


async def test_a_streamed_echo_sends_the_prompt_and_the_text_in_one_chunk():
    dispatcher = ScoredDispatcher([(2, -1.0)])
    r = await post(dispatcher, "/v1/completions", {**COMPLETION, "prompt": "hi ", "max_tokens": 2,
                                                   "echo": True, "stream": True})
    assert r.status_code == 200, f"echo with stream is served: {r.text}"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    chunk = json.loads(events[0])
    assert chunk["choices"][0]["text"] == "hi aa", f"the prompt, then the generated text: {chunk}"
    assert chunk["object"] == "text_completion", "a completions chunk"


@pytest.mark.parametrize(("body", "needle"), [
    ({**COMPLETION, "best_of": 5}, "max_n"),
    ({**COMPLETION, "best_of": 0}, "best_of"),
])
async def test_best_of_out_of_its_rules_is_a_400(body, needle):
    dispatcher = FakeDispatcher()
    r = await post(dispatcher, "/v1/completions", body)
    assert r.status_code == 400, f"{body}: a 400, got {r.status_code} {r.text}"
    assert needle in r.json()["error"]["message"], f"the message names {needle!r}: {r.text}"
    assert not dispatcher.jobs, "nothing is sent to a replica"


async def test_lorax_best_of_answers_the_highest_mean_logprob_and_lists_the_others():
    # means: a -1.0, b -0.5 (best; cumulative -2.0), c -0.9 (cumulative -0.9, the best sum)
    dispatcher = ScoredDispatcher([(2, -1.0), (4, -0.5), (1, -0.9)])
    r = await post(dispatcher, "/generate", lorax(max_new_tokens=4, best_of=3, do_sample=True, details=True))
    assert r.status_code == 200, f"served: {r.text}"
    body = r.json()
    seeds = [job.sampling.seed for job in dispatcher.jobs]
    assert body["generated_text"] == "bbbb", "the candidate with the highest mean logprob per token (LoRAX)"
    assert body["details"]["seed"] == seeds[1], "the answer reports its own candidate's seed"
    assert len(set(seeds)) == 3, f"each candidate samples with a seed of its own: {seeds}"
    others = body["details"]["best_of_sequences"]
    assert [s["generated_text"] for s in others] == ["aa", "c"], "the others, in their order"
    assert [s["seed"] for s in others] == [seeds[0], seeds[2]], "each with its seed"
    assert [s["generated_tokens"] for s in others] == [2, 1], "each with its token count"
    assert [t["logprob"] for t in others[1]["tokens"]] == [-0.9], "each with its tokens"
    assert others[0]["finish_reason"] == "length", "each with its finish reason"


async def test_lorax_client_reads_best_of_sequences():
    types = pytest.importorskip("lorax.types", reason="pip install --no-deps lorax-client")
    dispatcher = ScoredDispatcher([(1, -1.0), (1, -0.5)])
    r = await post(dispatcher, "/generate", lorax(max_new_tokens=1, best_of=2, do_sample=True, details=True))
    response = types.Response(**r.json())
    assert response.generated_text == "b", "lorax-client's Response reads the answer"
    assert response.details.best_of_sequences[0].generated_text == "a", "and the other candidate"


@pytest.mark.parametrize(("route", "body", "needle"), [
    ("/generate", lorax(best_of=2), "needs sampling"),
    ("/generate", lorax(best_of=2, temperature=0.0, do_sample=True), "needs sampling"),
    ("/generate", lorax(best_of=2, do_sample=True, seed=3), "seed must not be set"),
    ("/generate", lorax(best_of=5, do_sample=True), "max_n"),
    ("/generate", {**lorax(best_of=2, do_sample=True), "stream": True}, "with a stream"),
    ("/", {**lorax(best_of=2, do_sample=True), "stream": True}, "with a stream"),
    ("/generate_stream", lorax(best_of=2, do_sample=True), "with a stream"),
])
async def test_lorax_best_of_out_of_its_rules_is_a_400(route, body, needle):
    dispatcher = FakeDispatcher()
    r = await post(dispatcher, route, body)
    assert r.status_code == 400, f"{route} {body}: a 400, got {r.status_code} {r.text}"
    assert needle in r.json()["error"]["message"], f"the message names {needle!r}: {r.text}"
    assert not dispatcher.jobs, "nothing is sent to a replica"


def test_the_rankings_on_ties_and_empty_candidates():
    def item(*values: float) -> dict[str, Any]:
        return {"logprobs": [TokenLogprob(1, v) for v in values]}

    sums_tied = [item(-2.0), item(-0.5, -1.5), item(-2.0)]
    assert best_n(sums_tied, 2) == [sums_tied[0], sums_tied[1]], (
        "a tie of cumulative logprobs keeps the earlier candidate first")
    means_tied = [item(-1.0), item(-1.0, -1.0), item(-0.5, -0.5)]
    assert best_one(means_tied) == (2, [0, 1]), "the highest mean wins, whatever the length"
    assert best_one(means_tied[:2]) == (0, [1]), "a tie of means keeps the earlier candidate"
    empty = [item(), item(-50.0)]
    assert best_one(empty) == (1, [0]), "a candidate without tokens has a mean of -inf (never preferred)"
    assert best_n(empty, 1) == [empty[0]], "and a cumulative logprob of 0"


# ----- the OpenAPI schema states what is accepted ------------------------------------------------------


async def test_the_openapi_schema_states_the_accepted_forms():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    formats = chat["response_format"]["anyOf"][0]["discriminator"]["mapping"]
    assert sorted(formats) == ["json_object", "json_schema", "text"], f"the response_format types: {formats}"
    for field in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        assert field in chat, f"{field} is a declared field of chat"
        assert field in schemas["CompletionRequest"]["properties"], f"{field} is declared for completions"
    best_of = schemas["CompletionRequest"]["properties"]["best_of"]
    assert "Unsupported" not in json.dumps(best_of), f"best_of is no longer marked unsupported: {best_of}"
    assert {"type": "integer", "minimum": 1, "maximum": 4} in best_of["anyOf"], (
        f"best_of is bounded by max_n: {best_of}")
    lorax_format = schemas["LoraxParameters"]["properties"]["response_format"]
    assert {"$ref": "#/components/schemas/LoraxResponseFormat"} in lorax_format["anyOf"], (
        f"LoRAX's response_format is declared: {lorax_format}")
    stream_body = document["paths"]["/generate_stream"]["post"]["requestBody"]["content"]["application/json"]
    assert stream_body["schema"] == {"$ref": "#/components/schemas/LoraxStreamRequest"}, (
        "/generate_stream's body is its own (best_of only 1)")


# (route, body, whether the server serves it) with max_n 4: the OpenAPI schema must say the same (the
# fuzzer's app runs with max_n 1, see test_fuzz_api.py's FUZZ_LIMITS)
BEST_OF_AGREES = [
    ("/v1/completions", {**COMPLETION, "best_of": 2}, True),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 4}, True),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 2, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "best_of": 1, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "best_of": 2, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "n": 3, "best_of": 4, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, True),
    ("/v1/completions", {**COMPLETION, "best_of": 5}, False),
    ("/v1/chat/completions", {**CHAT, "n": 2, "best_of": 3}, True),
    ("/v1/chat/completions", {**CHAT, "n": 3, "best_of": 2}, True),
    ("/generate", lorax(best_of=2, do_sample=True), True),
    ("/generate", lorax(best_of=3, top_p=0.9), True),
    ("/generate", lorax(best_of=2, temperature=1.5), True),
    ("/generate", lorax(best_of=2), False),
    ("/generate", lorax(best_of=2, temperature=1.0), False),
    ("/generate", lorax(best_of=2, do_sample=True, seed=1), False),
    ("/generate", lorax(best_of=2, do_sample=True, temperature=0.0), False),
    ("/generate", lorax(best_of=5, do_sample=True), False),
    ("/generate", {**lorax(best_of=2, top_k=5), "stream": True}, False),
    ("/generate_stream", lorax(best_of=1), True),
    ("/generate_stream", lorax(best_of=2, do_sample=True), False),
    ("/generate_stream", lorax(best_of=0), False),
]


@pytest.mark.parametrize(("route", "body", "served"), BEST_OF_AGREES)
async def test_the_schema_states_best_of_exactly_as_the_server_serves_it(route, body, served):
    import jsonschema

    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        document = (await client.get("/openapi.json")).json()
        response = await client.post(route, json=body)
    media = document["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    accepted = jsonschema.Draft202012Validator({**media, "components": document["components"]}).is_valid(body)
    assert (response.status_code == 200) == served, f"{route} {body}: served={served}, got {response.text}"
    assert accepted == served, f"{route} {body}: the schema {'accepts' if accepted else 'refuses'} it"

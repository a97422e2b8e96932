"""End to end through Ray Serve: one app (ingress + 2 LoRA replicas on CPU) shared by every test here, and
by test_structured_output_e2e.py (conftest's `demo_app`: `shared_apps.demo_config`, deployed once).

Ray is started by conftest's `ray_app` on 127.0.0.1 with token auth off.
Clients: the real `openai` SDK, `lorax-client`, httpx.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import shutil
import socket

import httpx
import pytest
from helpers import adapter_hits, adapter_order, poll
from ray_app import serve_log
from shared_apps import MAX_PROMPT_TOKENS, demo_config

from lora_cluster.engine import SamplingParams
from lora_cluster.releases.split import bucket, takes_candidate

pytestmark = pytest.mark.e2e

ADAPTERS = [f"a{i}" for i in range(8)]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def app_config(demo_zoo):
    return demo_config(demo_zoo)


@pytest.fixture(scope="module")
def base_url(demo_app):
    return demo_app


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline_engine(make_engine, app_config):
    """The engine called directly, configured like the replicas (merges included): the reference."""
    engine = make_engine(max_loras=app_config["max_loras"], max_lora_rank=app_config["max_lora_rank"])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def offline(offline_engine):
    """Greedy outputs of the offline engine: `offline(prompt, adapter, max_new_tokens)`."""
    return lambda prompt, adapter, n: offline_engine.generate(
        [prompt], adapter_ids=[adapter], sampling=SamplingParams(max_new_tokens=n, temperature=0.0))[0]


def _replicas(http) -> dict:
    r = http.get("/debug/replicas")
    assert r.status_code == 200, f"/debug/replicas answers: {r.text}"
    return r.json()["replicas"]


def test_health_and_models(http, app_config):
    r = http.get("/health")
    assert r.status_code == 200, f"/health is 200 once a replica answers: {r.text}"
    assert r.json()["status"] == "ok", "/health reports ok"
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids[0] == app_config["model"], "/v1/models lists the base model first"
    assert set(ADAPTERS) <= set(ids), "/v1/models lists the source's adapters"
    assert len(ids) == 17, f"/v1/models lists the base model and a0..a15, got {ids}"


def test_openai_client_matches_the_engine(base_url, offline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    for adapter in ("a1", "a2", None):
        model = adapter or client.models.list().data[0].id
        want = offline(PROMPT, adapter, 12)
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text, f"{model}: greedy text equals the engine's"
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop"), (
            f"{model}: the finish reason is the engine's, in OpenAI's terms")
        assert got.usage.prompt_tokens == want.prompt_tokens, f"{model}: prompt tokens are the engine's"
        assert got.usage.completion_tokens == want.completion_tokens, (
            f"{model}: completion tokens are the engine's")
        streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, (
            f"{model}: the streamed chunks join to the engine's text")
        assert chunks[-1].usage.completion_tokens == want.completion_tokens, (
            f"{model}: the last chunk carries the usage (include_usage)")

    chat = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant", "a chat reply is the assistant's message"
    assert chat.usage.completion_tokens == 6, "a chat reply honours max_tokens"
    stream = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content, (
        "a streamed chat reply equals the non-streamed one")


def test_n_seed_stop_and_routing_headers(http):
    body = {"model": "a4", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    r1, r2 = http.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert r1.status_code == 200, f"a seeded n=2 request succeeds: {r1.text}"
    assert r1.json()["choices"] == r2.json()["choices"], "a seeded sampled request is reproducible"
    assert [c["index"] for c in r1.json()["choices"]] == [0, 1], "n=2 gives choices 0 and 1"
    assert r1.headers["x-lora-replica"], "x-lora-replica names the replica that served"
    assert r1.headers["x-lora-adapter-hit"] in ("true", "false"), "x-lora-adapter-hit is a boolean"
    assert r2.headers["x-lora-adapter-hit"] == "true", "the adapter is a hit the second time"
    full = http.post("/v1/completions", json={"model": "a4", "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0}).json()["choices"][0]["text"]
    stop = full[3:5]
    cut = http.post("/v1/completions", json={"model": "a4", "prompt": PROMPT, "max_tokens": 12,
                                             "temperature": 0, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)], "the text ends before the stop string"
    assert cut["finish_reason"] == "stop", "a stop string ends the choice with finish_reason stop"


def test_lorax_client_matches_the_engine(base_url, offline):
    Client = pytest.importorskip("lorax", reason="pip install --no-deps lorax-client").Client

    client = Client(base_url, timeout=120)
    want = offline(PROMPT, "a5", 10)
    got = client.generate(PROMPT, adapter_id="a5", max_new_tokens=10)
    assert got.generated_text == want.text, "LoRAX generate's text equals the engine's"
    assert got.details.generated_tokens == 10, "details count the generated tokens"
    assert got.details.finish_reason.value == "length", "max_new_tokens ends with finish_reason length"
    assert [t.id for t in got.details.tokens] == want.token_ids, "details list the engine's token ids"
    events = list(client.generate_stream(PROMPT, adapter_id="a5", max_new_tokens=10))
    assert "".join(e.token.text for e in events) == want.text, "the stream's tokens join to the engine's text"
    assert events[-1].generated_text == want.text, "the last stream event carries the whole text"
    assert events[-1].details.prompt_tokens == want.prompt_tokens, "the last stream event counts the prompt"
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a5", "max_new_tokens": 10, "return_full_text": True}}, timeout=60)
    assert r.status_code == 200, f"/generate with return_full_text succeeds: {r.text}"
    assert r.json()["generated_text"] == PROMPT + want.text, "return_full_text prepends the prompt"
    r = httpx.post(f"{base_url}/generate_stream", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a5", "max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200, f"/generate_stream succeeds: {r.text}"
    events = [json.loads(chunk.removeprefix("data:")) for chunk in r.text.split("\n\n") if chunk]
    assert 1 <= len(events) <= 3, f"at most one event per token (outputs that queue up are merged): {events}"
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"], (
        "the events' token texts join to the generated text that the last event carries")


def test_adapter_affinity(http):
    hits = adapter_hits(http, ADAPTERS, PROMPT, rounds=200)
    order = adapter_order(ADAPTERS, 200)
    rate = sum(h.startswith("true") for h in hits) / len(hits)
    placed = {rid: set(s["resident"]) for rid, s in _replicas(http).items()}
    misses = [(a, h) for a, h in zip(order, hits, strict=True) if not h.startswith("true")]
    assert rate >= 0.95, f"adapter hit rate {rate:.2%}; misses {misses}; resident {placed}"
    assert len(placed) == 2, f"both replicas report, got {sorted(placed)}"
    assert all(len(held) <= 4 for held in placed.values()), f"no replica holds more than max_loras: {placed}"


def test_bad_requests_get_their_status_and_the_server_keeps_serving(http):
    def post(path: str, body: dict) -> httpx.Response:
        return http.post(path, json=body)

    def error_of(r: httpx.Response, status: int) -> dict:
        assert r.status_code == status, f"the request is answered with {status}: {r.text}"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code"}, f"the error has OpenAI's shape: {error}"
        return error

    ok = {"model": "a1", "prompt": PROMPT, "max_tokens": 2}
    error_of(post("/v1/completions", {**ok, "temperature": -1}), 400)
    error_of(post("/v1/completions", {**ok, "max_tokens": 100_000}), 400)
    error_of(post("/v1/completions", {**ok, "logprobs": 21}), 400)  # over max_logprobs
    error_of(post("/v1/completions", {"model": "a1"}), 400)
    garbage = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    error_of(garbage, 400)
    error_of(post("/v1/completions", {**ok, "model": "no-such-adapter"}), 404)
    error_of(post("/v1/completions", {**ok, "stream": True, "model": "no-such-adapter"}), 404)
    error_of(post("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "nope"}}), 404)
    too_long = error_of(post("/v1/completions", {**ok, "prompt": [5] * (MAX_PROMPT_TOKENS + 1)}), 400)
    assert f"the limit is {MAX_PROMPT_TOKENS} tokens" in too_long["message"], "the 400 names the prompt limit"
    long_text = post("/v1/completions", {**ok, "prompt": "river " * 200})
    assert long_text.status_code == 200, f"a long text is served on its last tokens: {long_text.text}"
    assert long_text.json()["usage"]["prompt_tokens"] == MAX_PROMPT_TOKENS, "it ran on the limit's tokens"
    assert int(long_text.headers["x-lora-truncated-tokens"]) > 0, "the response says tokens were cut"
    error_of(post("/v1/chat/completions", {"model": "a1", "messages": []}), 400)
    assert post("/v1/completions", ok).status_code == 200, "the server keeps serving after bad requests"


def test_overload_is_429_and_the_server_recovers(base_url, http):
    body = {"model": "a6", "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}

    def one(_: int) -> int:
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(36) as pool:
        codes = list(pool.map(one, range(36)))  # 2 replicas x 8 slots + 4 in the cluster queue at most
    assert 429 in codes, f"requests beyond the replicas' and the cluster queue's room get 429: {codes}"
    assert 200 in codes, f"the requests that fit are served: {codes}"
    assert set(codes) <= {200, 429}, f"overload yields no other status: {codes}"
    assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200, (
        "the server serves again once the burst is over")


def test_load_and_unload_lora_adapter(http, demo_zoo, tmp_path):
    good = tmp_path / "copy"
    shutil.copytree(demo_zoo.adapters_dir / "a9", good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(tmp_path / "missing")})
    assert r.status_code in (400, 404), f"a missing path is refused: {r.text}"
    assert "error" in r.json(), "the refusal has an error body"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(bad)})
    assert r.status_code == 400, f"an invalid adapter is a 400: {r.text}"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(good)})
    assert r.status_code == 200, f"a valid adapter loads (a refused name is free again): {r.text}"
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(good)})
    assert again.status_code == 409, f"loading a loaded name again is a 409 (conflict): {again.text}"
    assert again.json()["error"]["code"] == "already_loaded", "the refusal says the name is already loaded"
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    mine = http.post("/v1/completions", json={**body, "model": "mine"})
    assert mine.status_code == 200, f"the loaded adapter serves requests: {mine.text}"
    same = http.post("/v1/completions", json={**body, "model": "a9"})
    assert mine.json()["choices"] == same.json()["choices"], "the loaded copy behaves as its original"
    assert "mine" in [m["id"] for m in http.get("/v1/models").json()["data"]], "/v1/models lists it"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200, (
        "a loaded adapter can be unloaded")
    assert http.post("/v1/completions", json={**body, "model": "mine"}).status_code == 404, (
        "an unloaded adapter is unknown again")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 404, (
        "unloading a name that is not loaded is a 404")


def test_versions_of_a_loaded_name_answer_side_by_side(http, demo_zoo):
    """A load in place is the name's next version: the bare name moves to it, `name@1` still answers
    with version 1's weights, and the response header says which version answered."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}

    def answer(model: str) -> tuple[str, str | None]:
        r = http.post("/v1/completions", json={**body, "model": model})
        assert r.status_code == 200, f"{model} serves: {r.text}"
        return r.json()["choices"][0]["text"], r.headers.get("x-lora-adapter-version")

    own_a3, own_a4 = answer("a3")[0], answer("a4")[0]
    assert own_a3 != own_a4, "a3 and a4 answer differently (else this test proves nothing)"
    first = {"lora_name": "fin", "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    second = {"lora_name": "fin", "lora_path": str(demo_zoo.adapters_dir / "a4"), "load_inplace": True}
    loaded = http.post("/v1/load_lora_adapter", json=second)
    assert loaded.status_code == 200, f"a load in place makes version 2: {loaded.text}"
    assert answer("fin") == (own_a4, "2"), "the bare name is answered by version 2's weights"
    assert answer("fin@1") == (own_a3, "1"), "fin@1 still answers with version 1's weights"
    listed = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert {"fin", "fin@1", "fin@2"} <= set(listed), f"/v1/models lists the name and its versions: {listed}"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fin"}).status_code == 200, "it unloads"
    gone = http.post("/v1/completions", json={**body, "model": "fin@1"})
    assert gone.status_code == 404, f"every version went with the name: {gone.text}"


def test_a_release_goes_through_every_step_while_model_fin_callers_change_nothing(http, base_url, demo_zoo):
    """A release of `rel` (version 2, a4's weights, against version 1, a3's): the openai client calling
    the bare name is answered by v1 or v2 as the steps say, each user by one version at a time, until
    the promotion; `rel@1` answers with version 1 throughout."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    first = {"lora_name": "rel", "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    body = {"lora_path": str(demo_zoo.adapters_dir / "a4"), "steps": [25, 50, 100], "step_min_requests": 3,
            "step_dwell_s": 0}
    created = http.post("/v1/adapters/rel/releases", json=body)
    assert created.status_code == 200, f"the release starts: {created.text}"
    release = created.json()
    # ten users, three of them in the first step's 25% (fixed names miss it for 5.6% of release ids)
    ranked = [f"user-{j}" for j in range(1000)]
    early = [u for u in ranked if takes_candidate(25, bucket(release["id"], u))][:3]
    late = [u for u in ranked if not takes_candidate(25, bucket(release["id"], u))][:7]
    shares, users = [], {}
    for i in range(120):  # bounded: about 3 / 0.3 + 3 / 0.5 + 3 requests are needed
        user = (early + late)[i % 10]
        raw = client.completions.with_raw_response.create(model="rel", prompt=PROMPT, max_tokens=2,
                                                            temperature=0, user=user)
        users.setdefault(user, []).append(raw.headers["x-lora-adapter-version"])
        status = http.get(f"/v1/adapters/rel/releases/{release['id']}").json()
        shares.append(status["percent"])
        if status["state"] == "promoted":
            break
    pinned = http.post("/v1/completions", json={"model": "rel@1", "prompt": PROMPT, "max_tokens": 2})
    bare = http.post("/v1/completions", json={"model": "rel", "prompt": PROMPT, "max_tokens": 2})
    events = http.get(f"/v1/adapters/rel/releases/{release['id']}/events").json()["data"]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "rel"})
    assert status["state"] == "promoted", f"the release reaches 100% and is promoted: {status}"
    assert [s for s in dict.fromkeys(shares) if s] == [25.0, 50.0, 100.0], f"it went every step: {shares}"
    assert [e["kind"] for e in events].count("step_advanced") == 2, "each step's advance is in the audit log"
    assert all(v == sorted(v) for v in users.values()), f"a user never goes back to version 1: {users}"
    assert pinned.headers["x-lora-adapter-version"] == "1", "rel@1 still answers with version 1"
    assert bare.headers["x-lora-adapter-version"] == "2", "the bare name is version 2 once promoted"


def test_the_eval_gate_refuses_random_weights_and_passes_a_close_candidate(http, demo_zoo, tmp_path):
    """The eval set is version 1's own greedy answers: a copy of its weights (a close retrain)
    passes, another adapter's random weights are refused before any client sees them."""
    prompts = ["the river", "a quiet town", "once upon"]
    first = {"lora_name": "ev", "lora_path": str(demo_zoo.adapters_dir / "a3")}
    loaded = http.post("/v1/load_lora_adapter", json=first)
    assert loaded.status_code == 200, f"version 1 loads: {loaded.text}"
    greedy = {"model": "ev", "max_tokens": 8, "temperature": 0}
    answers = [http.post("/v1/completions", json={**greedy, "prompt": p}).json()["choices"][0]["text"]
               for p in prompts]
    cases = [{"prompt": p, "expected": a} for p, a in zip(prompts, answers, strict=True)]
    refused = http.post("/v1/adapters/ev/releases", json={"lora_path": str(demo_zoo.adapters_dir / "a4"),
                                                           "eval_set": cases}).json()
    after = [http.post("/v1/completions", json={"model": "ev", "prompt": p, "max_tokens": 2, "user": f"u{i}"})
             .headers["x-lora-adapter-version"] for i, p in enumerate(prompts * 4)]
    close = tmp_path / "retrained"
    shutil.copytree(demo_zoo.adapters_dir / "a3", close)
    passed = http.post("/v1/adapters/ev/releases", json={"lora_path": str(close), "eval_set": cases}).json()
    http.post("/v1/unload_lora_adapter", json={"lora_name": "ev"})
    assert refused["state"] == "rolled_back", f"random weights are refused by the eval gate: {refused}"
    assert after == ["1"] * len(after), "no client was answered by the refused candidate"
    assert passed["state"] == "canary", f"a close candidate passes the eval gate: {passed}"


def test_a_candidate_that_passes_the_eval_set_and_fails_live_is_rolled_back_in_its_step(http, demo_zoo):
    """Version 2 (a4's weights) scores as version 1 (a3's) on an eval set neither answers, so it
    passes the eval gate; live, its shadow copies of version 1's greedy answers disagree, and the
    shadow gate rolls it back automatically at its first step, once release_gate_min_requests copies
    were compared. Until then it answered only the step's share of users (the public split), as the
    audit log's evidence and the responses' version header both count."""
    first = {"lora_name": "live", "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    cases = [{"prompt": f"the river {i}", "expected": "no version writes this"} for i in range(3)]
    body = {"lora_path": str(demo_zoo.adapters_dir / "a4"), "eval_set": cases, "steps": [25, 100],
            "step_min_requests": 100_000, "shadow_percent": 100}
    created = http.post("/v1/adapters/live/releases", json=body).json()
    path = f"/v1/adapters/live/releases/{created['id']}"
    users = [f"user-{j}" for j in range(40)]
    in_step = {u for u in users if takes_candidate(25, bucket(created["id"], u))}
    answers, status = [], created
    for i in range(200):  # bounded: about 10 / 0.75 requests give the gate its 10 copies
        user = users[i % len(users)]
        r = http.post("/v1/completions", json={"model": "live", "prompt": "the river", "max_tokens": 8,
                                                "temperature": 0, "user": user})
        answers.append((user, r.status_code, r.headers.get("x-lora-adapter-version")))
        status = http.get(path).json()
        if status["state"] == "rolled_back":
            break
    events = http.get(f"{path}/events").json()["data"]
    later = [http.post("/v1/completions", json={"model": "live", "prompt": "the river", "max_tokens": 2,
                                                "user": u}).headers.get("x-lora-adapter-version")
             for u in sorted(in_step)[:5]]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "live"})
    assert created["state"] == "canary", f"the candidate passes the eval gate (both score 0): {created}"
    assert status["state"] == "rolled_back", f"the live gate rolled the candidate back: {status}"
    assert [e["kind"] for e in events] == ["created", "eval_passed", "rolled_back"], \
        f"the audit log: {[e['kind'] for e in events]}"
    rollback = events[-1]
    assert rollback["reason"].startswith("automatic: shadow token agreement"), \
        f"the audit log says why: {rollback['reason']}"
    assert (rollback["step"], rollback["percent"]) == (0, 25.0), "it was rolled back in its first step"
    assert rollback["evidence"]["shadow"]["requests"] >= 10, "after release_gate_min_requests copies"
    assert all(code == 200 for _, code, _ in answers), f"every live request is answered: {answers}"
    by_candidate = [u for u, _, version in answers if version == "2"]
    assert set(by_candidate) <= in_step, "the candidate answered only users in the step's share"
    assert len(by_candidate) == sum(1 for u, _, _ in answers if u in in_step), \
        "and every request of those users (sticky): no more than the step's share"
    # the gate judges when a shadow copy ends, which may be while the next live request runs: that
    # one request may have reached the candidate before the rollback and be counted after it
    counted = rollback["evidence"]["candidate"]["requests"]
    assert counted <= len(by_candidate) <= counted + 1, \
        f"the audit log counts the candidate's answers as the headers do: {counted}, {len(by_candidate)}"
    assert later == ["1"] * len(later), f"after the rollback the step's users get version 1: {later}"


def test_choices_and_schema_eval_cases_run_through_the_engine_on_both_versions(http, demo_zoo, tmp_path):
    """The same choices asked with each answer: exactly one of the two cases passes on any version
    (its likelier choice), so version 1 scores 1/2 on them; a closed schema's document is complete
    under its constraint. A copy of version 1's weights, released through vLLM's load call, scores
    the same as version 1."""
    choices = {"prompt": "the river", "choices": [" flows", " stone"]}
    schema = {"type": "object", "properties": {"label": {"enum": ["good", "bad"]}},
              "required": ["label"], "additionalProperties": False}
    cases = [{**choices, "answer": 0}, {**choices, "answer": 1},
             {"prompt": "Rate the river", "schema": schema}]
    first = {"lora_name": "evk", "lora_path": str(demo_zoo.adapters_dir / "a3")}
    loaded = http.post("/v1/load_lora_adapter", json=first)
    close = tmp_path / "retrained"
    shutil.copytree(demo_zoo.adapters_dir / "a3", close)
    released = http.post("/v1/load_lora_adapter", json={"lora_name": "evk", "lora_path": str(close),
                                                         "release": {"eval_set": cases}})
    (created,) = http.get("/v1/adapters/evk/releases").json()["data"]
    events = http.get(f"/v1/adapters/evk/releases/{created['id']}/events").json()["data"]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "evk"})
    assert loaded.status_code == 200, f"version 1 loads: {loaded.text}"
    assert released.status_code == 200, f"vLLM's load call with a release object: {released.text}"
    assert created["state"] == "canary", f"the copy passes the eval gate: {created}"
    evidence = events[1]["evidence"]
    assert evidence["kinds"] == ["choices", "schema"], f"both kinds ran: {evidence}"
    assert evidence["stable_score"] == round(2 / 3, 4), f"one choices case and the schema case pass: " \
        f"{evidence}"
    assert evidence["candidate_score"] == evidence["stable_score"], "the same weights score the same"


def test_loading_a_name_that_shadows_a_source_adapter_serves_the_new_weights(http, demo_zoo):
    """Regression: the replica's device slot kept the source adapter's weights after the name was
    registered with another path (and again after it was unloaded)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}

    def text(model: str) -> str:
        r = http.post("/v1/completions", json={**body, "model": model})
        assert r.status_code == 200, f"{model} serves: {r.text}"
        return r.json()["choices"][0]["text"]

    own_a5 = text("a5")
    assert text("a5") == own_a5, "a5 answers the same from the device copy it now has"
    own_a6 = text("a6")
    assert own_a5 != own_a6, "a5 and a6 answer differently (else this test proves nothing)"
    shadow = {"lora_name": "a5", "lora_path": str(demo_zoo.adapters_dir / "a6")}
    r = http.post("/v1/load_lora_adapter", json=shadow)
    assert r.status_code == 200, f"a source adapter's name can be loaded with another path: {r.text}"
    assert text("a5") == own_a6, "a5 now serves the loaded weights, not the copy on the replica's device"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a5"}).status_code == 200, "it unloads"
    assert text("a5") == own_a5, "after the unload, a5 is the source adapter again"


def _abort_counted(http, leave, what: str, attempts: int = 3) -> None:
    """Start a 400-token request and leave it (`leave()`), until the replicas count it cancelled.

    On the tiny demo model 400 tokens take about a second, so under a loaded machine a request can
    end normally before Ray Serve carries the disconnect to its replica; such an attempt proves
    nothing, and another is made (three at most). A disconnect that never aborts fails every attempt.
    """
    def cancelled() -> int:
        return sum(s["cancelled"] for s in _replicas(http).values())

    for _ in range(attempts):
        before = cancelled()
        leave()
        if not poll(lambda before=before: cancelled() > before, 8):
            continue
        poll(lambda: not any(s["num_running"] for s in _replicas(http).values()), 20)
        assert all(s["free_seq_slots"] == s["max_num_seqs"] for s in _replicas(http).values()), (
            f"every batch slot is free again after {what}'s client went away")
        return
    pytest.fail(f"{what} was not aborted in {attempts} attempts: {list(_replicas(http).values())}")


def test_client_disconnect_frees_the_batch_slot(base_url, http):
    body = {"model": "a7", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}

    def leave() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client, client.stream(
                "POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, "the streaming request starts"
            assert next(r.iter_lines()).startswith("data: "), "the first SSE event arrives"

    _abort_counted(http, leave, "the streaming request")


def test_a_fan_out_whose_client_goes_away_leaves_no_request_and_no_in_flight_count(base_url, http):
    """Two prompts with n = 2: four choices (this app's handles queue at most max_queued_requests=4
    calls while they are routed) on the two replicas; the client leaves at the first event."""
    body = {"model": "a3", "prompt": [PROMPT, PROMPT + " jumps"], "n": 2, "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    def leave() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client, client.stream(
                "POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, f"the fan-out starts: {r.read().decode()}"
            assert next(r.iter_lines()).startswith("data: "), "the first SSE event arrives"

    _abort_counted(http, leave, "the fan-out")
    seen: list[dict] = []

    def drained() -> bool:
        r = http.get("/v1/cluster")
        assert r.status_code == 200, f"/v1/cluster answers: {r.text}"
        seen.append(r.json()["ingress"]["in_flight"])
        return seen[-1] == {}

    poll(drained, 20)
    in_flight = seen[-1]
    assert in_flight == {}, f"the ingress counts no request in flight on any replica: {in_flight}"


def test_a_non_streaming_requests_client_going_away_aborts_it(base_url, http):
    body = json.dumps({"model": "a6", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = base_url.removeprefix("http://").split(":")

    def leave() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                         + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            running = poll(lambda: sum(s["num_running"] for s in _replicas(http).values()), 20, interval_s=0)
            assert running == 1, "the non-streaming request was generating when its client went away"

    _abort_counted(http, leave, "the non-streaming request")


def test_a_non_streaming_job_gets_the_same_item_from_the_unary_call_as_from_the_stream(base_url):
    from ray import serve

    from lora_cluster.serve.protocol import GenerateJob

    handle = serve.get_deployment_handle("LoraReplica", app_name="lora")
    job = GenerateJob(request_id="unary-1", prompt=PROMPT, adapter_id="a5", stream=False,
                      sampling=SamplingParams(max_new_tokens=6, temperature=0.0))
    unary = handle.complete.remote(job).result(timeout_s=60)
    streamed = list(handle.options(stream=True).generate.remote(
        dataclasses.replace(job, request_id="unary-2")))
    assert len(streamed) == 1, "a non-streaming job's stream has one item"
    assert unary.keys() == streamed[0].keys(), "the unary reply has the streamed item's keys"
    measured = ("ttft_s", "replica", "hit", "device_s")  # where and how long each run took: its own
    same = {k: v for k, v in unary.items() if k not in measured}
    assert same == {k: streamed[0][k] for k in same}, "the unary reply's output is the streamed item's"
    assert unary["finished"] and unary["text"] and len(unary["token_ids"]) == 6, (
        "the unary reply is the final item, with the cumulative text and token ids")


def _finished_by_class(http) -> dict[str, int]:
    totals: dict[str, int] = {}
    for stats in _replicas(http).values():
        for name, c in stats["classes"].items():
            totals[name] = totals.get(name, 0) + c["finished"]
    return totals


def test_priority_classes_are_answered_and_counted_per_class_on_the_replicas(http):
    before = _finished_by_class(http)
    body = {"model": "a2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    interactive = http.post("/v1/completions", json=body, headers={"x-lora-priority": "interactive"})
    streamed = http.post("/generate_stream", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a2", "max_new_tokens": 4}}, headers={"x-lora-priority": "batch"})
    by_field = [http.post("/v1/completions", json={**body, "priority": 2}) for _ in range(3)]
    after = _finished_by_class(http)
    replicas = _replicas(http)
    assert interactive.status_code == 200, f"a request naming a class succeeds: {interactive.text}"
    assert interactive.headers["x-lora-priority-class"] == "interactive", "the response names its class"
    assert streamed.status_code == 200, f"a LoRAX stream naming a class succeeds: {streamed.text}"
    assert streamed.headers["x-lora-priority-class"] == "batch", "a LoRAX stream names its class"
    assert [r.status_code for r in by_field] == [200] * 3, "requests with vLLM's priority field succeed"
    assert [r.headers["x-lora-priority-class"] for r in by_field] == ["batch"] * 3, (
        "vLLM's priority field 2 picks the batch class")
    assert after["interactive"] - before.get("interactive", 0) == 1, (
        f"the replicas counted the interactive request: {before} -> {after}")
    assert after["batch"] - before.get("batch", 0) == 4, f"the replicas counted the batch requests: {after}"
    interactive_stats = [s["classes"]["interactive"] for s in replicas.values()
                         if s["classes"]["interactive"]["finished"]]
    assert interactive_stats[0]["ttft_p50_s"] is not None, f"the class reports its TTFT: {interactive_stats}"
    assert all(c["running"] == 0 and c["waiting"] == 0 for s in replicas.values()
               for c in s["classes"].values()), "no request of any class is in flight once all are answered"


def test_metrics_are_exported(http):
    text = http.get("/metrics").text
    for name in ("lora_cluster_requests_total", "lora_cluster_request_duration_seconds_bucket",
                 "lora_cluster_time_to_first_token_seconds_bucket", "lora_cluster_generated_tokens_total",
                 "lora_cluster_adapter_hits_total", "lora_cluster_engine_running_requests",
                 "lora_cluster_adapter_slots_in_use"):
        assert name in text, f"{name} is exported"
    assert 'route="/v1/completions",status="200"' in text, "requests are counted by route and status"
    # the replicas' adapter store counters, per tier (earlier tests loaded adapters into host memory)
    assert re.search(r'lora_cluster_adapter_cache_loads_total\{replica="[^"]+",tier="host"\} [1-9]', text), (
        "the replicas' host-tier adapter loads are exported per replica")


# ----- operator tooling against the running server: x-request-id, `lora-cluster status` / `adapters` -----


def test_serves_access_lines_are_the_ingresss_http_lines_not_the_internal_calls(http):
    r = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, f"a completion is served: {r.text}"
    internal = ("LoraReplica", "ClusterController")

    def logged() -> bool:
        return "POST /v1/completions 200" in serve_log("LoraIngress")

    assert poll(logged, 10), "the ingress writes Serve's HTTP access line (method, path, status, latency)"
    for deployment in internal:
        lines = [line for line in serve_log(deployment).splitlines() if " CALL " in line]
        assert not lines, f"{deployment} writes no access line per internal call by default: {lines[:3]}"


def test_x_request_id_is_echoed_once_by_the_served_app(http):
    given = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPT, "max_tokens": 2},
                      headers={"x-request-id": "e2e-req-1"})
    assert given.status_code == 200, f"the request succeeds: {given.text}"
    assert given.headers.get_list("x-request-id") == ["e2e-req-1"], "the client's id is echoed, once"
    missing = http.get("/v1/models")
    assert len(missing.headers.get_list("x-request-id")) == 1, "a request without an id gets exactly one"
    error = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2},
                      headers={"x-request-id": "e2e-req-2"})
    assert error.status_code == 404, f"an unknown adapter is a 404: {error.text}"
    assert error.headers.get_list("x-request-id") == ["e2e-req-2"], "an error response echoes the id too"


def test_cli_status_prints_the_cluster_view(base_url, http, capsys):
    from lora_cluster.cli import main

    served = http.post("/v1/completions", json={"model": "a2", "prompt": PROMPT, "max_tokens": 2})
    assert served.status_code == 200, f"a request is served first: {served.text}"
    assert main(["status", "--url", base_url, "--json"]) == 0, "status --json succeeds"
    view = json.loads(capsys.readouterr().out)
    assert {"nodes", "queue", "controller", "classes"} <= set(view), f"--json prints the view: {list(view)}"
    assert main(["status", "--url", base_url]) == 0, "status succeeds"
    out = capsys.readouterr().out
    assert out.startswith(f"server {base_url}: "), f"the first line names the server: {out}"
    assert "queue: " in out, f"it shows the cluster queue: {out}"
    replicas = [line for line in out.splitlines() if line.startswith("  replica ")]
    in_view = sum(len(node["replicas"]) for node in view["nodes"].values())
    assert in_view >= 1 and len(replicas) >= in_view, f"one block per replica of the view: {out}"
    assert "    device: " in out and "host cache: " in out, f"it shows adapters per tier: {out}"


def test_cli_adapters_list_load_and_unload(base_url, demo_zoo, tmp_path, capsys):
    from lora_cluster.cli import main

    copy = tmp_path / "cli-copy"
    shutil.copytree(demo_zoo.adapters_dir / "a4", copy)
    assert main(["adapters", "load", "cli-mine", str(copy), "--url", base_url]) == 0, "load succeeds"
    assert "cli-mine" in capsys.readouterr().out, "load prints the server's answer naming the adapter"
    assert main(["adapters", "list", "--url", base_url]) == 0, "list succeeds"
    listed = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert listed.get("cli-mine") == str(copy), f"list shows the loaded adapter and its path: {listed}"
    assert {"a0", "a15"} <= set(listed), f"list shows the source's adapters: {sorted(listed)}"
    assert "base model" in listed.values(), "list shows the base model"
    assert main(["adapters", "unload", "cli-mine", "--url", base_url]) == 0, "unload succeeds"
    capsys.readouterr()
    assert main(["adapters", "unload", "cli-mine", "--url", base_url]) == 1, "unloading it again fails"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 404" in err[0] and "cannot be found" in err[0], (
        f"the failure is one line with the status and the server's message: {err}")


# ----- log probabilities and merged adapters (issue 12), through the real clients -------------------------


MERGE = {"ids": ["a0", "a1", "a3"], "weights": [0.6, -0.3, 0.9], "merge_strategy": "linear", "density": 1.0}


def test_lorax_client_merged_adapters_and_details_with_logprobs(base_url, offline_engine):
    lorax = pytest.importorskip("lorax", reason="pip install --no-deps lorax-client")
    from lora_cluster.request.merge_spec import MergeSpec

    spec = MergeSpec.parse(MERGE["ids"], MERGE["weights"], "linear", 1.0, None, max_ids=8)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=0)
    merged_id = offline_engine.loader.define_merge(spec)
    want = offline_engine.generate([PROMPT], adapter_ids=[merged_id], sampling=sampling)[0]
    client = lorax.Client(base_url, timeout=120)
    got = client.generate(PROMPT, merged_adapters=lorax.types.MergedAdapters(**MERGE), max_new_tokens=8,
                          details=True, decoder_input_details=True, return_k_alternatives=3)
    assert got.generated_text == want.text, "a linear merge's greedy text equals the engine's for that merge"
    tokens = got.details.tokens
    assert [t.id for t in tokens] == want.token_ids, "details list the merge's tokens"
    for t, lp in zip(tokens, want.logprobs, strict=True):
        assert abs(t.logprob - lp.logprob) <= 1e-4, f"token {t.id}: details carry the engine's logprob"
        assert [a.id for a in t.alternative_tokens] == [i for i, _ in lp.top], (
            f"token {t.id}: return_k_alternatives=3 lists the engine's 3 most likely tokens")
    prefill = got.details.prefill
    assert [p.id for p in prefill] == want.prompt_token_ids, "decoder_input_details lists the prompt tokens"
    assert prefill[0].logprob is None, "the first prompt token has no logprob"
    pairs = zip(prefill[1:], want.prompt_logprobs[1:], strict=True)
    assert all(abs(p.logprob - lp.logprob) <= 1e-4 for p, lp in pairs), "prompt logprobs are the engine's"
    events = list(client.generate_stream(PROMPT, merged_adapters=lorax.types.MergedAdapters(**MERGE),
                                         max_new_tokens=8))
    assert events[-1].generated_text == want.text, "a streamed merge gives the same text"
    assert all(e.token.logprob < 0 for e in events), "stream events carry real (negative) logprobs"
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a0", "merged_adapters": MERGE, "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400, f"an adapter and a merge at once are refused: {r.text}"
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {
        "merged_adapters": {**MERGE, "ids": ["a0", "nope"], "weights": [1, 1]}, "max_new_tokens": 2}},
        timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"], (
        f"a merge of an unknown adapter is a 404 naming it: {r.text}")


def test_openai_logprobs_and_merged_adapters(base_url, offline_engine):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    want = offline_engine.generate([PROMPT], adapter_ids=["a2"], sampling=SamplingParams(
        max_new_tokens=6, temperature=0.0, logprobs=2))[0]
    got = client.completions.create(model="a2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert [round(x, 4) for x in lp.token_logprobs] == [round(x.logprob, 4) for x in want.logprobs], (
        "completions token_logprobs are the engine's")
    assert "".join(lp.tokens) == got.choices[0].text, "completions logprobs tokens join to the text"
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs), "top_logprobs: 2 alternatives and the chosen"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, "text offsets count from 0"
    streamed = list(client.completions.create(model="a2", prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=2, stream=True))
    stream_lps = [x for c in streamed if c.choices and c.choices[0].logprobs
                  for x in c.choices[0].logprobs.token_logprobs]
    assert stream_lps == lp.token_logprobs, "streamed chunks carry the same token logprobs"

    chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens, "chat logprobs: one entry per generated token"
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content), "each with top_logprobs=2"
    assert all(bytes(c.bytes).decode() == c.token for c in content), "bytes are the token's UTF-8"
    chunks = list(client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed_content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                        for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed_content] == [c.logprob for c in content], "streamed: same logprobs"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": "a2", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and "max_logprobs" in r.text, f"top_logprobs over its limit: 400: {r.text}"

    echo = httpx.post(f"{base_url}/v1/completions", json={  # lm-eval-harness' loglikelihood request
        "model": "a2", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
        timeout=60).json()["choices"][0]
    prompt_want = offline_engine.generate([PROMPT], adapter_ids=["a2"], sampling=SamplingParams(
        max_new_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1))[0]
    assert echo["text"] == PROMPT + prompt_want.text, "echo prepends the prompt to the text"
    echoed = echo["logprobs"]["token_logprobs"]
    assert echoed[0] is None and echo["logprobs"]["top_logprobs"][0] is None, "the first prompt token: null"
    want_lps = [lp.logprob for lp in prompt_want.prompt_logprobs[1:] + prompt_want.logprobs]
    assert len(echoed) == prompt_want.prompt_tokens + 1, "echo: a logprob per prompt token, then the output's"
    assert all(abs(a - b) <= 1e-4 for a, b in zip(echoed[1:], want_lps, strict=True)), (
        "the prompt and output logprobs are the engine's")

    base = client.models.list().data[0].id
    merged = client.completions.create(model=base, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"merged_adapters": MERGE})
    lorax_text = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {
        "merged_adapters": MERGE, "max_new_tokens": 8}}, timeout=60).json()["generated_text"]
    assert merged.choices[0].text == lorax_text, "merged_adapters in an OpenAI body: LoRAX's same merge"

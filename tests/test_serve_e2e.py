"""End to end through Ray Serve: one app (ingress + 2 LoRA replicas on CPU) shared by every test here.

Ray is started by the module fixture on 127.0.0.1 with token auth off (`RAY_AUTH_MODE=disabled`,
which Ray 2.60 would otherwise require). Clients: the real `openai` SDK, `lorax-client`, httpx.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import socket
import time

import httpx
import pytest

from lora_cluster.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

ADAPTERS = [f"a{i}" for i in range(8)]
PROMPT = "the quick brown fox"
MAX_PROMPT_TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_config(demo_zoo, tmp_path_factory):
    return {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
        "num_replicas": 2, "num_cpus": 1, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 8,
        "max_num_batched_tokens": 256, "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_new_tokens": 400,
        "max_ongoing_requests": 8, "max_queued_requests": 4, "routing_stats_period_s": 0.5,
    }


@pytest.fixture(scope="module")
def base_url(app_config):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from lora_cluster.serve.app import build_app

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_config), name="lora", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline(app_config):
    """The engine called directly, configured like the replicas: the reference for greedy outputs."""
    keys = ("model", "adapter_source", "max_loras", "max_lora_rank")
    cfg = {k: v for k, v in app_config.items() if k in keys}
    engine = Engine(**cfg)
    yield lambda prompt, adapter, n: engine.generate(
        [prompt], adapter_ids=[adapter], sampling=SamplingParams(max_new_tokens=n, temperature=0.0))[0]
    engine.close()


def _replicas(http) -> dict:
    r = http.get("/debug/replicas")
    assert r.status_code == 200
    return r.json()["replicas"]


def test_health_and_models(http, app_config):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids[0] == app_config["model"] and set(ADAPTERS) <= set(ids) and len(ids) == 17  # base + a0..a15


def test_openai_client_matches_the_engine(base_url, offline):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    for adapter in ("a1", "a2", None):
        model = adapter or client.models.list().data[0].id
        want = offline(PROMPT, adapter, 12)
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert got.usage.prompt_tokens == want.prompt_tokens
        assert got.usage.completion_tokens == want.completion_tokens
        streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == want.completion_tokens

    chat = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_n_seed_stop_and_routing_headers(http):
    body = {"model": "a4", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    r1, r2 = http.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert r1.status_code == 200 and r1.json()["choices"] == r2.json()["choices"]  # seeded: reproducible
    assert [c["index"] for c in r1.json()["choices"]] == [0, 1]
    assert r1.headers["x-lora-replica"] and r1.headers["x-lora-adapter-hit"] in ("true", "false")
    assert r2.headers["x-lora-adapter-hit"] == "true"
    full = http.post("/v1/completions", json={"model": "a4", "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0}).json()["choices"][0]["text"]
    stop = full[3:5]
    cut = http.post("/v1/completions", json={"model": "a4", "prompt": PROMPT, "max_tokens": 12,
                                             "temperature": 0, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def test_lorax_client_matches_the_engine(base_url, offline):
    Client = pytest.importorskip("lorax", reason="pip install --no-deps lorax-client").Client

    client = Client(base_url, timeout=120)
    want = offline(PROMPT, "a5", 10)
    got = client.generate(PROMPT, adapter_id="a5", max_new_tokens=10)
    assert got.generated_text == want.text
    assert got.details.generated_tokens == 10 and got.details.finish_reason.value == "length"
    assert [t.id for t in got.details.tokens] == want.token_ids
    events = list(client.generate_stream(PROMPT, adapter_id="a5", max_new_tokens=10))
    assert "".join(e.token.text for e in events) == want.text
    assert events[-1].generated_text == want.text and events[-1].details.prompt_tokens == want.prompt_tokens
    r = httpx.post(f"{base_url}/generate", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a5", "max_new_tokens": 10, "return_full_text": True}}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == PROMPT + want.text
    r = httpx.post(f"{base_url}/generate_stream", json={"inputs": PROMPT, "parameters": {
        "adapter_id": "a5", "max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and r.text.count("data:") == 3


def test_adapter_affinity(http):
    def complete(adapter: str) -> str:
        r = http.post("/v1/completions", json={"model": adapter, "prompt": PROMPT, "max_tokens": 4,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        return r.headers["x-lora-adapter-hit"] + " " + r.headers["x-lora-replica"]

    for adapter in ADAPTERS:  # warm-up: every adapter is placed once
        complete(adapter)
    time.sleep(1.5)  # let the replicas' reports reach the router
    order = [ADAPTERS[(i * 5 + i // 8) % 8] for i in range(200)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hits = list(pool.map(complete, order))
    rate = sum(h.startswith("true") for h in hits) / len(hits)
    placed = {rid: set(s["resident"]) for rid, s in _replicas(http).items()}
    misses = [(a, h) for a, h in zip(order, hits, strict=True) if not h.startswith("true")]
    assert rate >= 0.95, f"adapter hit rate {rate:.2%}; misses {misses}; resident {placed}"
    assert len(placed) == 2 and all(len(held) <= 4 for held in placed.values())


def test_bad_requests_get_their_status_and_the_server_keeps_serving(http):
    def post(path: str, body: dict) -> httpx.Response:
        return http.post(path, json=body)

    def error_of(r: httpx.Response, status: int) -> dict:
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code"}
        return error

    ok = {"model": "a1", "prompt": PROMPT, "max_tokens": 2}
    error_of(post("/v1/completions", {**ok, "temperature": -1}), 400)
    error_of(post("/v1/completions", {**ok, "max_tokens": 100_000}), 400)
    error_of(post("/v1/completions", {**ok, "logprobs": 3}), 400)
    error_of(post("/v1/completions", {"model": "a1"}), 400)
    garbage = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    error_of(garbage, 400)
    error_of(post("/v1/completions", {**ok, "model": "no-such-adapter"}), 404)
    error_of(post("/v1/completions", {**ok, "stream": True, "model": "no-such-adapter"}), 404)
    error_of(post("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "nope"}}), 404)
    too_long = error_of(post("/v1/completions", {**ok, "prompt": "river " * 200}), 400)
    assert f"the limit is {MAX_PROMPT_TOKENS} tokens" in too_long["message"]
    error_of(post("/v1/chat/completions", {"model": "a1", "messages": []}), 400)
    assert post("/v1/completions", ok).status_code == 200


def test_overload_is_429_and_the_server_recovers(base_url, http):
    body = {"model": "a6", "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}

    def one(_: int) -> int:
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(36) as pool:
        codes = list(pool.map(one, range(36)))  # 2 replicas x 8 ongoing + 4 queued at most
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_load_and_unload_lora_adapter(http, demo_zoo, tmp_path):
    good = tmp_path / "copy"
    shutil.copytree(demo_zoo.adapters_dir / "a9", good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(tmp_path / "missing")})
    assert r.status_code in (400, 404) and "error" in r.json()
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(bad)})
    assert r.status_code == 400, r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(good)})
    assert r.status_code == 200, r.text
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(good)})
    assert again.status_code == 400
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    mine = http.post("/v1/completions", json={**body, "model": "mine"})
    assert mine.status_code == 200
    same = http.post("/v1/completions", json={**body, "model": "a9"})
    assert mine.json()["choices"] == same.json()["choices"]
    assert "mine" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200
    assert http.post("/v1/completions", json={**body, "model": "mine"}).status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 404


def test_client_disconnect_frees_the_batch_slot(base_url, http):
    before = sum(s["cancelled"] for s in _replicas(http).values())
    body = {"model": "a7", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                              json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        running = sum(s["num_running"] for s in _replicas(http).values())
        assert running == 1  # still generating when the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = _replicas(http).values()
        if sum(s["cancelled"] for s in stats) > before and all(s["num_running"] == 0 for s in stats):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the request was not aborted: {list(stats)}")
    assert all(s["free_seq_slots"] == s["max_num_seqs"] for s in _replicas(http).values())


def test_metrics_are_exported(http):
    text = http.get("/metrics").text
    for name in ("lora_cluster_requests_total", "lora_cluster_request_duration_seconds_bucket",
                 "lora_cluster_time_to_first_token_seconds_bucket", "lora_cluster_generated_tokens_total",
                 "lora_cluster_adapter_hits_total", "lora_cluster_engine_running_requests",
                 "lora_cluster_adapter_slots_in_use"):
        assert name in text, name
    assert 'route="/v1/completions",status="200"' in text
    # the replicas' adapter store counters, per tier (earlier tests loaded adapters into host memory)
    assert re.search(r'lora_cluster_adapter_cache_loads_total\{replica="[^"]+",tier="host"\} [1-9]', text)

"""End to end under Ray Serve's throughput-optimized mode (`serve/ops/serve_mode.py`), as a user runs it:
`serve run` on a config file, `THROUGHPUT_MODE_ENV` in its environment. HAProxy answers on the
configured port; the ingress replica serves HTTP itself (direct ingress) on a port Serve allocates
from `RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`..`_MAX_HTTP_PORT` (here a one-port range, so that the
test knows it); the LoRA replicas are reached over gRPC through our request router. One server (an
ingress and 2 LoRA replicas on CPU, a tenants file) for the whole module (the mode's environment
without Ray: test_serve_mode.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from helpers import adapter_hits, poll

from lora_cluster.engine import SamplingParams
from lora_cluster.serve.ops.serve_mode import throughput_mode_env
from lora_cluster.tenancy.tenants import hash_key

KEY, ADMIN_KEY = "sk-user-0123456789", "sk-admin-0123456789"
ADAPTERS = [f"a{i}" for i in range(8)]
PROMPT = "the quick brown fox"
START_S = 180


class Served:
    """The running server: `url` (HAProxy, the configured port), `direct_url` (the ingress replica's
    own port), `log` (`serve run`'s console output)."""

    def __init__(self, url: str, direct_url: str, log: Path):
        self.url, self.direct_url, self.log = url, direct_url, log
        self.http = httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {KEY}"})

    def replicas(self) -> dict:
        r = self.http.get("/debug/replicas", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, f"/debug/replicas answers the admin: {r.text}"
        return r.json()["replicas"]


@pytest.fixture(scope="module")
def served(demo_zoo, free_port, tmp_path_factory):
    folder = tmp_path_factory.mktemp("throughput-mode")
    haproxy_dir = Path(tempfile.mkdtemp(prefix="hap-"))  # short: HAProxy's socket path has a limit
    port, direct_port = free_port(), free_port()
    (folder / "tenants.yaml").write_text(
        f'admin_api_keys: ["{hash_key(ADMIN_KEY)}"]\n'
        f'tenants:\n  - name: t1\n    api_keys: ["{hash_key(KEY)}"]\n    adapters: ["a*"]\n')
    args = {"model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
            "num_replicas": 2, "num_cpus": 1, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 8,
            "routing_stats_period_s": 0.5, "tenants_file": str(folder / "tenants.yaml")}
    (folder / "serve.yaml").write_text(json.dumps({  # JSON is YAML
        "proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "lora-cluster", "route_prefix": "/",
                          "import_path": "lora_cluster.serve.app:build_app", "args": args}]}))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **throughput_mode_env(haproxy_dir),
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(direct_port + 1)}
    env.pop("RAY_ADDRESS", None)  # its own local cluster
    log = folder / "serve.log"
    command = [str(Path(sys.executable).parent / "serve"), "run", str(folder / "serve.yaml")]
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Served(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{direct_port}", log)
    try:
        def up() -> bool:  # HAProxy forwards as soon as the ingress answers: both LoRA replicas are awaited
            if proc.poll() is not None:
                pytest.fail(f"serve run did not come up in {START_S} s: {log.read_text()[-3000:]}")
            return _answers(server.http, "/health") and _replica_count(server.http) >= 2

        if not poll(up, START_S, interval_s=0.5):
            pytest.fail(f"serve run did not come up in {START_S} s: {log.read_text()[-3000:]}")
        yield server
    finally:
        server.http.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this fixture started
            proc.wait(10)
        shutil.rmtree(haproxy_dir, ignore_errors=True)


def _answers(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def _replica_count(http: httpx.Client) -> int:
    r = http.get("/debug/replicas", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    return len(r.json()["replicas"]) if r.status_code == 200 else 0


@pytest.fixture(scope="module")
def offline(make_engine):
    """The engine called directly, configured like the replicas: the reference for greedy outputs."""
    engine = make_engine(max_loras=4, max_lora_rank=32)
    yield lambda adapter, n: engine.generate(
        [PROMPT], adapter_ids=[adapter], sampling=SamplingParams(max_new_tokens=n, temperature=0.0))[0]
    engine.close()


@pytest.mark.e2e
def test_the_ingress_replica_serves_http_itself_and_haproxy_serves_the_configured_port(served):
    with httpx.Client(timeout=10) as plain:
        r = plain.get(f"{served.direct_url}/health")
        assert r.status_code == 200, f"the ingress replica answers on its own port (direct ingress): {r.text}"
        assert plain.get(f"{served.url}/health").json()["status"] == "ok", "the configured port answers"
    poll(lambda: f"lora-cluster ready at {served.url}" in served.log.read_text(), 30, interval_s=0.5)
    assert f"lora-cluster ready at {served.url}" in served.log.read_text(), (
        "the ready line reaches serve run's console (Serve's throughput mode keeps its own logs off stderr)")


@pytest.mark.e2e
def test_auth_and_models(served):
    assert httpx.get(f"{served.url}/v1/models").status_code == 401, "no API key: 401"
    r = served.http.get("/v1/models")
    assert r.status_code == 200, f"/v1/models answers a tenant: {r.text}"
    ids = [m["id"] for m in r.json()["data"]]
    assert set(ADAPTERS) <= set(ids), f"/v1/models lists the source's adapters, got {ids}"


@pytest.mark.e2e
def test_streamed_and_non_streamed_completions_equal_the_engine(served, offline):
    want = offline("a1", 12)
    body = {"model": "a1", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 200, f"the completion succeeds: {r.text}"
    assert r.json()["choices"][0]["text"] == want.text, "the greedy text equals the engine's"
    assert r.headers.get("x-request-id"), "the response carries a request id"
    with served.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream"), "the stream is SSE"
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", "the stream ends with [DONE]"
    assert len(events) > 2, f"the tokens arrive as several events: {events}"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == want.text, "the streamed events join to the engine's text"


@pytest.mark.e2e
def test_adapter_affinity_through_the_request_router(served):
    hits = adapter_hits(served.http, ADAPTERS, PROMPT, rounds=80)
    rate = sum(h.startswith("true") for h in hits) / len(hits)
    assert rate >= 0.95, f"adapter hit rate {rate:.2%}: {hits}"
    assert len({h.split()[1] for h in hits}) == 2, f"both replicas serve: {sorted(set(hits))}"


def _wait_until_aborted(served: Served, before: int, what: str) -> None:
    """Wait (20 s at most) until the replicas counted more than `before` cancelled requests and none runs."""
    seen: list[list[dict]] = []

    def aborted() -> bool:
        seen.append(stats := list(served.replicas().values()))
        return sum(s["cancelled"] for s in stats) > before and all(s["num_running"] == 0 for s in stats)

    if not poll(aborted, 20):
        pytest.fail(f"{what} was not aborted after its client went away: {seen[-1]}")


@pytest.mark.e2e
def test_a_streaming_client_going_away_aborts_its_request(served):
    before = sum(s["cancelled"] for s in served.replicas().values())
    body = {"model": "a7", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, "the streaming request starts"
        lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
        assert next(lines).startswith("data: "), "the first SSE event arrives"
        running = sum(s["num_running"] for s in served.replicas().values())
    assert running == 1, "the request was generating when its client went away"
    _wait_until_aborted(served, before, "the streaming request")


@pytest.mark.e2e
def test_a_non_streaming_client_going_away_aborts_its_request(served):
    before = sum(s["cancelled"] for s in served.replicas().values())
    body = json.dumps({"model": "a6", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                     + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        running = poll(lambda: sum(s["num_running"] for s in served.replicas().values()), 20, interval_s=0)
    assert running == 1, "the request was generating when its client went away"
    _wait_until_aborted(served, before, "the non-streaming request")

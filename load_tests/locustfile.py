"""Load test of a running lora-cluster: Zipf-popular adapters, streaming and non-streaming calls.

Each simulated user picks an adapter with Zipf popularity (adapter rank k drawn with probability
~ 1/k^s over `LORA_ADAPTERS` adapters a0..a{N-1}), then one of: OpenAI completion (non-streaming),
OpenAI completion (streaming), chat completion (streaming), LoRAX /generate, with weights 4:3:2:1.
A streaming call has three entries: the request itself (to the response headers, which lora-cluster
sends with the first token), "TTFT <name>" (to the first SSE event) and "<name> [DONE]" (to the end
of the stream). Every response's `x-lora-adapter-hit` header is counted; the hit rate is printed at
the end.

    RAY_AUTH_MODE=disabled serve run serve_config.yaml &      # or any lora-cluster deployment
    .venv/bin/locust -f load_tests/locustfile.py --host http://127.0.0.1:8000 \\
        --headless -u 32 -r 8 -t 2m --csv /tmp/lora-load

The adapters are drawn by `lora_cluster.sim.popularity` (pure Python, no torch or Ray), so the
Locust process runs from the project's virtual environment (or any with `lora_cluster` installed).

Before the first user starts, the test waits up to LORA_WAIT_S seconds (180) for `GET /health` to
answer 200, so that it can be started together with the server; if the server never answers, it
stops with one line, "server not reachable at <host> ...", instead of every user failing.

Knobs (environment): LORA_ADAPTERS (64), LORA_ZIPF_S (1.1), LORA_MAX_TOKENS (32),
LORA_BASE_FRACTION (0.05: share of requests to the base model), LORA_WAIT_S (180).
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request

import gevent
from locust import HttpUser, between, events, task

from lora_cluster.sim.popularity import ZipfSampler

NUM_ADAPTERS = int(os.environ.get("LORA_ADAPTERS", "64"))
ZIPF_S = float(os.environ.get("LORA_ZIPF_S", "1.1"))
MAX_TOKENS = int(os.environ.get("LORA_MAX_TOKENS", "32"))
BASE_FRACTION = float(os.environ.get("LORA_BASE_FRACTION", "0.05"))
WAIT_S = float(os.environ.get("LORA_WAIT_S", "180"))
WORDS = ["the", "river", "runs", "past", "a", "quiet", "town", "where", "people", "trade", "bread", "and",
         "stories", "about", "old", "ships", "music", "weather", "mountains", "market", "children",
         "lanterns", "winter", "harvest", "letters", "bridge"]

_POPULARITY = ZipfSampler(NUM_ADAPTERS, ZIPF_S)
_hits = {"true": 0, "false": 0}


def zipf_adapter(rng: random.Random) -> str:
    """Adapter a{k-1} with probability proportional to 1/k^s."""
    return f"a{_POPULARITY.draw(rng)}"


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def wait_for_health(host: str, wait_s: float) -> str | None:
    """Poll `host`/health until it answers 200 (None) or `wait_s` passes (the last problem seen)."""
    deadline, problem = time.monotonic() + wait_s, "no answer"
    while True:
        try:
            with urllib.request.urlopen(f"{host.rstrip('/')}/health", timeout=5) as r:
                if r.status == 200:
                    return None
                problem = f"/health answered {r.status}"
        except urllib.error.HTTPError as e:
            problem = f"/health answered {e.code}"
        except (urllib.error.URLError, OSError) as e:
            problem = str(getattr(e, "reason", e))
        if time.monotonic() >= deadline:
            return problem
        time.sleep(1.0)


@events.test_start.add_listener
def _wait_for_server(environment, **_kwargs) -> None:
    host = environment.host or ""
    if not host:
        return
    problem = wait_for_health(host, WAIT_S)
    if problem is not None:
        print(f"server not reachable at {host} after {WAIT_S:.0f} s ({problem}); is it running "
              f"(`serve run serve_config.yaml`) and on that port?")
        environment.process_exit_code = 1
        if environment.runner is not None:  # quit once the runner has finished starting
            gevent.spawn_later(0.1, environment.runner.quit)


class LoraUser(HttpUser):
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.base: str | None = None  # the base model's name, from /v1/models
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as r:
            try:
                self.base = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                self._fail(r)

    def _fail(self, r) -> None:
        """Mark `r` failed with one clear line (status 0: no answer at all)."""
        if r.status_code == 0:
            r.failure(f"server not reachable at {self.host}: {r.error}")
        else:
            r.failure(f"{r.status_code}: {(r.text or '')[:200]}")

    def _model(self) -> str:
        if self.base is not None and self.rng.random() < BASE_FRACTION:
            return self.base
        return zipf_adapter(self.rng)

    def _count(self, response) -> None:
        hit = response.headers.get("x-lora-adapter-hit")
        if hit in _hits:
            _hits[hit] += 1

    def _stream(self, path: str, body: dict, name: str) -> None:
        start = time.perf_counter()
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as r:
            if r.status_code != 200:
                self._fail(r)
                return
            self._count(r)
            first, done = None, False
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if first is None:
                    first = time.perf_counter() - start
                    events.request.fire(request_type="POST", name=f"TTFT {name}", response_time=first * 1000,
                                        response_length=0, exception=None, context={})
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    done = True
                elif b'"error"' in payload and "error" in json.loads(payload):
                    r.failure(payload.decode()[:200])
                    return
            if not done:
                r.failure("stream ended without [DONE]")
                return
            events.request.fire(request_type="POST", name=f"{name} [DONE]",
                                response_time=(time.perf_counter() - start) * 1000, response_length=0,
                                exception=None, context={})

    @task(4)
    def completion(self) -> None:
        body = {"model": self._model(), "prompt": prompt(self.rng), "max_tokens": MAX_TOKENS,
                "temperature": 0.7}
        with self.client.post("/v1/completions", json=body, name="/v1/completions", catch_response=True) as r:
            if r.status_code != 200:
                self._fail(r)
            else:
                self._count(r)

    @task(3)
    def completion_stream(self) -> None:
        body = {"model": self._model(), "prompt": prompt(self.rng), "max_tokens": MAX_TOKENS, "stream": True}
        self._stream("/v1/completions", body, "/v1/completions stream")

    @task(2)
    def chat_stream(self) -> None:
        body = {"model": self._model(), "messages": [{"role": "user", "content": prompt(self.rng)}],
                "max_tokens": MAX_TOKENS, "stream": True}
        self._stream("/v1/chat/completions", body, "/v1/chat/completions stream")

    @task(1)
    def lorax_generate(self) -> None:
        body = {"inputs": prompt(self.rng), "parameters": {"adapter_id": zipf_adapter(self.rng),
                                                           "max_new_tokens": MAX_TOKENS}}
        with self.client.post("/generate", json=body, name="/generate", catch_response=True) as r:
            if r.status_code != 200:
                self._fail(r)
            else:
                self._count(r)


@events.quitting.add_listener
def _report_hit_rate(environment, **_kwargs) -> None:
    total = _hits["true"] + _hits["false"]
    if total:
        print(f"adapter hit rate: {_hits['true'] / total:.1%} of {total} responses (x-lora-adapter-hit)")

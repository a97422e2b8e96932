"""The cluster-wide priority order end to end: a real Ray Serve app of two LoRA replicas of two batch
slots each (`max_num_seqs` 2, `max_ongoing_requests` 4, the cluster controller on), streaming.

24 priority-2 (`batch`) requests are sent at once, then 2 s later, while most of them still wait,
6 priority-0 (`interactive`) ones. The priority-2 requests that had not started yet when a
priority-0 one arrived must, for the most part, start after it: the *overtake share* is at most
`MAX_OVERTAKE_SHARE`.

Overtake share, precisely: for each priority-0 request P (arrival a_P, first token f_P), the
priority-2 requests q still waiting at P's arrival (sent before a_P, first token after a_P); of
these, the overtaking ones got their first token before P (f_q < f_P). Pooled over the 6: overtaking
pairs / waiting pairs. Times are the client's (monotonic): arrival just before the request is sent,
first token when the first SSE chunk with text is read. A few overtakes are unavoidable (requests
already in a replica's engine when P arrives take a slot that frees before P reaches that replica).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import httpx
import pytest
from helpers import wait_until

pytestmark = [pytest.mark.e2e]

PROMPT = "the quick brown fox"
LOW, HIGH = 24, 6  # priority-2 requests, then priority-0 ones
LOW_TOKENS, HIGH_TOKENS = 400, 8  # a priority-2 request runs 1-2 s here, so most still wait at 2 s
HIGH_AFTER_S = 2.0
MAX_OVERTAKE_SHARE = 0.25
BOUND_S = 90.0  # every request, and the whole burst, ends within this


@pytest.fixture(scope="module")
def app_config(demo_zoo) -> dict[str, Any]:
    return {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
        "num_replicas": 2, "num_cpus": 1, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 2,
        "max_ongoing_requests": 4,
    }


@pytest.fixture(scope="module")
def base_url(ray_app, app_config):
    with ray_app(app_config) as url:
        yield url


def _stream(base_url: str, model: str, priority: int, max_tokens: int, deadline: float) -> dict[str, Any]:
    """One streamed completion at vLLM's `priority`: its status, arrival and first-token times."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "priority": priority}
    sent = time.monotonic()
    first = None
    timeout = max(1.0, deadline - sent)
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return {"status": status, "priority": priority, "sent": sent, "first": None, "body": r.text[:200]}
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    first = time.monotonic()
            if time.monotonic() > deadline:
                break
    return {"status": status, "priority": priority, "sent": sent, "first": first}


def overtake_share(low: list[dict[str, Any]], high: list[dict[str, Any]]) -> tuple[int, int]:
    """(overtaking pairs, waiting pairs) as the module docstring defines them."""
    overtaking = waiting = 0
    for p in high:
        for q in low:
            if q["sent"] < p["sent"] and q["first"] > p["sent"]:
                waiting += 1
                overtaking += q["first"] < p["first"]
    return overtaking, waiting


def test_urgent_requests_start_before_the_less_urgent_ones_still_waiting(base_url):
    with httpx.Client(base_url=base_url, timeout=BOUND_S) as http:  # the app serves (adapters known)
        wait_until(lambda: http.post("/v1/completions", json={"model": "a0", "prompt": PROMPT,
                                                               "max_tokens": 2}).status_code == 200,
                   BOUND_S, "a first request is served")
    deadline = time.monotonic() + BOUND_S
    with concurrent.futures.ThreadPoolExecutor(LOW + HIGH) as pool:
        low = [pool.submit(_stream, base_url, f"a{i % 4}", 2, LOW_TOKENS, deadline) for i in range(LOW)]
        time.sleep(HIGH_AFTER_S)
        high = [pool.submit(_stream, base_url, "a5", 0, HIGH_TOKENS, deadline) for _ in range(HIGH)]
        low_results = [f.result(timeout=BOUND_S) for f in low]
        high_results = [f.result(timeout=BOUND_S) for f in high]
    results = low_results + high_results
    assert [r["status"] for r in results] == [200] * (LOW + HIGH), (
        f"every request is served: {[(r['priority'], r['status'], r.get('body')) for r in results]}")
    assert all(r["first"] is not None for r in results), "every request streams a first token in time"
    overtaking, waiting = overtake_share(low_results, high_results)
    assert waiting >= HIGH * 4, (
        f"priority-2 requests still wait when the priority-0 ones arrive ({waiting} waiting pairs)")
    share = overtaking / waiting
    t0 = min(r["sent"] for r in results)
    starts = sorted((round(r["first"] - t0, 2), r["priority"]) for r in results)
    print(f"overtake share {overtaking}/{waiting} = {share:.3f}")  # shown by pytest -rP
    assert share <= MAX_OVERTAKE_SHARE, (
        f"{overtaking} of {waiting} ({share:.0%}) priority-2 requests that still waited when a priority-0 "
        f"request arrived started before it (at most {MAX_OVERTAKE_SHARE:.0%}); first tokens (s, priority): "
        f"{starts}")

"""Refusals at the edge through Ray Serve (the shared demo app, `shared_apps.demo_config`: 2 replicas of 8
slots and a cluster queue of 4): once the controller has refused a request for its full queue, the ingress
refuses the next ones itself, and a client cannot tell them apart: the same status, error body and
Retry-After. The ingress counts its refusals (`lora_cluster_edge_refusals_total`), the controller its own.

Named to run after `test_serve_e2e.py` on the same shared app: the 40 requests of `a5` here keep `a5` on
a device slot of both replicas for the eviction window (`replica_policy.eviction`: frequency in a
sliding window), and that module's affinity test counts on the 8 slots for its 8 adapters."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest
from shared_apps import demo_config

pytestmark = pytest.mark.e2e

BODY = {"model": "a5", "prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}
HEADERS = {"x-lora-priority": "batch"}  # no TTFT target: no deadline refusal
FULL = "the cluster queue is full (4 requests wait; cluster_queue_size)"  # QueueFullError (size 4)


@pytest.fixture(scope="module")
def app_config(demo_zoo):
    return demo_config(demo_zoo)


def _edge_refusals(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(
        r'^lora_cluster_edge_refusals_total\{[^}]*priority_class="batch"[^}]*\} (\S+)$', text, re.M))


def _controller_refusals(http: httpx.Client) -> int:
    return int(http.get("/v1/cluster").json()["controller"]["counts"]["rejected"])


def test_a_request_refused_at_the_edge_gets_the_controllers_answer_and_is_counted(demo_app):
    with httpx.Client(base_url=demo_app, timeout=120) as http:
        edge_before, controller_before = _edge_refusals(http), _controller_refusals(http)

        def one(_: int) -> httpx.Response:
            return httpx.post(f"{demo_app}/v1/completions", json=BODY, headers=HEADERS, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(28) as pool:
            burst = [pool.submit(one, i) for i in range(28)]  # 16 slots + 4 queued, the rest refused
            done = concurrent.futures.as_completed(burst)
            first_refused = next((f for f in done if f.result().status_code == 429), None)
            # one after the other: each reaches the ingress soon after the previous answer, whose state
            # (sent with the controller's refusal) says the queue is full, well within edge_max_age_s
            later = [one(i) for i in range(12)]
            answers = [f.result() for f in burst] + later
        assert first_refused is not None, "the burst overflows the cluster queue"
        codes = [r.status_code for r in answers]
        assert set(codes) <= {200, 429}, f"served or refused: {codes}"
        # the full queue's refusals (the others: a parked request bumped by one that arrived earlier and
        # parked later, or Serve's own queue in front of a replica; neither is the edge's to make)
        full = [r for r in answers if r.status_code == 429 and r.json()["error"]["message"] == FULL]
        edge = _edge_refusals(http) - edge_before
        by_controller = _controller_refusals(http) - controller_before
        assert edge >= 1, f"the ingress refused some itself: {edge}"
        assert by_controller >= 1, f"the controller refused some: {by_controller}"
        assert edge + by_controller == len(full), (
            f"each full-queue 429 was refused once, at the edge ({edge}) or by the controller "
            f"({by_controller}): {len(full)}")
        bodies = {r.text for r in full}
        assert len(bodies) == 1, f"every refusal has the same error body: {bodies}"
        retry = {r.headers.get("retry-after") for r in full}
        assert len(retry) == 1 and None not in retry, f"every refusal has the same Retry-After: {retry}"

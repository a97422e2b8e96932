"""Refusals at the edge through Ray Serve (the demo app's config, `shared_apps.demo_config`, deployed for
this module: 2 replicas of 8 slots and a cluster queue of 4): once the controller has refused a request
for its full queue, the ingress refuses the next ones itself, and a client cannot tell them apart: the
same status, error body and Retry-After. The ingress counts its refusals
(`lora_cluster_edge_refusals_total`), the controller its own."""

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
def edge_app(ray_app, demo_zoo):
    """The demo app with a longer staleness bound, deployed for this module alone: on this loaded 2-core
    machine an answer can take longer than the 0.1 s default (the rule is the same); and its own
    deployment keeps the adapter this module makes hot (40 requests of `a5`) out of the shared demo
    app, whose replicas' slot policy (`replica_policy.eviction`: frequency in a sliding window) would
    keep `a5` on a device slot that the next modules' tests count on for their own adapters."""
    with ray_app({**demo_config(demo_zoo), "edge_max_age_s": 1.0}) as url:
        yield url


def _edge_refusals(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(
        r'^lora_cluster_edge_refusals_total\{[^}]*priority_class="batch"[^}]*\} (\S+)$', text, re.M))


def _controller_refusals(http: httpx.Client) -> int:
    return int(http.get("/v1/cluster").json()["controller"]["counts"]["rejected"])


def test_a_request_refused_at_the_edge_gets_the_controllers_answer_and_is_counted(edge_app):
    with httpx.Client(base_url=edge_app, timeout=120) as http:
        edge_before, controller_before = _edge_refusals(http), _controller_refusals(http)

        def one(_: int) -> httpx.Response:
            return httpx.post(f"{edge_app}/v1/completions", json=BODY, headers=HEADERS, timeout=120)

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

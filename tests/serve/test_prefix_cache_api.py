"""Prefix caching seen from outside: the replica's wire items, the OpenAI routes' usage and
`x-lora-cached-tokens` header, and the metrics per adapter and per replica.

The HTTP tests run the ingress's FastAPI app in process around a dispatcher that runs each job on a
real engine of the demo zoo and answers with the replica's own wire item (`protocol.output_item`),
so the cached-token count travels the replica's path, not a fake's number."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from app_client import FakeDispatcher, FakeStream, serving
from helpers import greedy
from prometheus_client.parser import text_string_to_metric_families

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.engine import Engine
from lora_cluster.serve.ops import generation_metrics, metrics_exposition
from lora_cluster.serve.protocol import GenerateJob, output_item
from lora_cluster.serve.routing.dispatch import Generation

BLOCK = 16  # the shipped kv_block_size
PROMPT = "the river runs past the old mill and the children watch the boats go by " * 3


class EngineDispatcher(FakeDispatcher):
    """One replica "r1" that runs every job, in turn, to its end on a real engine and answers with the
    replica's final wire item."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine
        self._lock = threading.Lock()

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        out = await asyncio.to_thread(self._run, job)
        first = {"replica": "r1", "hit": True, **output_item(out, full=True)}
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream([]))

    def _run(self, job: GenerateJob) -> Any:
        with self._lock:
            return self.engine.generate([job.prompt], [job.adapter_id], job.sampling)[0]


@pytest.fixture(scope="module")
def engine(make_engine) -> Iterator[Engine]:
    engine = make_engine(max_loras=2, max_lora_rank=32)  # the shipped kv_block_size and prefix caching
    yield engine
    engine.close()


def _prompt_len(engine: Engine) -> int:
    return len(engine.tokenize(PROMPT))


def test_the_wire_item_carries_the_cached_prompt_tokens(engine) -> None:
    prompt = list(range(20, 60))
    first = output_item(engine.generate([prompt], ["a3"], greedy(2))[0], full=True)
    again = output_item(engine.generate([prompt], ["a3"], greedy(2))[0], full=True)
    assert first["cached_tokens"] == 0, "the first request finds nothing cached"
    assert again["cached_tokens"] == 32, "the second reuses the 2 full blocks of its 40-token prompt"


async def test_usage_and_header_report_the_cached_tokens_once_per_prompt(engine) -> None:
    n = _prompt_len(engine)
    full = (n - 1) // BLOCK * BLOCK
    assert full >= 2 * BLOCK, f"the test prompt fills at least two blocks ({n} tokens)"
    body = {"model": "a6", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2}
    async with serving(engine.tokenizer, EngineDispatcher(engine)) as client:
        first = await client.post("/v1/completions", json=body)
        second = await client.post("/v1/completions", json=body)
        chat_body = {"model": "a6", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        await client.post("/v1/chat/completions", json=chat_body)
        chat = await client.post("/v1/chat/completions", json=chat_body)
    assert first.status_code == 200, first.text
    assert first.headers["x-lora-cached-tokens"] == "0", (
        "the first choice of a new prompt found nothing cached (its second choice's hits are not counted "
        "again: the prompt counts once, as in prompt_tokens)")
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == n, "prompt_tokens counts the prompt once"
    assert usage["prompt_tokens_details"] == {"cached_tokens": full}, "the repeated prompt's full blocks"
    assert second.headers["x-lora-cached-tokens"] == str(full), "the header says the same"
    chat_usage = chat.json()["usage"]
    chat_full = (chat_usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert chat_usage["prompt_tokens_details"]["cached_tokens"] == chat_full, (
        "a repeated chat reuses its rendered prompt's full blocks")


async def test_a_stream_reports_the_cached_tokens_in_its_usage_chunk(engine) -> None:
    full = (_prompt_len(engine) - 1) // BLOCK * BLOCK
    body = {"model": "a7", "prompt": PROMPT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with serving(engine.tokenizer, EngineDispatcher(engine)) as client:
        await client.post("/v1/completions", json={**body, "stream": False})
        streamed = await client.post("/v1/completions", json=body)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert streamed.headers["x-lora-cached-tokens"] == str(full), "the stream's header counts the hits"
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": full}, "and its usage chunk"


def _sample(name: str, labels: dict[str, str]) -> float | None:
    for family in text_string_to_metric_families(metrics_exposition.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_cached_prompt_tokens_are_counted_per_adapter_and_hits_per_replica() -> None:
    labels = {"adapter": "_base", "tenant": "_none", "priority_class": "interactive"}
    before = _sample("lora_cluster_prompt_cached_tokens_total", labels) or 0.0
    meter = generation_metrics.GenerationMetrics(None, None, "interactive")
    meter.started(0.01)
    meter.finished(100, 3, 64)
    after = _sample("lora_cluster_prompt_cached_tokens_total", labels)
    assert after == before + 64, "a finished generation's cached prompt tokens count under its adapter label"
    engine = {"prefix_cache_queried_tokens": 500, "prefix_cache_hit_tokens": 320, "prefix_cache_evictions": 4,
              "prefix_cache_blocks": 20}
    metrics_exposition.set_replica_stats_source(lambda: {"r9": RoutingStats(engine=engine)})
    try:
        found = {name: _sample(name, {"replica": "r9"}) for name in (
            "lora_cluster_prefix_cache_queried_tokens_total", "lora_cluster_prefix_cache_hit_tokens_total",
            "lora_cluster_prefix_cache_evictions_total", "lora_cluster_prefix_cache_blocks")}
        ratio = _sample("lora_cluster_prefix_cache_hit_ratio", {"replica": "r9"})
    finally:
        metrics_exposition.set_replica_stats_source(lambda: {})
    assert found == {"lora_cluster_prefix_cache_queried_tokens_total": 500.0,
                     "lora_cluster_prefix_cache_hit_tokens_total": 320.0,
                     "lora_cluster_prefix_cache_evictions_total": 4.0,
                     "lora_cluster_prefix_cache_blocks": 20.0}, "the replica's prefix cache is exported"
    assert ratio == 0.64, "and its hit rate since it started (hit / queried tokens)"


async def test_the_cluster_view_shows_each_replicas_prefix_cache_from_its_last_report() -> None:
    from types import SimpleNamespace

    from lora_cluster.serve.routing.admission import ClusterAdmission
    from lora_cluster.serve.routing.dispatch import Dispatcher
    from lora_cluster.serve.routing.replica_tables import publish_replica_stats

    async def snapshot() -> dict:
        return {"nodes": {"n1": {"replicas": {"r1": {"running": 0}, "r2": {"running": 0},
                                              "r3": {"running": 0}}}}}

    controller = SimpleNamespace(snapshot=SimpleNamespace(remote=snapshot))
    handle = SimpleNamespace(deployment_name="LoraReplica", options=lambda **_: None)
    dispatcher = Dispatcher(handle, "view-app", admission=ClusterAdmission(
        controller, capacity=None, replica_stats=dict, timeout_s=1.0))
    publish_replica_stats("view-app", "LoraReplica", {
        "r1": RoutingStats(engine={"prefix_cache_queried_tokens": 400, "prefix_cache_hit_tokens": 300,
                                   "prefix_cache_blocks": 25, "prefix_cache_evictions": 2}),
        "r2": RoutingStats(engine={"prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
                                   "prefix_cache_blocks": 0, "prefix_cache_evictions": 0})})
    replicas = (await dispatcher.cluster_view())["nodes"]["n1"]["replicas"]
    assert replicas["r1"]["prefix_cache"] == {"queried_tokens": 400, "hit_tokens": 300, "hit_rate": 0.75,
                                              "cached_blocks": 25, "evictions": 2}, (
        "a replica's entry carries its prefix cache's figures from its last report")
    assert replicas["r2"]["prefix_cache"]["hit_rate"] is None, "no rate before any token was looked up"
    assert "prefix_cache" not in replicas["r3"], "a replica the router has no report of yet shows none"

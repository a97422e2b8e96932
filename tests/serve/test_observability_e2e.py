"""Observability end to end through Ray Serve: one small app (tiny demo zoo, autoscaling LoRA replicas
between 1 and 2, at most 3 adapter labels) shared by every test here.

* the scrape of `GET /metrics` after traffic over more adapters than `metrics_max_adapter_labels`:
  bounded adapter labels, histograms per class and tenant, counts that add up to the requests sent;
* every metric name the Grafana dashboard and the PrometheusRule use exists in that live scrape;
* Ray Serve adds a LoRA replica under load and removes it afterwards (`autoscaling_config` with
  short periods).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import poll, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MAX_ADAPTER_LABELS = 3
ADAPTERS = [f"a{i}" for i in range(8)]  # more adapters than labels
CLASSES = ("interactive", "batch")
APP = "obs"


@pytest.fixture(scope="module")
def base_url(ray_app, demo_zoo):
    config = {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "num_cpus": 1,
        "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 4, "max_num_batched_tokens": 64,
        "max_ongoing_requests": 8, "routing_stats_period_s": 0.5, "controller_report_period_s": 0.5,
        "metrics_max_adapter_labels": MAX_ADAPTER_LABELS,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                               "upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "look_back_period_s": 1.0,
                               "metrics_interval_s": 0.5},
    }
    with ray_app(config, name=APP) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        wait_until(lambda: client.get("/health").status_code == 200, 60, "the app to answer /health")
        yield client


def _scrape(http: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted label pairs: value}} of one scrape."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for line in http.get("/metrics").text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m and not line.startswith("#"):
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out.setdefault(m.group(1), {})[labels] = float(m.group(3))
    return out


def _total(scrape: dict, name: str, **match: str) -> float:
    samples = scrape.get(name, {}).items()
    return sum(v for k, v in samples if all(dict(k).get(a) == b for a, b in match.items()))


def _complete(http: httpx.Client, adapter: str, klass: str, max_tokens: int = 4) -> int:
    r = http.post("/v1/completions", headers={"x-lora-priority": klass},
                  json={"model": adapter, "prompt": "the quick brown fox", "max_tokens": max_tokens,
                        "temperature": 0})
    assert r.status_code == 200, f"{adapter} answers: {r.text}"
    return r.json()["usage"]["completion_tokens"]


def test_scrape_bounds_adapter_labels_and_counts_add_up(http):
    before = _scrape(http)
    sent, tokens = 0, 0
    for adapter in ADAPTERS:
        for klass in CLASSES:
            tokens += _complete(http, adapter, klass)
            sent += 1
    after = _scrape(http)
    gens = "lora_cluster_generations_total"
    adapters = {dict(k)["adapter"] for k in after[gens]} - {"_base"}
    assert len(adapters - {"other"}) <= MAX_ADAPTER_LABELS, f"at most 3 adapter ids: {adapters}"
    assert "other" in adapters, f"the other adapters are counted as adapter='other': {adapters}"
    assert _total(after, gens, outcome="ok") - _total(before, gens, outcome="ok") == sent, (
        "every request is counted once over the adapter labels")
    ttft = "lora_cluster_time_to_first_token_seconds_count"
    for klass in CLASSES:
        got = (_total(after, ttft, priority_class=klass, tenant="_none")
               - _total(before, ttft, priority_class=klass, tenant="_none"))
        assert got == len(ADAPTERS), f"one TTFT sample per request of class {klass} (tenant '_none'): {got}"
    e2e = "lora_cluster_e2e_request_latency_seconds_count"
    assert _total(after, e2e) - _total(before, e2e) == sent, "one end-to-end latency sample per request"
    generated = "lora_cluster_generated_tokens_total"
    assert _total(after, generated) - _total(before, generated) == tokens, (
        "generated tokens add up to the completion tokens of the responses")
    decisions = "lora_cluster_routing_decisions_total"
    assert _total(after, decisions) - _total(before, decisions) == sent, "one routing decision per request"


def _names_used() -> set[str]:
    """lora_cluster_* names in the dashboard's queries and variables and in the PrometheusRule's exprs."""
    dashboard = json.loads((ROOT / "deploy/grafana/lora-cluster.json").read_text())
    texts = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    texts += [json.dumps(v.get("query")) for v in dashboard["templating"]["list"]]
    for doc in yaml.safe_load_all((ROOT / "deploy/k8s/monitoring.yaml").read_text()):
        if doc["kind"] == "PrometheusRule":
            texts += [r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]]
    return {name for text in texts for name in re.findall(r"\blora_cluster_[a-z0-9_]+", text)}


def test_every_metric_of_the_dashboard_and_the_alerts_is_in_a_live_scrape(http):
    _complete(http, "a1", "interactive")
    time.sleep(1.0)  # the replicas' next routing-stats report carries their counters
    scraped = set(_scrape(http))
    # series only while an adapter is released (test_releases_e2e checks them), and only for tenants
    # with a budget (test_usage_budgets reads the gauge from /metrics)
    only_when_set = ("lora_cluster_release_", "lora_cluster_usage_budget_")
    used = {name for name in _names_used() if not name.startswith(only_when_set)}
    assert len(used) >= 30, f"the dashboard and rules use the metrics: {sorted(used)}"
    missing = sorted(used - scraped)
    assert not missing, f"names used by the dashboard or the alerts that the scrape lacks: {missing}"


def _running_replicas() -> int:
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    name = next(d for d in deployments if d.startswith("LoraReplica"))
    return deployments[name].replica_states.get("RUNNING", 0)


def test_serve_adds_a_replica_under_load_and_removes_it_after(base_url, http):
    assert poll(lambda: _running_replicas() == 1, 30), "the app starts at min_replicas = 1"
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"model": "a2", "prompt": "the quick brown fox",
                                                     "max_tokens": 24, "temperature": 0})

    threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        scaled_up = poll(lambda: _running_replicas() == 2, 120)  # a new replica loads its model
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert scaled_up, "under load (6 requests in flight, target 1 per replica) Serve adds a second replica"
    assert poll(lambda: _running_replicas() == 1, 90), "once the load is gone Serve removes it again"

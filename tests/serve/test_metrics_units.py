"""Observability without Ray: bounded metric labels (`serve.ops.top_labels`), request metrics by adapter,
tenant and class (`serve.ops.generation_metrics`), replica-report families (`serve.ops.replica_metrics`),
engine counters, autoscaling options."""

from __future__ import annotations

import re

import pytest
from helpers import FakeClock

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.errors import ConfigError
from lora_cluster.serve.ops import generation_metrics, metrics, metrics_exposition
from lora_cluster.serve.ops.top_labels import OTHER, TopLabels


def _samples(name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted label pairs: value} of one sample name in the current scrape."""
    out = {}
    for line in metrics_exposition.render().decode().splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")))
            out[labels] = float(m.group(2))
    return out


def _label_values(name: str, label: str) -> set[str]:
    return {dict(k)[label] for k in _samples(name) if label in dict(k)}


# ----- TopLabels: the pure policy ---------------------------------------------------------------


def test_first_values_keep_their_label_until_the_bound_then_other():
    top = TopLabels(2, 60.0, clock=FakeClock(0.0))
    assert [top.label(v) for v in ("a", "b", "c", "a")] == ["a", "b", OTHER, "a"], (
        "the first max_labels values keep their id, later ones are 'other'")
    assert top.kept == {"a", "b"}, "exactly max_labels values are kept"


def test_the_busiest_values_of_a_window_take_the_labels_and_the_others_are_demoted():
    clock = FakeClock(0.0)
    top = TopLabels(2, 10.0, clock=clock)
    for v in ["a", "b"] + ["c"] * 5 + ["d"] * 3 + ["a"]:
        top.label(v)
    clock.now = 10.0
    assert top.label("c") == "c", "the busiest value of the last window is its own label after re-ranking"
    assert top.kept == {"c", "d"}, "the two busiest values of the window are kept"
    assert top.take_demoted() == ["a", "b"], "the values that lost their label are handed over once"
    assert top.take_demoted() == [], "a demotion is handed over only once"


def test_idle_values_stay_kept_while_there_is_room():
    clock = FakeClock(0.0)
    top = TopLabels(3, 10.0, clock=clock)
    for v in ("a", "b", "c", "c"):
        top.label(v)
    clock.now = 10.0
    top.label("a")
    clock.now = 20.0  # a window in which only "a" was used
    top.label("a")
    assert top.kept == {"a", "b", "c"}, "values without use stay labelled while nobody needs their place"
    assert top.take_demoted() == [], "nothing is demoted when no value needs the room"


def test_tracking_is_bounded_and_a_busy_newcomer_still_ranks():
    clock = FakeClock(0.0)
    top = TopLabels(2, 10.0, clock=clock, max_tracked=64)
    for i in range(1000):
        top.label(f"cold{i}")
    assert top.tracked <= 64, f"at most max_tracked values are counted, got {top.tracked}"
    for _ in range(50):
        top.label("hot")
    clock.now = 10.0
    top.label("x")
    assert "hot" in top.kept, "a value that became busy after the table filled is kept after re-ranking"


def test_zero_labels_and_the_literal_other():
    assert TopLabels(0, 1.0).label("a") == OTHER, "max_labels=0 reports every value as 'other'"
    top = TopLabels(5, 1.0)
    assert top.label(OTHER) == OTHER and top.kept == frozenset(), "a value named 'other' merges with the rest"
    with pytest.raises(ValueError, match="max_labels"):
        TopLabels(-1, 1.0)


# ----- request metrics by adapter, tenant and class ---------------------------------------------


def _run(adapter: str | None, tenant: str | None, klass: str, clock: FakeClock, *, seconds: float = 0.5,
         tokens: int = 3) -> None:
    m = generation_metrics.GenerationMetrics(adapter, tenant, klass, clock=clock)
    m.admitted()
    clock.now += 0.1
    m.started()
    m.tokens(tokens)
    clock.now += seconds
    m.finished(4, tokens)


def test_adapter_labels_are_bounded_and_counts_add_up():
    clock = FakeClock(0.0)
    generation_metrics.configure(ServeConfig(metrics_max_adapter_labels=3, metrics_label_window_s=1000.0),
                                 clock)
    before = sum(_samples("lora_cluster_generations_total").values())
    adapters = [f"u{i}" for i in range(8)]
    for i in range(24):
        _run(adapters[i % 8], "acme" if i % 2 else None, "interactive" if i % 3 else "batch", clock)
    values = _label_values("lora_cluster_generations_total", "adapter") - {"_base"}
    assert len(values - {OTHER}) <= 3, f"at most 3 adapters keep their label: {values}"
    assert OTHER in values, "the other adapters are counted as 'other'"
    total = sum(_samples("lora_cluster_generations_total").values()) - before
    assert total == 24, f"every generation is counted once: {total}"
    tenants = _label_values("lora_cluster_time_to_first_token_seconds_count", "tenant")
    assert {"acme", metrics.NO_TENANT} <= tenants, f"histograms per tenant, '_none' without one: {tenants}"
    classes = _label_values("lora_cluster_e2e_request_latency_seconds_count", "priority_class")
    assert {"interactive", "batch"} <= classes, f"histograms per SLA class: {classes}"


def test_a_demoted_adapter_loses_its_series():
    clock = FakeClock(0.0)
    generation_metrics.configure(ServeConfig(metrics_max_adapter_labels=1, metrics_label_window_s=10.0),
                                 clock)
    _run("old-one", None, "standard", clock)
    assert "old-one" in _label_values("lora_cluster_generations_total", "adapter"), "labelled at first"
    clock.now = 20.0
    in_flight = generation_metrics.GenerationMetrics("old-one", None, "standard", clock=clock)
    in_flight.started()  # still labelled "old-one" when it starts
    for _ in range(3):
        _run("new-one", None, "standard", clock)
    clock.now = 40.0
    _run("new-one", None, "standard", clock)
    in_flight.tokens(3)
    in_flight.finished(4, 3)  # ends after the demotion
    values = _label_values("lora_cluster_generations_total", "adapter")
    assert "old-one" not in values, f"the demoted adapter's series are dropped: {values}"
    assert "new-one" in values, "the busiest adapter of the window has its label"
    # live: 7 request metrics x {new-one, other} (new-one was "other" until the re-ranking) + SLO met,
    # missed (the slow in-flight one)
    series = generation_metrics.label_series()
    assert series == 16, f"the series index holds live series only: {series}"


def test_slo_outcome_follows_the_class_targets():
    clock = FakeClock(0.0)
    generation_metrics.configure(ServeConfig(), clock)
    before = _samples("lora_cluster_slo_requests_total")
    _run("a0", None, "interactive", clock, seconds=0.1)  # TTFT 0.1 s, TPOT 0.05 s: met
    _run("a0", None, "interactive", clock, seconds=3.0)  # TPOT 1.5 s > 0.2 s: missed
    failed = generation_metrics.GenerationMetrics("a0", None, "interactive", clock=clock)
    failed.started()
    failed.failed()
    after = _samples("lora_cluster_slo_requests_total")

    def delta(outcome: str) -> float:
        key = (("outcome", outcome), ("priority_class", "interactive"), ("tenant", metrics.NO_TENANT))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("met") == 1, "a request within both targets met its SLA"
    assert delta("missed") == 2, "a slow request and a failed one missed it"


def test_routing_decisions_hit_miss_spill():
    stats = {"r1": RoutingStats(resident=("a",)), "r2": RoutingStats(loading=("b",))}
    decision = generation_metrics.routing_decision
    assert decision("a", "r1", True, stats) == "hit", "resident where it ran: hit"
    assert decision("b", "r1", False, stats) == "spill", "held elsewhere only: spill"
    assert decision("c", "r1", False, stats) == "miss", "held nowhere: miss"


def test_replica_reports_become_load_memory_and_engine_families():
    buckets = [0] * 15
    buckets[4] = 2  # two loads of at most 25 ms
    report = {
        "store": {"host": {"hits": 3, "misses": 1, "loads": 1, "failures": 1, "load_buckets": buckets,
                           "load_seconds_total": 0.04}},
        "engine": {"placements": 5, "switches": 2, "placement_failures": 0, "placement_buckets": buckets,
                   "placement_seconds_total": 0.03, "steps": 10, "batched_seqs": 25, "sampled_tokens": 25,
                   "preemptions": 1, "failed_steps": 0, "adapter_pool_fragmentation": 0.25},
        "memory": {"base_weights": 1000, "kv_cache": 500, "adapter_pool": 200, "free": None},
        "node_id": "n1", "classes": {"standard": {"running": 1, "waiting": 2, "slo_attainment": 0.5}},
    }
    metrics_exposition.set_replica_stats_source(lambda: {"r1": RoutingStats.from_dict(report)})
    loads = _samples("lora_cluster_adapter_loads_total")
    assert loads[(("outcome", "ok"), ("replica", "r1"), ("tier", "device"))] == 5, "device loads = placements"
    assert loads[(("outcome", "failed"), ("replica", "r1"), ("tier", "host"))] == 1, "failed host loads"
    le = _samples("lora_cluster_adapter_load_duration_seconds_bucket")
    assert le[(("le", "0.025"), ("replica", "r1"), ("tier", "device"))] == 2, "buckets are cumulative"
    assert le[(("le", "0.01"), ("replica", "r1"), ("tier", "device"))] == 0, "nothing below 10 ms"
    memory = _samples("lora_cluster_device_memory_bytes")
    assert memory[(("node", "n1"), ("replica", "r1"), ("use", "kv_cache"))] == 500, "memory by use and node"
    assert not any(dict(k)["use"] == "free" for k in memory), "unknown free memory (CPU) is no sample"
    assert _samples("lora_cluster_adapter_switches_total")[(("replica", "r1"),)] == 2, "switches per replica"
    assert _samples("lora_cluster_adapter_pool_fragmentation_ratio")[(("replica", "r1"),)] == 0.25, (
        "the adapter pool's fragmentation")
    assert _samples("lora_cluster_adapter_cache_hit_ratio")[(("replica", "r1"), ("tier", "host"))] == 0.75, (
        "hit ratio per tier")
    assert _samples("lora_cluster_replica_requests")[
        (("priority_class", "standard"), ("replica", "r1"), ("state", "waiting"))] == 2, "queue per class"


# ----- engine counters, config, autoscaling -----------------------------------------------------


def test_engine_counts_steps_placements_switches_and_fragmentation(make_engine):
    from lora_cluster.engine import SamplingParams

    engine = make_engine(max_loras=2, max_lora_rank=32)
    try:
        empty = engine.counters_snapshot()["adapter_pool_fragmentation"]
        assert empty == 0.0, "an empty pool is not fragmented"
        engine.generate(["a b", "c d", "e f"], adapter_ids=["a0", "a1", "a2"],
                        sampling=SamplingParams(max_new_tokens=3, temperature=0.0))
        c = engine.counters_snapshot()
    finally:
        engine.close()
    assert c["placements"] == 3, f"three adapters were placed into slots: {c}"
    assert c["switches"] >= 1, f"the third one replaced another adapter (two slots): {c}"
    assert sum(c["placement_buckets"]) == c["placements"], "every placement is in the latency histogram"
    assert c["sampled_tokens"] == 9 and c["steps"] >= 3, f"tokens and steps are counted: {c}"
    assert c["batched_seqs"] >= c["steps"], "a step runs at least one sequence"
    assert 0.0 < c["adapter_pool_fragmentation"] < 1.0, f"ranks below max_lora_rank pad their slots: {c}"


def test_metrics_bounds_are_config_fields_with_env_overrides(monkeypatch):
    assert ServeConfig().metrics.metrics_max_adapter_labels == 50, "the default adapter label bound is 50"
    monkeypatch.setenv("LORA_CLUSTER_METRICS_MAX_ADAPTER_LABELS", "7")
    labels = ServeConfig().metrics.metrics_max_adapter_labels
    assert labels == 7, "LORA_CLUSTER_METRICS_MAX_ADAPTER_LABELS sets it"


def test_autoscaling_config_replaces_num_replicas():
    from lora_cluster.serve.app import replica_options

    fixed = replica_options(ServeConfig(num_replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed, "no autoscaling: a fixed count"
    scaled = replica_options(ServeConfig(autoscaling_config={"min_replicas": 1, "max_replicas": 4,
                                                             "target_ongoing_requests": 8}))
    assert "num_replicas" not in scaled, "autoscaling replaces num_replicas"
    assert scaled["autoscaling_config"]["max_replicas"] == 4, "Ray Serve gets the autoscaling_config"
    with pytest.raises(ConfigError, match="autoscaling_config"):
        replica_options(ServeConfig(autoscaling_config={"min_replicas": 5, "max_replicas": 2}))

"""SLA classes: their configuration, how a request's class is resolved, and the replica's per-class stats
(`lora_cluster.cluster.class_stats` and the replica's `tracked`, driven by a fake clock). No Ray cluster,
no HTTP: the HTTP side is in test_serve_app.py, a real replica in test_serve_e2e.py."""

from __future__ import annotations

import json

import pytest
from helpers import FakeClock

from lora_cluster.cluster.class_stats import ClassStats, percentile
from lora_cluster.cluster.sla import SlaClass, SlaClasses, build_sla_classes
from lora_cluster.config import ServeConfig, build_config
from lora_cluster.errors import ConfigError, RequestError


def classes_config(*classes: dict, default: str | None = None) -> dict:
    config: dict = {"model": "m", "sla_classes": list(classes)}
    if default is not None:
        config["default_priority_class"] = default
    return config


# ----- configuration -----------------------------------------------------------------------------


def test_the_default_config_has_the_three_default_classes():
    sla = build_sla_classes(ServeConfig(model="m"))
    assert sla.names == ("interactive", "standard", "batch"), (
        "interactive, standard and batch, most urgent first")
    assert sla.get("interactive") == SlaClass("interactive", 0, ttft_s=1.0, tpot_s=0.2), (
        "interactive: priority 0, 1 s to the first token, 0.2 s per token")
    assert sla.get("standard") == SlaClass("standard", 1, ttft_s=5.0, tpot_s=0.5), (
        "standard: priority 1, 5 s to the first token, 0.5 s per token")
    assert sla.get("batch") == SlaClass("batch", 2), "batch: priority 2, no targets"
    assert sla.default.name == "standard", "a request that names no class is standard"


def test_classes_and_the_default_class_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_SLA_CLASSES", json.dumps([
        {"name": "gold", "priority": 0, "ttft_s": 0.5}, {"name": "bronze", "priority": 5}]))
    monkeypatch.setenv("LORA_CLUSTER_DEFAULT_PRIORITY_CLASS", "bronze")
    sla = build_sla_classes(build_config(ServeConfig, model="m"))
    assert sla.names == ("gold", "bronze"), "LORA_CLUSTER_SLA_CLASSES is a JSON list of classes"
    assert sla.get("gold").ttft_s == 0.5, "a class's targets come from the JSON"
    assert sla.get("gold").tpot_s is None, "a target left out is no target"
    assert sla.default.name == "bronze", "LORA_CLUSTER_DEFAULT_PRIORITY_CLASS picks the default class"


@pytest.mark.parametrize(("config", "problem"), [
    (classes_config({"name": "a", "priority": 0}, {"name": "a", "priority": 1}, default="a"),
     "names must be unique; repeated: a"),
    (classes_config({"name": "a", "priority": 0}, default="b"), "default_priority_class='b' is not one of"),
    (classes_config(default="a"), "between 1 and 16 classes, got 0"),
    (classes_config(*({"name": f"c{i}", "priority": i} for i in range(17)), default="c0"),
     "between 1 and 16 classes, got 17"),
    (classes_config({"name": "a b", "priority": 0}, default="a b"), "sla_classes.0.name"),
    (classes_config({"name": "a", "priority": 0, "ttft_s": 0}, default="a"), "sla_classes.0.ttft_s"),
])
def test_invalid_class_configurations_are_config_errors_naming_the_problem(config, problem):
    with pytest.raises(ConfigError) as raised:
        build_config(ServeConfig, **config)
    assert problem in str(raised.value), f"the ConfigError names the problem: {raised.value}"


# ----- resolution: header name, else vLLM's integer priority, else the default --------------------------


def test_a_name_wins_over_a_priority_and_a_priority_over_the_default():
    sla = build_sla_classes(ServeConfig(model="m"))
    assert sla.resolve(name="batch", priority=0).name == "batch", "a named class wins over a priority"
    assert sla.resolve(priority=0).name == "interactive", "priority 0 is the class with priority 0"
    assert sla.resolve().name == "standard", "without name or priority, the default class"


def test_a_priority_between_classes_picks_the_next_less_urgent_class():
    sla = SlaClasses([SlaClass("fast", 0), SlaClass("slow", 10)], default="slow")
    assert sla.resolve(priority=-5).name == "fast", (
        "a priority more urgent than every class is the most urgent class")
    assert sla.resolve(priority=3).name == "slow", "a priority between two classes is the less urgent one"
    assert sla.resolve(priority=99).name == "slow", "a priority beyond every class is the least urgent"


def test_an_unknown_name_is_a_request_error_naming_the_known_classes():
    sla = build_sla_classes(ServeConfig(model="m"))
    with pytest.raises(RequestError) as raised:
        sla.resolve(name="urgent")
    assert "interactive, standard, batch" in str(raised.value), f"the error names the classes: {raised.value}"


# ----- per-class stats --------------------------------------------------------------------------------

SLA = SlaClasses([SlaClass("fast", 0, ttft_s=1.0, tpot_s=0.1), SlaClass("bulk", 1)], default="bulk")


def run_request(stats: ClassStats, clock: FakeClock, name: str, ttft_s: float, tokens: int,
                per_token_s: float) -> None:
    """A request that gets its first token after ttft_s and then one token every per_token_s."""
    tracker = stats.start(name)
    clock.advance(ttft_s)
    tracker.first_token()
    clock.advance(per_token_s * (tokens - 1))
    tracker.finished(ttft_s, tokens)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0, "p50 of 1..100 is 50"
    assert percentile(values, 99) == 99.0, "p99 of 1..100 is 99"
    assert percentile([3.0], 99) == 3.0, "a single sample is every percentile"
    assert percentile([], 50) is None, "no sample, no percentile"


def test_a_class_without_samples_reports_none():
    snap = ClassStats(SLA, clock=FakeClock()).snapshot()
    assert list(snap) == ["fast", "bulk"], "every configured class is reported, most urgent first"
    assert snap["fast"] == {"running": 0, "waiting": 0, "finished": 0, "ttft_p50_s": None, "ttft_p99_s": None,
                            "tpot_p50_s": None, "tpot_p99_s": None, "slo_attainment": None}, (
        "a class without requests has zero counts and None statistics")


def test_requests_are_waiting_until_their_first_token_then_running_until_they_end():
    clock = FakeClock()
    stats = ClassStats(SLA, clock=clock)
    first, second = stats.start("fast"), stats.start("fast")
    assert stats.snapshot()["fast"]["waiting"] == 2, "accepted requests without a token are waiting"
    first.first_token()
    snap = stats.snapshot()["fast"]
    assert (snap["running"], snap["waiting"]) == (1, 1), "a request with its first token is running"
    first.finished(0.5, 3)
    second.cancelled()
    snap = stats.snapshot()["fast"]
    assert (snap["running"], snap["waiting"]) == (0, 0), "ended requests are neither running nor waiting"
    assert snap["finished"] == 1, "a cancelled request is not counted as finished"
    assert stats.snapshot()["bulk"]["finished"] == 0, "requests are counted in their own class only"


def test_running_requests_are_counted_by_priority():
    stats = ClassStats(SLA, clock=FakeClock())
    for name in ("fast", "bulk", "bulk"):
        stats.start(name).first_token()
    stats.start("fast")  # waiting: not running
    assert stats.running_by_priority() == {0: 1, 1: 2}, "running requests per class priority"


def test_latencies_and_slo_attainment_of_finished_requests():
    clock = FakeClock()
    stats = ClassStats(SLA, clock=clock)
    for _ in range(8):
        run_request(stats, clock, "fast", ttft_s=0.2, tokens=11, per_token_s=0.05)  # meets both targets
    run_request(stats, clock, "fast", ttft_s=2.0, tokens=11, per_token_s=0.05)  # misses the TTFT target
    run_request(stats, clock, "fast", ttft_s=0.2, tokens=11, per_token_s=0.5)  # misses the TPOT target
    snap = stats.snapshot()["fast"]
    assert snap["finished"] == 10, "ten requests finished"
    assert snap["ttft_p50_s"] == pytest.approx(0.2), "TTFT p50 is the typical request's"
    assert snap["ttft_p99_s"] == pytest.approx(2.0), "TTFT p99 is the slow request's"
    assert snap["tpot_p50_s"] == pytest.approx(0.05), "TPOT is the time from first to last token per token"
    assert snap["tpot_p99_s"] == pytest.approx(0.5), "TPOT p99 is the slow decoder's"
    assert snap["slo_attainment"] == pytest.approx(0.8), "eight of ten met both targets"


def test_a_single_token_request_has_no_tpot_and_a_class_without_targets_always_meets_them():
    clock = FakeClock()
    stats = ClassStats(SLA, clock=clock)
    run_request(stats, clock, "bulk", ttft_s=30.0, tokens=1, per_token_s=0.0)
    snap = stats.snapshot()["bulk"]
    assert snap["tpot_p50_s"] is None, "one token: no time per output token after the first"
    assert snap["slo_attainment"] == 1.0, "a class without targets meets them however slow"


def test_an_error_counts_as_a_finished_request_that_missed_its_targets():
    clock = FakeClock()
    stats = ClassStats(SLA, clock=clock)
    run_request(stats, clock, "fast", ttft_s=0.1, tokens=2, per_token_s=0.01)
    failed = stats.start("fast")
    failed.first_token()
    failed.failed()
    failed.finished(0.1, 2)
    snap = stats.snapshot()["fast"]
    assert snap["finished"] == 2, "a failed request counts as finished, once"
    assert snap["slo_attainment"] == 0.5, "a failed request did not meet its targets"
    assert snap["running"] == 0, "a failed request is no longer running"
    assert snap["ttft_p50_s"] == pytest.approx(0.1), "a failed request adds no latency sample"


def test_samples_leave_the_window_by_age_and_by_count():
    clock = FakeClock()
    stats = ClassStats(SLA, window_s=60.0, max_samples=3, clock=clock)
    run_request(stats, clock, "fast", ttft_s=5.0, tokens=2, per_token_s=0.01)
    clock.advance(61.0)
    assert stats.snapshot()["fast"]["finished"] == 0, "a request that ended over window_s ago has left"
    for ttft in (0.1, 0.2, 0.3, 0.4):
        run_request(stats, clock, "fast", ttft_s=ttft, tokens=2, per_token_s=0.01)
    snap = stats.snapshot()["fast"]
    assert snap["finished"] == 3, "at most max_samples requests per class are kept"
    assert snap["ttft_p50_s"] == pytest.approx(0.3), "the oldest samples are the ones dropped"


def test_a_class_the_replica_does_not_know_is_not_counted():
    stats = ClassStats(SLA, clock=FakeClock())
    tracker = stats.start("platinum")
    tracker.first_token()
    tracker.finished(0.1, 3)
    assert set(stats.snapshot()) == {"fast", "bulk"}, "only configured classes are reported"
    assert sum(s["finished"] for s in stats.snapshot().values()) == 0, (
        "the unknown class's request is not counted")


async def test_the_replica_tracks_a_request_from_its_engine_outputs():
    from lora_cluster.engine import RequestOutput
    from lora_cluster.serve.replica.outputs import tracked

    clock = FakeClock()
    stats = ClassStats(SLA, clock=clock)

    def output(tokens: int, finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [7] * tokens, "", "", [7] if tokens else [], finished,
                             "length" if finished else None, time_to_first_token=0.25 if tokens else None)

    async def engine_outputs():
        yield output(0, False)  # prefill in progress: no token yet
        clock.advance(0.25)
        yield output(1, False)
        clock.advance(0.2)
        yield output(3, True)

    seen = []
    async for _out in tracked(engine_outputs(), stats.start("fast")):
        seen.append(stats.snapshot()["fast"])
    assert (seen[0]["waiting"], seen[0]["running"]) == (1, 0), "before its first token the request waits"
    assert (seen[1]["waiting"], seen[1]["running"]) == (0, 1), "with its first token the request runs"
    final = stats.snapshot()["fast"]
    assert final["finished"] == 1, "the final output finishes the request"
    assert final["ttft_p50_s"] == pytest.approx(0.25), "TTFT is the engine's time_to_first_token"
    assert final["tpot_p50_s"] == pytest.approx(0.1), "TPOT is first-to-last token time over the later tokens"


def test_a_class_waits_its_share_of_its_ttft_target_before_preempting_and_one_without_a_target_does_not():
    assert SlaClass("interactive", 0, ttft_s=1.0).preempt_after_s(0.25) == 0.25, "a quarter of a 1 s target"
    assert SlaClass("batch", 2).preempt_after_s(0.25) == 0.0, "no TTFT target: preempts at once"
    assert SlaClass("standard", 1, ttft_s=4.0).preempt_after_s(0.0) == 0.0, "patience 0: at once"

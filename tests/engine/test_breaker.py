"""The breaker state machine (lora_cluster.breaker) and the engine's adapter breakers, without Ray."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import FakeClock, greedy, wait_until

from lora_cluster.breaker import Breaker, BreakerState, BreakerThresholds, ErrorRatio, EventRate
from lora_cluster.config import EngineConfig
from lora_cluster.engine.adapters.guard import AdapterGuard
from lora_cluster.errors import ConfigError

SWITCH = BreakerThresholds(warn=3, trip=5, recover_below=2, recover_for_s=30, cooldown_s=5)
LATENCY = BreakerThresholds(warn=50, trip=100, recover_below=30, recover_samples=10, cooldown_s=5)


def test_levels_move_a_closed_breaker_between_closed_warn_and_open() -> None:
    b = Breaker("x", LATENCY, FakeClock())
    assert b.record(10) is BreakerState.CLOSED, "below warn: closed"
    assert b.record(60) is BreakerState.WARN, "warn <= level < trip: warn"
    assert b.allow(), "a warning breaker still lets calls through"
    assert b.record(20) is BreakerState.CLOSED, "back below warn: closed again"
    assert b.record(100) is BreakerState.OPEN, "level at trip: open"
    assert not b.allow(), "an open breaker refuses"
    assert b.trips == 1, "one trip counted"


def test_open_breaker_turns_half_open_after_the_cooldown_and_rearms_on_trip_levels() -> None:
    clock = FakeClock()
    b = Breaker("x", LATENCY, clock)
    b.record(150)
    clock.now += 4
    assert b.retry_after_s() == pytest.approx(1.0), "retry after = cool-down left"
    b.record(150)  # still failing while open: the cool-down starts again
    clock.now += 4
    assert b.state is BreakerState.OPEN, "a trip-level measurement while open re-arms the cool-down"
    clock.now += 1
    assert b.state is BreakerState.HALF_OPEN, "cool-down over: half-open"
    assert b.retry_after_s() == 0.0, "nothing to wait for once half-open"


def test_half_open_lets_one_probe_through_at_a_time() -> None:
    clock = FakeClock()
    b = Breaker("x", LATENCY, clock)
    b.record(150)
    clock.now += 5
    assert b.allow(), "the first probe passes"
    assert not b.allow(), "a second one waits while the first is out"
    b.release()
    assert b.allow(), "a released probe frees its place"


def test_latency_breaker_closes_after_ten_fast_probes_and_reopens_on_a_slow_one() -> None:
    clock = FakeClock()
    b = Breaker("x", LATENCY, clock)
    b.record(150)
    clock.now += 5
    for i in range(9):
        assert b.allow(), f"probe {i} passes"
        assert b.record(20) is BreakerState.HALF_OPEN, f"{i + 1} fast probes are not yet 10"
    assert b.allow(), "probe 10 passes"
    assert b.record(20) is BreakerState.CLOSED, "10 probes under 30 ms in a row close it"
    b.record(150)
    clock.now += 5
    b.allow()
    assert b.record(40) is BreakerState.OPEN, "a probe at or above recover_below opens it again"
    assert b.trips == 3, "every opening counts as a trip"


def test_a_breaker_that_reopens_at_its_trip_level_only_restarts_its_streak_below_it() -> None:
    clock = FakeClock()
    b = Breaker("x", dataclasses.replace(LATENCY, reopen_at=LATENCY.trip), clock)
    b.record(150)
    clock.now += 5
    for _ in range(5):
        b.allow()
        b.record(20)
    b.allow()
    assert b.record(60) is BreakerState.HALF_OPEN, "a probe between recover_below and trip does not reopen it"
    for i in range(9):
        b.allow()
        assert b.record(20) is BreakerState.HALF_OPEN, f"the streak started again: {i + 1} fast probes"
    b.allow()
    assert b.record(20) is BreakerState.CLOSED, "10 fast probes after the slow one close it"
    b.record(150)
    clock.now += 5
    b.allow()
    assert b.record(100) is BreakerState.OPEN, "a probe at the trip level opens it again"


def test_switch_rate_breaker_recovers_only_after_thirty_quiet_seconds() -> None:
    clock = FakeClock()
    b = Breaker("x", SWITCH, clock)
    b.record(5)
    clock.now += 5
    b.record(1.0)
    clock.now += 29
    assert b.record(0.0) is BreakerState.HALF_OPEN, "29 s below 2/s is not enough"
    clock.now += 1
    assert b.record(0.0) is BreakerState.CLOSED, "30 s below 2/s closes it"


def test_switch_rate_breaker_reopens_when_the_rate_reaches_the_recovery_bound() -> None:
    clock = FakeClock()
    b = Breaker("x", SWITCH, clock)
    b.record(6)
    clock.now += 5
    b.record(1.0)
    clock.now += 20
    assert b.record(2.0) is BreakerState.OPEN, "2/s is not below 2/s: the probe fails"


def test_thresholds_are_checked() -> None:
    with pytest.raises(ConfigError, match="warn"):
        BreakerThresholds(warn=5, trip=3, recover_below=1)
    with pytest.raises(ConfigError, match="recover_below"):
        BreakerThresholds(warn=1, trip=3, recover_below=4)


def test_event_rate_counts_events_in_its_window_only() -> None:
    clock = FakeClock()
    rate = EventRate(1.0, clock)
    for _ in range(4):
        rate.add()
    assert rate.rate() == 4.0, "4 events within 1 s: 4/s"
    clock.now += 1.0
    assert rate.rate() == 0.0, "events older than the window are forgotten"


def test_error_ratio_is_errors_among_the_last_outcomes() -> None:
    ratio = ErrorRatio(100)
    assert ratio.add(True) == 0.01, "one error among (up to) 100 outcomes: 1%"
    for _ in range(99):
        ratio.add(False)
    assert ratio.ratio() == 0.01, "the error is still among the last 100"
    assert ratio.add(False) == 0.0, "101 outcomes later the error has left the window"
    ratio.add(True)
    ratio.reset()
    assert ratio.ratio() == 0.0, "reset forgets every outcome"


def _guard(clock: FakeClock, **overrides: object) -> AdapterGuard:
    config = EngineConfig(model="unused", **overrides)  # type: ignore[arg-type]
    return AdapterGuard(config, clock)


def test_switch_rate_alert_warns_at_three_and_opens_at_five_per_second() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    for _ in range(3):
        guard.placed(0.001, evicted=True)
    assert guard.alerting()["adapter_switch_rate"] is BreakerState.WARN, "3 switches within 1 s: warning"
    guard.placed(0.001, evicted=False)
    assert guard.alerting()["adapter_switch_rate"] is BreakerState.WARN, "filling an empty slot is no switch"
    for _ in range(2):
        guard.placed(0.001, evicted=True)
    assert guard.alerting()["adapter_switch_rate"] is BreakerState.OPEN, "5 switches within 1 s: critical"
    assert guard.snapshot()["adapter_switch_rate"]["state"] == "open", "the snapshot shows the alert"
    assert guard.snapshot()["adapter_switch_rate"]["trips"] == 1, "the alert counts one trip"


def test_switch_rate_alert_clears_after_the_quiet_period() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    for _ in range(5):
        guard.placed(0.001, evicted=True)
    clock.now += 5
    assert guard.alerting()["adapter_switch_rate"] is BreakerState.HALF_OPEN, "cool-down over: recovering"
    clock.now += 30
    assert guard.alerting()["adapter_switch_rate"] is BreakerState.CLOSED, "30 s under 2/s clears it"


def test_load_latency_alert_warns_at_fifty_and_opens_at_a_hundred_ms() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    guard.placed(0.049, evicted=False)
    assert guard.alerting()["adapter_load_latency"] is BreakerState.CLOSED, "49 ms: no alert"
    guard.placed(0.050, evicted=False)
    assert guard.alerting()["adapter_load_latency"] is BreakerState.WARN, "50 ms: warning"
    guard.placed(0.100, evicted=False)
    assert guard.alerting()["adapter_load_latency"] is BreakerState.OPEN, "100 ms: critical"
    clock.now += 5
    for _ in range(10):
        guard.placed(0.010, evicted=False)
    assert guard.alerting()["adapter_load_latency"] is BreakerState.CLOSED, "10 loads under 30 ms clear it"


def test_alerts_log_every_state_change(caplog: pytest.LogCaptureFixture) -> None:
    guard = _guard(FakeClock())
    with caplog.at_level("WARNING", logger="lora_cluster.engine.adapters.guard"):
        guard.placed(0.120, evicted=False)
    messages = [r.getMessage() for r in caplog.records]
    assert any("adapter_load_latency" in m and "open" in m for m in messages), "the alert's opening is logged"


def test_thrash_is_judged_by_the_measured_cost_of_switches() -> None:
    clock = FakeClock()
    guard = _guard(clock)  # 2 loader workers: thrash at 0.5 * 2 / load time switches per second
    for _ in range(20):
        guard.stepped(0.05)
    guard.placed(0.001, evicted=False, fetch_s=0.199)
    assert guard.thrash.switch_budget_per_s() == pytest.approx(5.0), "200 ms loads: thrash from 5 switches/s"
    assert guard.miss_penalty() == 0.0, "one load into an empty slot is no thrash"
    for _ in range(50):  # 5 switches/s over the 10 s window
        guard.placed(0.001, evicted=True, fetch_s=0.199)
    assert guard.miss_penalty() == 1.0, "switches that take half the loaders' time: misses better elsewhere"
    clock.now += 11
    assert guard.miss_penalty() == 0.0, "the window passed: no thrash"


def test_fast_switches_are_no_thrash_although_the_switch_rate_alert_fires() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    for _ in range(20):
        guard.stepped(0.05)
    for _ in range(60):  # 6 switches/s of 1 ms loads
        guard.placed(0.0005, evicted=True, fetch_s=0.0005)
        clock.now += 0.1
    assert guard.alerting()["adapter_switch_rate"] is not BreakerState.CLOSED, "the seed 001 alert fires"
    assert guard.miss_penalty() == 0.0, "1 ms switches cost the replica almost nothing: no miss penalty"


def test_breakers_off_turns_alerts_and_thrash_off() -> None:
    guard = _guard(FakeClock(), breakers=False)
    for _ in range(20):
        guard.placed(1.0, evicted=True, fetch_s=1.0)
    assert guard.alerting() == {"adapter_switch_rate": BreakerState.CLOSED,
                                "adapter_load_latency": BreakerState.CLOSED}, "breakers: false: no alert"
    assert guard.miss_penalty() == 0.0, "and no miss penalty"


# ----- the adapter alerts in a real engine (tiny demo model, CPU) -----------------------------------

PROMPT = "the quick brown fox"


def _run_until(engine, request_id: str, bound_s: float = 20.0) -> list:
    """Step the engine until `request_id` finishes; every output seen on the way."""
    seen: list = []

    def finished() -> bool:
        outs = engine.step()
        seen.extend(outs)
        return any(o.request_id == request_id and o.finished for o in outs)

    wait_until(finished, bound_s, f"{request_id} to finish", interval_s=0)
    return seen


def _engine(make_engine, **breakers: object):
    return make_engine(max_loras=2, max_lora_rank=32, breaker_cooldown_s=3.0, **breakers)


def test_engine_switch_rate_alert_fires_while_cold_adapters_keep_being_placed(make_engine) -> None:
    engine = _engine(make_engine, breaker_switch_warn_per_s=1, breaker_switch_trip_per_s=1,
                     breaker_switch_recover_per_s=1, breaker_switch_recover_s=0.0)
    sp = greedy(4)
    engine.generate([PROMPT] * 3, adapter_ids=["a0", "a1", "a3"], sampling=sp)  # a3 evicts: 1 switch/s
    assert engine.stats().breakers["adapter_switch_rate"]["trips"] == 1, "1 switch/s reaches trip=1"
    engine.add_request("cold", PROMPT, "a4", sp)
    engine.add_request("hot", PROMPT, "a3", sp)
    seen = _run_until(engine, "cold", bound_s=2.9)  # within the cool-down
    assert any(o.request_id == "cold" and o.token_ids for o in seen), \
        "the cold adapter is placed at once although the switch-rate alert is open"
    assert engine.stats().breakers["adapter_switch_rate"]["trips"] >= 1, "the alert was reported open"
    assert "a4" in engine.stats().resident_adapters, "the cold adapter took a slot"
    engine.close()


def test_engine_load_latency_alert_fires_while_cold_loads_go_on(make_engine) -> None:
    tiny = 1e-6  # every placement is slower than this: the first one opens the alert
    engine = _engine(make_engine, breaker_load_warn_ms=tiny, breaker_load_trip_ms=tiny,
                     breaker_load_recover_ms=tiny)
    sp = greedy(4)
    engine.generate([PROMPT], adapter_ids=["a0"], sampling=sp)
    assert engine.stats().breakers["adapter_load_latency"]["state"] == "open", "a slow load opens the alert"
    engine.add_request("cold", PROMPT, "a1", sp)  # an empty slot is free: the cold load runs now
    seen = _run_until(engine, "cold", bound_s=2.9)  # within the cool-down
    assert any(o.request_id == "cold" and o.token_ids for o in seen), "the cold load did not wait"
    assert engine.stats().breakers["adapter_load_latency"]["state"] == "open", "the alert still reports it"
    snap = engine.counters_snapshot()
    assert snap["placements"] == 2, "both adapters were placed"
    engine.close()


# ----- the routing-error breaker and the source breaker's names ------------------------------------


def test_routing_guard_sheds_at_three_percent_and_closes_after_a_hundred_clean_probes() -> None:
    from lora_cluster.errors import RoutingUnavailableError
    from lora_cluster.serve.http_errors import describe
    from lora_cluster.serve.routing.routing_guard import RoutingGuard

    clock = FakeClock()
    guard = RoutingGuard(clock=clock)
    for i in range(50):
        guard.admit()
        guard.outcome(error=i in (10, 20))
    assert guard.breaker.state is BreakerState.WARN, "2 routing errors in the last 100 requests: warn"
    guard.admit()
    guard.outcome(error=True)
    with pytest.raises(RoutingUnavailableError) as shed:
        guard.admit()
    error = describe(shed.value)
    assert (error.status, error.code) == (503, "routing_unavailable"), f"shed as 503: {error}"
    assert error.retry_after_header() == {"retry-after": "5"}, "Retry-After: the cool-down left"
    clock.now += 5
    probes = 0
    while True:
        try:
            guard.admit()
        except RoutingUnavailableError:
            break
        probes += 1
    assert probes == 4, "half-open: 4 probe requests at a time"
    for _ in range(100):
        guard.outcome(error=False)
        guard.admit()
    assert guard.breaker.state is BreakerState.CLOSED, "100 requests without a routing error close it"


def test_routing_errors_are_the_replicas_failures_not_the_requests() -> None:
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    from lora_cluster.errors import AdapterNotFoundError
    from lora_cluster.serve.http_errors import NoReplicaError
    from lora_cluster.serve.routing.routing_guard import is_routing_error

    assert is_routing_error(ActorDiedError()), "a dead replica is a routing error"
    assert is_routing_error(NoReplicaError("none")), "no replica is a routing error"
    assert not is_routing_error(BackPressureError(num_queued_requests=1, max_queued_requests=1)), \
        "overload is not a routing error"
    assert not is_routing_error(AdapterNotFoundError("x", "missing")), "a request's own error is not"


def test_source_names_in_errors_keep_only_scheme_and_bucket_or_repository() -> None:
    from lora_cluster.store.source_breaker import public_name

    assert public_name("s3://bucket/some/prefix") == "s3://bucket", "S3: the bucket only"
    assert public_name("hf://org/name@rev/sub") == "hf://org/name", "hub: the repository only"

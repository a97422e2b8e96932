"""Prefetch by predicted demand (`cluster.prefetch_plan`): ranking, a shift in popularity, and the bounds."""

from __future__ import annotations

import pytest

from lora_cluster.cluster.prefetch_plan import PrefetchPlanner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CATALOG = [f"a{i}" for i in range(10)]
SIZES = dict.fromkeys(CATALOG, 100)


def planner(clock: Clock, *, bytes_per_s: float = 1e9, max_bytes: int = 10**9) -> PrefetchPlanner:
    return PrefetchPlanner(CATALOG, SIZES, bytes_per_s=bytes_per_s, max_bytes=max_bytes, clock=clock,
                           half_life_s=10.0)


def test_before_any_request_the_plan_walks_the_catalog() -> None:
    p = planner(Clock())
    assert p.plan(3, skip=lambda a: False, used_bytes=0) == ["a0", "a1", "a2"], "catalog order at start"


def test_demanded_adapters_come_first_and_held_ones_are_skipped() -> None:
    p = planner(Clock())
    p.observe({"a7": 5, "a3": 2, "unknown": 99})
    assert p.ranking()[:2] == ["a7", "a3"], "most demanded first"
    assert "unknown" not in p.demand, "an id outside the catalog is not tracked (bounded by the catalog)"
    assert p.plan(2, skip=lambda a: a == "a7", used_bytes=0) == ["a3", "a0"], "held adapters are skipped"


def test_a_shift_in_popularity_moves_the_ranking() -> None:
    clock = Clock()
    p = planner(clock)
    p.observe({"a1": 10})
    clock.now = 60.0  # six half-lives later
    p.observe({"a2": 1})
    assert p.ranking()[0] == "a2", "recent demand outweighs old demand decayed by its half-life"


def test_bandwidth_bound() -> None:
    clock = Clock()
    p = planner(clock, bytes_per_s=250)
    first = p.plan(10, skip=lambda a: False, used_bytes=0)
    assert len(first) == 3, "one second's worth of burst, the last job taking the bucket into debt"
    assert p.plan(10, skip=lambda a: False, used_bytes=0) == [], "nothing more while in debt"
    clock.now = 10.0
    handed = len(p.plan(10, skip=lambda a: a in first, used_bytes=0))
    assert handed == 3, "the bucket refills at bytes_per_s, up to one second's worth"
    assert p.handed_out_bytes <= 250 * (clock.now + 1) + 100, "over any window: rate x window + burst + one"


def test_byte_bound_and_live_loads_come_first() -> None:
    p = planner(Clock(), max_bytes=350)
    assert len(p.plan(10, skip=lambda a: False, used_bytes=100)) == 2, "never past max_bytes (never evicts)"
    assert p.plan(10, skip=lambda a: False, used_bytes=0, live_waiting=True) == [], \
        "nothing is handed out while a live load waits"


def test_invalid_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bytes_per_s"):
        planner(Clock(), bytes_per_s=0)


def test_a_demand_set_from_outside_replaces_the_ranking_and_is_bounded() -> None:
    from lora_cluster.cluster.prefetch_plan import MAX_DEMAND

    p = PrefetchPlanner((), {}, bytes_per_s=1e9, max_bytes=10**9, clock=Clock())
    p.set_demand({"x": 5, "y": 50, "z": 0})
    assert p.ranking() == ["y", "x"], "busiest first, without a catalog; a zero rate is no demand"
    p.set_demand({f"h{i}": i + 1 for i in range(MAX_DEMAND + 50)})
    assert len(p.ranking()) == MAX_DEMAND, "at most MAX_DEMAND adapters are kept"
    assert p.ranking()[0] == f"h{MAX_DEMAND + 49}", "the busiest are the ones kept"


def test_settle_charges_the_bytes_really_read() -> None:
    clock = Clock()
    p = PrefetchPlanner((), {"x": 0}, bytes_per_s=100.0, max_bytes=10**9, clock=clock)
    p.set_demand({"x": 1, "y": 1})
    assert p.plan(1, skip=lambda a: False, used_bytes=0) == ["x"], "x handed out at an estimate of 0 bytes"
    p.settle("x", 0, 300)
    assert p.handed_out_bytes == 300, "the real bytes count as handed out"
    clock.now = 1.0
    assert p.plan(1, skip=lambda a: a == "x", used_bytes=0) == [], "the bucket is in debt for x's real bytes"

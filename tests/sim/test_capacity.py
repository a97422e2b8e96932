"""Capacity at SLO (`sim.capacity`): the targets a run is judged by, and the bisection that finds the
largest load meeting them."""

from __future__ import annotations

import pytest

from lora_cluster.sim.capacity import Probe, SloTargets, find_capacity


def _classes(interactive: float = 1.0, standard: float = 1.0, batch_done: int = 100,
             batch_wait: float | None = 5.0) -> dict[str, dict[str, object]]:
    return {"interactive": {"slo_attainment": interactive, "offered": 100},
            "standard": {"slo_attainment": standard, "offered": 100},
            "batch": {"slo_attainment": 1.0, "offered": 100, "completed": batch_done,
                      "ttft_p99_s": batch_wait}}


def test_a_run_meeting_every_target_misses_nothing() -> None:
    assert SloTargets().misses(_classes()) == [], "every class within target"


@pytest.mark.parametrize(("classes", "missed"), [
    (_classes(interactive=0.985), "interactive 98.5% < 99%"),
    (_classes(standard=0.94), "standard 94.0% < 95%"),
    (_classes(batch_done=98), "batch completed 98.0% < 99%"),
    (_classes(batch_wait=61.0), "batch p99 wait 61.0 s > 60 s"),
    (_classes(batch_wait=None), "batch p99 wait - s > 60 s"),
])
def test_each_target_is_named_when_missed(classes: dict[str, dict[str, object]], missed: str) -> None:
    assert SloTargets().misses(classes) == [missed], f"the miss reads {missed!r}"


def _threshold(capacity: float, seen: list[float]):  # type: ignore[no-untyped-def]
    def probe(load: float) -> Probe:
        seen.append(load)
        return Probe(load, () if load <= capacity else ("over",))
    return probe


@pytest.mark.parametrize("true_capacity", [0.03, 0.42, 0.93, 1.0, 1.37, 3.3])
def test_the_search_lands_within_the_resolution_below_the_true_capacity(true_capacity: float) -> None:
    seen: list[float] = []
    found = find_capacity(_threshold(true_capacity, seen), resolution=0.05)
    assert found.load <= true_capacity, f"{found.load} never above the true {true_capacity}"
    assert true_capacity - found.load <= 0.05, f"{found.load} within 0.05 of {true_capacity}"
    assert len(seen) <= 10, f"{len(seen)} runs: a bisection, not a scan"


def test_a_policy_that_never_meets_the_targets_has_no_capacity() -> None:
    found = find_capacity(lambda load: Probe(load, ("always",)))
    assert found.load == 0.0, "nothing met: capacity 0"
    assert not found.capped, "not capped"


def test_a_policy_meeting_the_targets_at_the_ceiling_is_reported_as_capped() -> None:
    found = find_capacity(lambda load: Probe(load, ()), ceiling=4.0)
    assert (found.load, found.capped) == (4.0, True), "capacity at least the ceiling"


def test_a_bad_resolution_is_an_error() -> None:
    with pytest.raises(ValueError, match="resolution"):
        find_capacity(lambda load: Probe(load, ()), resolution=0)

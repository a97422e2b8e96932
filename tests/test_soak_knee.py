"""load_tests/soak.py's knee search: a step holds only when every answer is a 200, the p99 is within
its bound, and latency did not trend up over the step. A short step at a rate just past the
server's sustained rate stays under the p99 bound while its backlog grows (docs/soak.md, seventh
run: a 30 s step at 44 req/s held, the same rate sustained reached a 21 s p99)."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def soak():
    yield from script_module("load_tests/soak.py", "soak_script")


def test_a_flat_step_within_the_bound_holds(soak) -> None:
    latencies = [0.10 + 0.02 * (k % 5) for k in range(300)]
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert ok, f"flat latencies, all 200, p99 140 ms: the step holds ({why})"


def test_a_growing_backlog_under_the_p99_bound_is_past_the_knee(soak) -> None:
    latencies = [0.10 + 0.004 * k for k in range(300)]  # 0.1 s -> 1.3 s: a backlog builds
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert not ok, "latency that climbs steadily over the step is a backlog, though p99 < 2 s"
    assert "grew" in why, f"the verdict says the latency grew: {why!r}"


def test_a_p99_above_the_bound_is_past_the_knee(soak) -> None:
    latencies = [0.1] * 290 + [3.0] * 10
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert not ok and "p99" in why, f"a 3 s tail is above the 2 s bound: {why!r}"


def test_a_step_with_an_answer_other_than_200_is_past_the_knee(soak) -> None:
    ok, why = soak.step_verdict(300, Counter({"200": 299, "skipped": 1}), [0.1] * 299, 2.0, 1.5)
    assert not ok and "200" in why, f"a skipped request fails the step: {why!r}"

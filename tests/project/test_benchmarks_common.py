"""benchmarks/common.py, the benchmarks' shared scaffolding: a report names every setting a benchmark
changes from the shipped defaults with its reason (and cannot leave one out), the percentile rules
keep each report's figures, and the report header says where and at which commit it was measured."""

from __future__ import annotations

import math
import statistics

import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def common():
    yield from script_module("benchmarks/common.py", "bench_common")


def test_a_changed_setting_is_reported_with_its_reason(common) -> None:
    changed = common.changed_settings({"max_loras": 4, "max_num_seqs": 32}, {"max_loras": "one adapter"})
    assert changed == {"max_loras 4": "one adapter"}, "only the setting that differs from the default"


def test_a_changed_setting_without_a_reason_is_refused(common) -> None:
    with pytest.raises(ValueError, match="max_loras"):
        common.changed_settings({"max_loras": 4}, {})


def test_an_unknown_setting_is_refused(common) -> None:
    with pytest.raises(ValueError, match="max_lora_slots"):
        common.changed_settings({"max_lora_slots": 4}, {"max_lora_slots": "typo"})


def test_the_header_names_the_shipped_defaults_or_each_change(common) -> None:
    default = common.header("T", "python benchmarks/x.py", changed={})
    changed = common.header("T", "python benchmarks/x.py", changed={"max_loras 4": "one adapter"})
    assert default[0] == "# T", "the title is a heading"
    assert "- settings: the shipped defaults" in default, f"no change is said: {default}"
    assert "- settings: the shipped defaults except max_loras 4 (one adapter)" in changed, f"{changed}"
    assert any(line.startswith("- software: Python ") and "lora-cluster at " in line for line in default), (
        f"software and commit: {default}")


@pytest.mark.parametrize("n", [1, 2, 7, 10, 101])
def test_percentile_rules(common, n: int) -> None:
    values = [float((k * 37) % n) for k in range(n)]
    s = sorted(values)
    for q in (0.5, 0.9, 0.99):
        assert common.percentile(values, q) == s[min(n - 1, int(q * n))], "rank: the sample at int(q n)"
        assert common.percentile(values, q, "lower") == s[int(q * (n - 1))], "lower: at int(q (n - 1))"
        assert common.percentile(values, q, "nearest") == s[round(q * (n - 1))], "nearest: round(q (n - 1))"
    if n > 1:
        assert common.percentile(values, 0.99, "linear") == pytest.approx(
            statistics.quantiles(values, n=100, method="inclusive")[98]), "linear: as statistics, inclusive"


def test_percentile_of_nothing_is_nan(common) -> None:
    assert math.isnan(common.percentile([], 0.5)), "no samples, no figure"

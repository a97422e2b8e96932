"""The controller process's collector threshold: set for the young generation only, and restored
after a `with` block on every path out."""

from __future__ import annotations

import gc

import pytest

from lora_cluster.cluster.process_gc import set_young_threshold, young_threshold
from lora_cluster.config import ServeConfig


@pytest.fixture(autouse=True)
def thresholds_kept():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_setting_the_young_threshold_keeps_the_older_generations_and_returns_the_previous_ones():
    gc.set_threshold(700, 11, 12)
    previous = set_young_threshold(4321)
    assert previous == (700, 11, 12), "the thresholds before are returned"
    assert gc.get_threshold() == (4321, 11, 12), "only the youngest generation's threshold changes"


def test_a_with_block_runs_under_the_threshold_and_restores_the_previous_ones_even_on_an_error():
    gc.set_threshold(700, 10, 10)
    inside = []
    with pytest.raises(RuntimeError), young_threshold(9999):
        inside.append(gc.get_threshold())
        raise RuntimeError("stop")
    assert inside == [(9999, 10, 10)], "inside the block the young threshold is the one given"
    assert gc.get_threshold() == (700, 10, 10), "after it, the thresholds are as they were"


def test_the_shipped_threshold_lets_most_short_lived_containers_die_before_a_collection():
    shipped = ServeConfig().controller.controller_gc_threshold
    assert shipped >= 10 * 700, f"the shipped young threshold ({shipped}) is well above CPython's 700"

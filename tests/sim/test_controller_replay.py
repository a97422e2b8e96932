"""The controller decides by its inputs alone: a simulator run's controller calls, recorded and replayed
through fresh controllers on the recorded clock, get the recorded answers, with one controller and
with shards (`benchmarks/profile_controller_calls.py`, which measures the controller's CPU per input
kind this way and so compares two trees on the same inputs). A replay that decides otherwise stops."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT, script_module

CELL = ["--nodes", "8", "--adapters", "200", "--load", "2", "--warmup", "3", "--duration", "3"]


@pytest.fixture(scope="module")
def profiler():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        yield from script_module("benchmarks/profile_controller_calls.py", "profile_controller_calls")


@pytest.mark.parametrize("shards", [1, 2])
def test_a_recorded_run_replays_with_the_same_answers(profiler, tmp_path: Path, shards: int) -> None:
    kept = tmp_path / "calls.pkl"
    calls, controllers, _, _, _ = profiler.record([*CELL, "--controller-shards", str(shards)], kept)
    assert kept.exists(), "the recorded calls are kept in the file given"
    assert len(controllers) == shards, f"one controller per shard: {len(controllers)}"
    _, count, per_shard = profiler.replay(*profiler.record([], kept)[:3])
    assert count["park_many"] > 0, f"the replayed calls after the warm-up include parks: {dict(count)}"
    assert count["report"] > 0, f"... and reports: {dict(count)}"
    assert len(per_shard) == shards, f"CPU per shard: {per_shard}"
    assert len(calls) > sum(count.values()), "the warm-up's calls are replayed too, untimed"


def test_a_replay_that_decides_otherwise_stops(profiler, tmp_path: Path) -> None:
    calls, controllers, measure_from, _, _ = profiler.record(CELL, tmp_path / "calls.pkl")
    i = next(i for i, call in enumerate(calls) if call[2] == "report")
    when, shard, kind, method, args, answer = calls[i]
    calls[i] = (when, shard, kind, method, args, {**answer, "queue_depth": answer["queue_depth"] + 1})
    with pytest.raises(AssertionError, match="decided otherwise"):
        profiler.replay(calls, controllers, measure_from)

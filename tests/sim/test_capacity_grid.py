"""The capacity grid (`sim.capacity_grid`, `sim.capacity_table`): verdicts from synthetic searches, and
one small real grid through `python -m lora_cluster.sim.experiments capacity`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lora_cluster.sim import capacity_grid as cg
from lora_cluster.sim import capacity_table
from lora_cluster.sim.experiments import main as experiments

CELL = {"nodes": 8, "adapters": 200, "zipf": 1.0, "seed": 0}


def _runs(caps: dict[str, float], ours_hit: float = 0.90, psb: float = 0.93,
          oracle_hit: float = 0.905) -> dict[str, list[dict[str, Any]]]:
    probes = [{"load": 1.0, "misses": ["standard 90.0% < 95%"]}]
    searches = [{"cell": CELL, "policy": p, "capacity": c, "capped": False, "probes": probes}
                for p, c in caps.items()]
    ref = {"hit_rate": 0.95, "psb": psb, "static_ceiling": 0.96, "hit_rate_ceiling": 0.92}
    references = [{"cell": CELL, "policy": cg.OURS, "load": 0.81, **ref, "hit_rate_offered": ours_hit},
                  {"cell": CELL, "policy": cg.ORACLE, "load": 0.81, **ref, "hit_rate_offered": oracle_hit}]
    return {"searches": searches, "references": references}


def _verdict(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return cg.verdicts(runs)[cg.CapacityCell(**CELL)]


def test_a_cell_passes_near_the_oracle_far_above_the_baselines_and_near_the_bound() -> None:
    v = _verdict(_runs({cg.OURS: 0.9, cg.ORACLE: 0.92, "serve-multiplex": 0.3, "round-robin": 0.2}))
    assert v["passed"], f"every check holds: {v['checks']}"
    assert v["oracle_share"] == pytest.approx(0.9 / 0.92), "ours over the oracle's capacity"
    assert v["baseline_multiple"] == pytest.approx(3.0), "ours over the better baseline's"


@pytest.mark.parametrize(("runs", "check"), [
    (_runs({cg.OURS: 0.8, cg.ORACLE: 0.9, "serve-multiplex": 0.2}), "oracle_share"),
    (_runs({cg.OURS: 0.9, cg.ORACLE: 0.9, "serve-multiplex": 0.5}), "baselines"),
    (_runs({cg.OURS: 0.9, cg.ORACLE: 0.9}, ours_hit=0.85, oracle_hit=0.85), "psb"),
    (_runs({cg.OURS: 0.9, cg.ORACLE: 0.9}, oracle_hit=0.92), "oracle_hit"),
])
def test_each_check_fails_on_its_own(runs: dict[str, list[dict[str, Any]]], check: str) -> None:
    v = _verdict(runs)
    failed = [k for k, ok in v["checks"].items() if not ok]
    assert failed == [check], f"only {check} fails: {v['checks']}"


def test_a_baseline_that_never_meets_the_targets_is_beaten_by_any_capacity() -> None:
    v = _verdict(_runs({cg.OURS: 0.9, cg.ORACLE: 0.9, "serve-multiplex": 0.0}))
    assert v["checks"]["baselines"], "0 capacity against ours: infinitely many times"


def test_the_table_names_what_limits_ours_and_counts_the_passes() -> None:
    table = capacity_table.markdown(_runs({cg.OURS: 0.9, cg.ORACLE: 0.92, "serve-multiplex": 0.3,
                                           "round-robin": 0.2}))
    assert "standard 90.0% < 95% at 1.00x" in table, "the first miss above our capacity"
    assert "1 of 1 cells pass." in table, "the count of passing cells"


def test_the_capacity_command_runs_a_small_grid_and_saves_its_searches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "capacity.json"
    experiments(["capacity", "--sizes", "4x40", "--zipfs", "1.0", "--seeds", "0", "--duration", "10",
                 "--warmup", "2", "--policies", "lora-cluster,round-robin", "--workers", "1",
                 "--save", str(saved)])
    out = capsys.readouterr().out
    runs = json.loads(saved.read_text())
    caps = {s["policy"]: s["capacity"] for s in runs["searches"]}
    assert set(caps) == {"lora-cluster", "round-robin"}, "one search per policy asked for"
    assert all(c > 0 for c in caps.values()), f"both carry some load within SLO: {caps}"
    assert [r["policy"] for r in runs["references"]] == ["lora-cluster"], "ours rerun at 0.9x, no oracle"
    assert "| 4 x 40 | 1 | 0 |" in out, "the cell's row is printed"

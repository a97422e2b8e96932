"""The capacity grid: each policy's capacity at SLO per workload cell, against the oracle and the baselines.

A cell is one (nodes x adapters, Zipf exponent, seed). For every policy (ours, `lora-cluster`; the
`oracle` reference, which knows the true popularity; the baselines `serve-multiplex` and
`round-robin`) the grid finds the capacity at SLO (`sim.capacity`: the largest load, to 0.05x, at
which every class meets its target) with every setting at its default, then runs ours and the
oracle once more at 0.9x of our capacity to compare hit rates there (and `oracle-pinned`, ours with the
oracle's placement pinned, `sim.oracle_pinned`, when asked for: a second yardstick, in no check). A cell
passes when

* ours carries at least `ORACLE_SHARE_TARGET` (0.95) of the oracle's capacity;
* ours carries at least `BASELINE_MULTIPLE_TARGET` (3) times the better baseline's;
* at 0.9x of our capacity, our hit rate over offered requests is at least `PSB_SHARE_TARGET` (0.95)
  of the pinned-slot bound of our run's completed traffic (`sim.slot_bound`), and at most
  `ORACLE_GAP_TARGET` (1 point) below the oracle's at the same load.

Each (cell, policy) search runs in its own process (`workers` at a time); each run is seeded and
single-threaded, so the figures do not depend on the worker count.
"""

from __future__ import annotations

import concurrent.futures
import sys
from dataclasses import asdict, dataclass
from typing import Any

from lora_cluster.sim.capacity import Probe, SloTargets, find_capacity
from lora_cluster.sim.grid import Common
from lora_cluster.sim.simulation import run

SIZES = ((32, 1000), (24, 1500))
ZIPFS = (0.8, 1.0, 1.2)
SEEDS = (0, 1)
OURS, ORACLE = "lora-cluster", "oracle"
BASELINES = ("serve-multiplex", "round-robin")
POLICIES = (OURS, ORACLE, *BASELINES)
PINNED = "oracle-pinned"  # a second yardstick, run only when asked for (`sim.oracle_pinned`)
REFERENCED = (OURS, ORACLE, PINNED)  # the policies rerun at 0.9x of our capacity, those of them that ran
REFERENCE_LOAD = 0.9  # the hit rates are compared at this share of our capacity
ORACLE_SHARE_TARGET = 0.95
BASELINE_MULTIPLE_TARGET = 3.0
PSB_SHARE_TARGET = 0.95
ORACLE_GAP_TARGET = 0.01


@dataclass(frozen=True)
class CapacityCell:
    nodes: int
    adapters: int
    zipf: float
    seed: int

    def label(self) -> str:
        return f"{self.nodes}x{self.adapters} zipf {self.zipf:g} seed {self.seed}"


def cells(sizes: tuple[tuple[int, int], ...] = SIZES, zipfs: tuple[float, ...] = ZIPFS,
          seeds: tuple[int, ...] = SEEDS) -> list[CapacityCell]:
    return [CapacityCell(n, a, z, s) for n, a in sizes for z in zipfs for s in seeds]


def _run(cell: CapacityCell, policy: str, load: float, common: Common) -> dict[str, Any]:
    config = common.config(nodes=cell.nodes, adapters=cell.adapters, zipf=cell.zipf, load=load,
                           seed=cell.seed, policy=policy)
    result = run(config).to_json()
    keep = ("hit_rate", "hit_rate_offered", "psb", "static_ceiling", "hit_rate_ceiling", "completed",
            "rejected", "wall_s")
    return {**{k: result[k] for k in keep}, "classes": result["classes"]}


def search(cell: CapacityCell, policy: str, common: Common, targets: SloTargets) -> dict[str, Any]:
    """One policy's capacity at SLO on one cell, with every probe's figures."""

    def probe(load: float) -> Probe:
        figures = _run(cell, policy, load, common)
        return Probe(load, tuple(targets.misses(figures["classes"])), figures)

    found = find_capacity(probe)
    print(f"# {cell.label()} {policy}: capacity {found.load:.3f}x after {len(found.probes)} runs",
          file=sys.stderr, flush=True)
    return {"cell": asdict(cell), "policy": policy, "capacity": found.load, "capped": found.capped,
            "probes": [{"load": p.load, "misses": list(p.misses), **p.figures} for p in found.probes]}


def reference(cell: CapacityCell, policy: str, load: float, common: Common) -> dict[str, Any]:
    """One run at `load` (0.9x of our capacity), for the hit-rate comparison."""
    return {"cell": asdict(cell), "policy": policy, "load": load, **_run(cell, policy, load, common)}


def run_grid(grid: list[CapacityCell], common: Common, *, policies: tuple[str, ...] = POLICIES,
             targets: SloTargets | None = None, workers: int = 2) -> dict[str, list[dict[str, Any]]]:
    """Every policy's capacity on every cell, then ours and the yardsticks (`REFERENCED`) at 0.9x of ours:
    {"searches": [...], "references": [...]}."""
    targets = targets or SloTargets()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        jobs = [pool.submit(search, cell, policy, common, targets) for policy in policies for cell in grid]
        searches = [f.result() for f in jobs]
        ours = {CapacityCell(**s["cell"]): s["capacity"] for s in searches if s["policy"] == OURS}
        refs = [pool.submit(reference, cell, policy, round(REFERENCE_LOAD * load, 6), common)
                for cell, load in ours.items() if load > 0 for policy in REFERENCED if policy in policies]
        references = [f.result() for f in refs]
    return {"searches": searches, "references": references}


def verdicts(runs: dict[str, list[dict[str, Any]]]) -> dict[CapacityCell, dict[str, Any]]:
    """Per cell: each policy's capacity, the ratios, the hit rates at 0.9x, and the checks."""
    out: dict[CapacityCell, dict[str, Any]] = {}
    for s in runs["searches"]:
        cell = out.setdefault(CapacityCell(**s["cell"]), {"capacity": {}, "reference": {}})
        cell["capacity"][s["policy"]] = s["capacity"]
    for r in runs["references"]:
        out[CapacityCell(**r["cell"])]["reference"][r["policy"]] = r
    for v in out.values():
        cap, ref = v["capacity"], v["reference"]
        mine = cap.get(OURS, 0.0)
        best = max((cap[b] for b in BASELINES if b in cap), default=None)
        v["oracle_share"] = _ratio(mine, cap.get(ORACLE))
        v["baseline_multiple"] = _ratio(mine, best)
        at, oracle_at = ref.get(OURS), ref.get(ORACLE)
        v["psb_share"] = _ratio(at["hit_rate_offered"], at["psb"]) if at else None
        v["oracle_gap"] = (oracle_at["hit_rate_offered"] - at["hit_rate_offered"]
                           if at and oracle_at and at["hit_rate_offered"] is not None
                           and oracle_at["hit_rate_offered"] is not None else None)
        v["checks"] = {
            "oracle_share": _holds(v["oracle_share"], ORACLE_SHARE_TARGET, ran=ORACLE in cap),
            "baselines": _holds(v["baseline_multiple"], BASELINE_MULTIPLE_TARGET, ran=best is not None),
            "psb": _holds(v["psb_share"], PSB_SHARE_TARGET, ran=True),
            "oracle_hit": _holds(None if v["oracle_gap"] is None else -v["oracle_gap"], -ORACLE_GAP_TARGET,
                                 ran=ORACLE in cap),
        }
        v["passed"] = all(v["checks"].values())
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b; infinite when only b is 0, None when either is missing or both are 0."""
    if a is None or b is None or (a == 0 and b == 0):
        return None
    return a / b if b else float("inf")


def _holds(value: float | None, target: float, *, ran: bool) -> bool:
    """A check holds when its policy did not run (a partial grid); else its value must reach the target."""
    return not ran or (value is not None and value >= target)

"""The acceptance grid: the controller's policies against the baselines over many workloads, each cell
judged against the targets.

A cell is one (nodes x adapters, Zipf exponent, load, seed); every cell runs `lora-cluster` and both
baselines (`serve-multiplex`, `round-robin`) on the same requests. `lora-cluster` passes a cell when

* its `interactive` SLO attainment is at least `INTERACTIVE_TARGET` (99%);
* its hit rate is at least `CEILING_SHARE_TARGET` (97%) of the cell's ceiling, the share of the
  traffic that the cluster's adapter slots can hold (the `nodes x max_loras` most popular adapters);
* it is ahead of both baselines: a higher hit rate and an `interactive` attainment at least theirs;
* at load 1x (the rated load) and below, the p99 wait of its `batch` requests, from arrival to the
  first token, is at most `BATCH_WAIT_TARGET_S` (60 s).

The default grid is Zipf {0.8, 1.0, 1.2} x load {1, 1.5, 2} x seeds {0, 1} at 32 nodes x 1,000
adapters and 24 nodes x 1,500 (36 cells, 108 runs). Runs go to `workers` processes (each run is
single-threaded and independent: same results whatever the count).
"""

from __future__ import annotations

import concurrent.futures
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.simulation import SimConfig, run

SIZES = ((32, 1000), (24, 1500))
ZIPFS = (0.8, 1.0, 1.2)
LOADS = (1.0, 1.5, 2.0)
SEEDS = (0, 1)
POLICY = "lora-cluster"
BASELINES = ("serve-multiplex", "round-robin")
INTERACTIVE_TARGET = 0.99
CEILING_SHARE_TARGET = 0.97
BATCH_WAIT_TARGET_S = 60.0
BATCH_WAIT_MAX_LOAD = 1.0  # the batch wait target holds up to the rated load


@dataclass(frozen=True)
class Cell:
    nodes: int
    adapters: int
    zipf: float
    load: float
    seed: int

    def label(self) -> str:
        return f"{self.nodes}x{self.adapters} zipf {self.zipf:g} load {self.load:g}x seed {self.seed}"


@dataclass(frozen=True)
class Common:
    """What every run of the grid shares."""

    duration: float = 60.0
    warmup: float = 20.0
    profile: str = "gpu"
    preload: int | None = None  # adapters in every node's store at start (None: all of them)
    max_loras: int = 16
    serve: ServeSections = field(default_factory=ServeSections)

    def config(self, *, nodes: int, adapters: int, zipf: float, load: float, seed: int,
               policy: str) -> SimConfig:
        """One run of the grid: this cell and policy with what every run shares (`preload` None: every
        adapter in every node's store)."""
        return SimConfig(nodes=nodes, adapters=adapters, zipf=zipf, load=load, duration=self.duration,
                         warmup=self.warmup, seed=seed, max_loras=self.max_loras, policy=policy,
                         profile=self.profile, preload=adapters if self.preload is None else self.preload,
                         serve=self.serve)


def start_state(preload: int | None) -> str:
    """The start state a run's `preload` gives, as a table's header says it."""
    return ("every adapter preloaded in every node's store" if preload is None
            else f"the {preload} most popular adapters preloaded" if preload
            else "every adapter in S3 at start")


def cells(sizes: tuple[tuple[int, int], ...] = SIZES, zipfs: tuple[float, ...] = ZIPFS,
          loads: tuple[float, ...] = LOADS, seeds: tuple[int, ...] = SEEDS) -> list[Cell]:
    return [Cell(n, a, z, load, s) for n, a in sizes for z in zipfs for load in loads for s in seeds]


def run_one(cell: Cell, policy: str, common: Common) -> dict[str, Any]:
    """One policy on one cell: {cell, policy, result (the --json object), details (the figures the
    verdict and the table read)}."""
    config = common.config(nodes=cell.nodes, adapters=cell.adapters, zipf=cell.zipf, load=cell.load,
                           seed=cell.seed, policy=policy)
    result = run(config)
    keep = ("profile", "hit_rate_ceiling", "by_class", "rejections", "controller_cpu_s", "simulated_s")
    return {"cell": asdict(cell), "policy": policy, "preload": config.preload, "result": result.to_json(),
            "details": {k: result.details.get(k) for k in keep}}


def run_grid(grid: list[Cell], common: Common, *, policies: tuple[str, ...] = (POLICY, *BASELINES),
             workers: int = 2) -> list[dict[str, Any]]:
    """Every policy on every cell, `workers` runs at a time; progress on stderr."""
    jobs = [(cell, policy) for policy in policies for cell in grid]  # lora-cluster (the longest) first
    if workers <= 1:
        return [_progress(run_one(cell, policy, common)) for cell, policy in jobs]
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_one, cell, policy, common) for cell, policy in jobs]
        return [_progress(f.result()) for f in concurrent.futures.as_completed(futures)]


def _progress(run_: dict[str, Any]) -> dict[str, Any]:
    cell = Cell(**run_["cell"])
    print(f"# {cell.label()} {run_['policy']}: wall {run_['result']['wall_s']:.1f} s", file=sys.stderr,
          flush=True)
    return run_


def _interactive(run_: dict[str, Any]) -> float:
    return run_["result"]["classes"]["interactive"]["slo_attainment"] or 0.0


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The checks of one cell from its runs (`lora-cluster` and the baselines present among them)."""
    by_policy = {r["policy"]: r for r in runs}
    mine = by_policy[POLICY]
    cell = Cell(**mine["cell"])
    hit = mine["result"]["hit_rate"] or 0.0
    ceiling = mine["details"]["hit_rate_ceiling"]
    batch_wait = mine["result"]["classes"]["batch"]["ttft_p99_s"]
    baselines = [by_policy[b] for b in BASELINES if b in by_policy]
    checks = {
        "interactive": _interactive(mine) >= INTERACTIVE_TARGET,
        "hit_rate": hit >= CEILING_SHARE_TARGET * ceiling,
        "baselines": all(hit > (b["result"]["hit_rate"] or 0.0) and _interactive(mine) >= _interactive(b)
                         for b in baselines),
        "batch_wait": cell.load > BATCH_WAIT_MAX_LOAD or (batch_wait is not None
                                                          and batch_wait <= BATCH_WAIT_TARGET_S),
    }
    return {"cell": cell, "hit_rate": hit, "ceiling": ceiling, "batch_wait_p99_s": batch_wait,
            "checks": checks, "passed": all(checks.values())}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(runs: list[dict[str, Any]]) -> str:
    """One row per cell: lora-cluster's interactive attainment, hit rate against the ceiling, both
    baselines' hit rate and interactive attainment, standard attainment, batch p99 wait and completed
    share, and pass/fail (with the failed checks)."""
    grouped: dict[Cell, list[dict[str, Any]]] = {}
    for r in runs:
        grouped.setdefault(Cell(**r["cell"]), []).append(r)
    head = ("| nodes x adapters | zipf | load | seed | interactive | hit rate / ceiling (share) "
            "| serve-multiplex hit, interactive | round-robin hit, interactive | standard "
            "| batch p99 wait s, completed | pass |")
    lines = [head, "|" + "---|" * 11]
    order = sorted(grouped, key=lambda c: (-c.nodes, c.zipf, c.load, c.seed))
    passed = 0
    for cell in order:
        v = verdict(grouped[cell])
        by_policy = {r["policy"]: r for r in grouped[cell]}
        mine = by_policy[POLICY]
        base = [f"{_pct(by_policy[b]['result']['hit_rate'])}, {_pct(_interactive(by_policy[b]))}"
                if b in by_policy else "-" for b in BASELINES]
        batch = mine["details"]["by_class"]["batch"]
        done = batch["completed"] / batch["offered"] if batch["offered"] else None
        wait = "-" if v["batch_wait_p99_s"] is None else f"{v['batch_wait_p99_s']:.1f}"
        failed = [k for k, ok in v["checks"].items() if not ok]
        passed += v["passed"]
        lines.append(
            f"| {cell.nodes} x {cell.adapters} | {cell.zipf:g} | {cell.load:g}x | {cell.seed} "
            f"| {_pct(_interactive(mine))} | {_pct(v['hit_rate'])} / {_pct(v['ceiling'])} "
            f"({_pct(v['hit_rate'] / v['ceiling'] if v['ceiling'] else None)}) | {base[0]} | {base[1]} "
            f"| {_pct(mine['result']['classes']['standard']['slo_attainment'])} | {wait}, {_pct(done)} "
            f"| {'pass' if not failed else 'FAIL: ' + ', '.join(failed)} |")
    lines.append(f"\n{passed} of {len(order)} cells pass.")
    return "\n".join(lines)


def header(common: Common, runs: list[dict[str, Any]]) -> str:
    """What the table ran: profile, start state, duration and the targets."""
    profile = runs[0]["details"]["profile"] if runs else common.profile
    return (f"profile {profile} (--profile {common.profile}); {start_state(common.preload)}; "
            f"max_loras {common.max_loras}; {common.duration:g} s measured after {common.warmup:g} s "
            f"of warm-up; targets: interactive >= {100 * INTERACTIVE_TARGET:g}%, hit rate >= "
            f"{100 * CEILING_SHARE_TARGET:g}% of the ceiling, ahead of {' and '.join(BASELINES)} "
            f"(hit rate, interactive), batch p99 wait <= {BATCH_WAIT_TARGET_S:g} s at load <= "
            f"{BATCH_WAIT_MAX_LOAD:g}x")

"""The cold-start grid: every adapter only in S3 when the run begins, `interactive` attainment after the
first minute and including it, with the cluster tier and prefetch (`sim.cluster_store`) and without.

    python -m lora_cluster.sim.cold_start [--sizes 32x1000,24x1500 --zipfs 0.8,1,1.2 --loads 1,1.5 \
        --seed 0 --workers 2] [--save cold.json]

Each cell is 2 minutes of arrivals from a cold start (`preload` 0), run three times on the same
requests: measured from 60 s on (`warmup` 60, the cluster after its first minute), measured from
0 s (the first minute included), and measured from 0 s with the cluster tier off (each node loads
from S3 itself: the system before it). A cell passes when `interactive` is at least
`AFTER_TARGET` after the first minute and at least `INCLUDING_TARGET` with it. It exits 1 when a
cell fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any

from lora_cluster.sim.grid import SIZES, ZIPFS
from lora_cluster.sim.simulation import SimConfig, run

LOADS = (1.0, 1.5)
AFTER_TARGET, INCLUDING_TARGET = 0.99, 0.97
FIRST_S, RUN_S = 60.0, 120.0
WINDOWS = {"after": (FIRST_S, RUN_S - FIRST_S, True), "including": (0.0, RUN_S, True),
           "no_cluster_tier": (0.0, RUN_S, False)}


def run_cell(nodes: int, adapters: int, zipf: float, load: float, seed: int, window: str) -> dict[str, Any]:
    """One run of one cell, measured as `window` (a key of `WINDOWS`) says."""
    warmup, duration, cluster_tier = WINDOWS[window]
    result = run(SimConfig(nodes=nodes, adapters=adapters, zipf=zipf, load=load, seed=seed, warmup=warmup,
                           duration=duration, preload=0, cluster_tier=cluster_tier))
    return {"cell": [nodes, adapters, zipf, load, seed], "window": window,
            "interactive": result.classes["interactive"]["slo_attainment"],
            "standard": result.classes["standard"]["slo_attainment"], "hit_rate": result.hit_rate,
            "adapter_loads": result.adapter_loads, "cluster_tier": result.details.get("cluster_tier"),
            "wall_s": result.wall_s}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(runs: list[dict[str, Any]]) -> tuple[str, int]:
    """One row per cell, and the number of cells that fail."""
    cells: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault(tuple(r["cell"]), {})[r["window"]] = r
    lines = ["| nodes x adapters | zipf | load | interactive after 60 s | interactive incl. first 60 s "
             "| standard incl. | hit rate incl. | loads incl.: peer / S3 | without the cluster tier: "
             "interactive incl., S3 loads | pass |", "|" + "---|" * 10]
    failed = 0
    for key in sorted(cells, key=lambda k: (-k[0], k[2], k[3])):
        by = cells[key]
        after, incl, off = by["after"], by["including"], by["no_cluster_tier"]
        ok = (after["interactive"] or 0) >= AFTER_TARGET and (incl["interactive"] or 0) >= INCLUDING_TARGET
        failed += not ok
        lines.append(f"| {key[0]} x {key[1]} | {key[2]:g} | {key[3]:g}x | {_pct(after['interactive'])} "
                     f"| {_pct(incl['interactive'])} | {_pct(incl['standard'])} | {_pct(incl['hit_rate'])} "
                     f"| {incl['adapter_loads']['peer']} / {incl['adapter_loads']['s3']} "
                     f"| {_pct(off['interactive'])}, {off['adapter_loads']['s3']} "
                     f"| {'pass' if ok else 'FAIL'} |")
    lines.append(f"\n{len(cells) - failed} of {len(cells)} cells pass (interactive >= "
                 f"{100 * AFTER_TARGET:g}% after the first {FIRST_S:g} s, "
                 f">= {100 * INCLUDING_TARGET:g}% with it).")
    return "\n".join(lines), failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_cluster.sim.cold_start",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", default=",".join(f"{n}x{a}" for n, a in SIZES),
                    help="NODESxADAPTERS, comma-separated")
    ap.add_argument("--zipfs", default=",".join(f"{z:g}" for z in ZIPFS))
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="runs at a time, each in its own process")
    ap.add_argument("--save", help="JSON file of the runs")
    args = ap.parse_args(argv)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    jobs = [(n, a, float(z), float(load), args.seed, w) for n, a in sizes for z in args.zipfs.split(",")
            for load in args.loads.split(",") for w in WINDOWS]
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        runs = list(pool.map(run_cell, *zip(*jobs, strict=True)))
    if args.save:
        Path(args.save).write_text(json.dumps(runs, indent=1) + "\n")
    table, failed = markdown(runs)
    print("profile gpu-papers; every adapter in S3 at start (--preload 0); 120 s of arrivals, seed "
          f"{args.seed}; max_loras 16\n")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

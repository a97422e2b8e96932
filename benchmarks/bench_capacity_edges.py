"""Whether a policy change moved our capacity at SLO: each cell of a saved capacity search, run again at its
capacity and at the lowest failing load its search probed, in the simulator.

    python benchmarks/bench_capacity_edges.py SEARCH.json [SEARCH.json ...] [--policy lora-cluster]
        [--workers 2] [--out F]

A search (`experiments capacity`, `sim.capacity.find_capacity`) bisects between a load that meets every
class target and one that misses one; its answer is the highest passing load it probed. With the code
of today, the same cell at that load must still meet every target and the lowest failing load above it
must still miss one: then the bisection takes the same steps near the answer and the capacity stands
(the probes far above it miss by wide margins). Far cheaper than a search (2 runs a cell, not 6-7), it
shows where a change moved the capacity, not by how much: a cell marked moved needs its search run
again. Every run with the grid's settings (`sim.grid.Common`: GPU profile, every adapter preloaded, 60 s
measured after 20 s, every setting at its default), the same seed as the search; per run, the targets
missed and the hit rate over offered requests, then and now.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any

import common

from lora_cluster.sim.capacity import SloTargets
from lora_cluster.sim.grid import Common
from lora_cluster.sim.simulation import run


def edges(search: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(cell, probe) for the search's answer and its lowest failing load above it (none if capped)."""
    cap = search["capacity"]
    above = [p for p in search["probes"] if p["misses"] and p["load"] > cap]
    passed = [p for p in search["probes"] if p["load"] == cap]
    return [(search["cell"], p) for p in passed + sorted(above, key=lambda p: p["load"])[:1]]


def one(cell: dict[str, Any], probe: dict[str, Any], policy: str) -> dict[str, Any]:
    """The cell at the probe's load with today's code, beside the probe's figures."""
    out = run(Common().config(nodes=cell["nodes"], adapters=cell["adapters"], zipf=cell["zipf"],
                              load=probe["load"], seed=cell["seed"], policy=policy)).to_json()
    return {"cell": cell, "load": probe["load"], "then": probe["misses"],
            "then_hit": probe["hit_rate_offered"], "now": SloTargets().misses(out["classes"]),
            "now_hit": out["hit_rate_offered"]}


def markdown(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| cell | load | targets missed then | targets missed now | hit rate offered then / now "
             "| same |", "|" + "---|" * 6]
    for r in runs:
        c = r["cell"]
        same = bool(r["then"]) == bool(r["now"])
        lines.append(f"| {c['nodes']} x {c['adapters']}, Zipf {c['zipf']:g}, seed {c['seed']} "
                     f"| {r['load']:g}x | {'; '.join(r['then']) or 'none'} | {'; '.join(r['now']) or 'none'} "
                     f"| {100 * r['then_hit']:.1f}% / {100 * r['now_hit']:.1f}% "
                     f"| {'yes' if same else '**moved**'} |")
    moved = sum(bool(r["then"]) != bool(r["now"]) for r in runs)
    lines.append(f"\n{len(runs)} runs; {moved} where the verdict moved.")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("searches", nargs="+", type=Path,
                    help="capacity JSON files (`experiments capacity --save`)")
    ap.add_argument("--policy", default="lora-cluster")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    jobs = [edge for path in args.searches for s in json.loads(path.read_text())["searches"]
            if s["policy"] == args.policy for edge in edges(s)]
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        runs = list(pool.map(one, *zip(*jobs, strict=True), [args.policy] * len(jobs)))
    lines = common.header(f"Capacity edges of {args.policy}, then and now (simulator, GPU profile, "
                          "preloaded)",
                          "python benchmarks/bench_capacity_edges.py " + " ".join(argv or sys.argv[1:]),
                          level=2, changed={})
    common.emit("\n".join([*lines, "", *markdown(runs)]), args.out, title="bench_capacity_edges", doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

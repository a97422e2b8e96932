"""Benchmark of why requests miss their adapter, ours against the oracle, by popularity band, in the
simulator.

    python benchmarks/bench_miss_kinds.py [--workers 2] [--large] [--out docs/bench_miss_kinds.md]

The cells and loads of benchmarks/bench_slot_bands.py at 0.9x of our capacity (0.9x of the rated load
on the two cells never searched), with the grid's settings (GPU profile, every adapter preloaded, 60 s
measured after 20 s of warm-up, every setting at its default), `lora-cluster` and the `oracle`
yardstick on the same requests. Each miss of the measured period (a request that reached its
replica without its adapter in a device slot there) is classified by `sim.census.MissCensus`:
`cold` (the adapter was in no slot of the cluster and loading nowhere for a request), `copy` (another
replica held it: routing sent the request away from a copy) or `joined` (its load was under way at
that replica). Per band, each kind is given per 100 completed requests of the band, so the three add
up to the band's miss rate; routing can only turn copies into hits, cold misses need a policy that
keeps the adapter resident somewhere. `--large`: the 1,024 x 20,000 cell of docs/scale.md instead (Zipf
1.0, seed 0, at 0.9x of our capacity there, 1.06875x; 20 s measured after 10 s, as there).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path
from typing import Any

import common
from bench_slot_bands import CELLS, REFERENCE

from lora_cluster.sim.census import MISS_KINDS, MissCensus
from lora_cluster.sim.grid import Common
from lora_cluster.sim.simulation import Simulation

POLICIES = ("lora-cluster", "oracle")
LARGE = (1024, 20000, 1.0, 0, 1.06875, 20.0, 10.0)  # nodes, adapters, zipf, seed, load, duration, warm-up


def one(nodes: int, adapters: int, zipf: float, seed: int, load: float, policy: str, duration: float = 60.0,
        warmup: float = 20.0) -> dict[str, Any]:
    """One run with the miss census wired: hit rate over offered requests, and misses by band and kind
    per 100 completed requests of the band."""
    config = Common(duration=duration, warmup=warmup).config(nodes=nodes, adapters=adapters, zipf=zipf,
                                                             load=load, seed=seed, policy=policy)
    sim = Simulation(config)
    census = MissCensus(sim.replicas, sim.census.buckets, clock=sim.loop.clock, start=config.warmup,
                        end=sim.end)
    sim.on_miss = census.missed
    out = sim.finish().to_json()
    completed: dict[str, int] = {}
    for adapter_id, n in out["adapters_completed"].items():
        label = sim.census.buckets(adapter_id)
        completed[label] = completed.get(label, 0) + n
    misses = census.result()
    per_100 = {label: {kind: 100 * k / max(1, completed.get(label, 0)) for kind, k in kinds.items()}
               for label, kinds in misses.items()}
    return {"cell": (nodes, adapters, zipf, seed), "load": load, "policy": policy,
            "hit": out["hit_rate_offered"], "per_100": per_100,
            "cold_share": sum(k["cold"] for k in misses.values())
            / max(1, sum(sum(k.values()) for k in misses.values()))}


def jobs(large: bool) -> list[tuple[int, int, float, int, float, str, float, float]]:
    if large:
        nodes, adapters, zipf, seed, load, duration, warmup = LARGE
        return [(nodes, adapters, zipf, seed, load, policy, duration, warmup) for policy in POLICIES]
    return [(nodes, adapters, zipf, seed, round(REFERENCE * (cap or 1.0), 3), policy, 60.0, 20.0)
            for nodes, adapters, zipf, seed, cap in CELLS for policy in POLICIES]


def markdown(runs: list[dict[str, Any]]) -> list[str]:
    """One row per run; the bands are the slot census's (their ranks scale with the cluster's slots)."""
    cols = " | ".join(f"band {k}: {' / '.join(MISS_KINDS)}" for k in range(1, 5))
    lines = [f"| cell | load | policy | hit rate (offered) | cold share of misses | {cols} |",
             "|" + "---|" * 9]
    for r in runs:
        n, a, z, s = r["cell"]
        bands = " | ".join(f"{label}: " + " / ".join(f"{kinds[kind]:.1f}" for kind in MISS_KINDS)
                           for label, kinds in r["per_100"].items())
        lines.append(f"| {n} x {a}, Zipf {z:g}, seed {s} | {r['load']:g}x | {r['policy']} "
                     f"| {100 * r['hit']:.1f}% | {100 * r['cold_share']:.0f}% | {bands} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--large", action="store_true", help="the 1,024 x 20,000 cell only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        runs = list(pool.map(one, *zip(*jobs(args.large), strict=True)))
    lines = common.header("Why requests miss their adapter, by popularity band, ours against the oracle "
                          "(simulator, GPU profile, preloaded)",
                          "python benchmarks/bench_miss_kinds.py " + " ".join(argv or sys.argv[1:]),
                          level=2, changed={})
    note = ("Per band: misses per 100 completed requests of the band, cold / copy / joined "
            "(`sim.census.MissCensus`).")
    common.emit("\n".join([*lines, "", note, "", *markdown(runs)]), args.out, title="bench_miss_kinds",
                doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What prefetch and publication cost a live load, in the simulator: a request's adapter fetch waits for
one of its replica's load workers; that wait is measured with prefetch on (shipped) and off.

    python benchmarks/bench_cold_start_cost.py [--seeds 0,1] [--out docs/bench_cold_start_cost.md]

Each run is a cold start (`--preload 0`, 120 s of arrivals measured from 0 s) on the GPU profile with
the cluster tier on (`sim.cluster_store`); the only difference between the two rows of a cell is
`ClusterTierSettings.prefetch`. Per run: the requests' fetches (count), their mean and longest wait
for a load worker, the S3 loads and `interactive` attainment. Prefetch runs on its own lanes and
publication is bookkeeping in the simulator, so a live fetch can only wait longer if prefetch took
a worker; it never does by construction, and the rows say what the cluster gains instead (fewer,
shorter loads ahead of each fetch). The live store publishes on its own thread after the load
returns (`serve/replica/cluster_tier.py`), and the live test (`tests/store/test_cluster_tier_live.py`)
times a copy against the S3 time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common

from lora_cluster.sim.cluster_store import ClusterTierSettings
from lora_cluster.sim.simulation import SimConfig, Simulation

CELLS = ((24, 1500, 0.8, 1.0), (24, 1500, 1.0, 1.5), (32, 1000, 1.0, 1.0))


def measure(nodes: int, adapters: int, zipf: float, load: float, seed: int,
            prefetch: bool) -> dict[str, float]:
    sim = Simulation(SimConfig(nodes=nodes, adapters=adapters, zipf=zipf, load=load, seed=seed, warmup=0.0,
                               duration=120.0, preload=0,
                               cluster_tier_settings=ClusterTierSettings(prefetch=prefetch)))
    result = sim.finish()
    devices = [r.adapters for r in sim.replicas.values()]
    waits = sum(d.live_waits for d in devices)
    return {"fetches": waits, "mean_ms": 1e3 * sum(d.live_wait_s for d in devices) / max(1, waits),
            "max_s": max(d.live_wait_max_s for d in devices), "s3": result.adapter_loads["s3"],
            "peer": result.adapter_loads["peer"],
            "interactive": result.classes["interactive"]["slo_attainment"] or 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lines = common.header("Prefetch and a live load's wait for a load worker (simulator, GPU profile)",
                          "python benchmarks/bench_cold_start_cost.py " + " ".join(argv or sys.argv[1:]),
                          level=2, changed={})
    lines += ["", "| nodes x adapters | zipf | load | seed | prefetch | requests' fetches "
              "| wait for a worker, mean ms | longest s | S3 loads | peer copies | interactive |",
              "|" + "---|" * 11]
    for nodes, adapters, zipf, load in CELLS:
        for seed in (int(s) for s in args.seeds.split(",")):
            for prefetch in (True, False):
                m = measure(nodes, adapters, zipf, load, seed, prefetch)
                lines.append(f"| {nodes} x {adapters} | {zipf:g} | {load:g}x | {seed} "
                             f"| {'on' if prefetch else 'off'} | {m['fetches']} | {m['mean_ms']:.1f} "
                             f"| {m['max_s']:.2f} | {m['s3']} | {m['peer']} "
                             f"| {100 * m['interactive']:.1f}% |")
                print(lines[-1], file=sys.stderr, flush=True)
    common.emit("\n".join(lines), args.out, title="bench_cold_start_cost", doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

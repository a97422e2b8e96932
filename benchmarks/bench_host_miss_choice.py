"""Benchmark of how often the controller's host-tier preference for a miss can choose, in the
simulator: of the grants that miss their adapter, how many have a replica with room whose host tier
holds it, and how many have no other replica with room; of the others, how many have a replica with
room on a node holding the cluster tier's copy (`ClusterView.cluster_local`), and how many have a
host-tier holder without room (where waiting for that holder is the only way to a host-tier load).

    LORA_CLUSTER_PURE_PYTHON=1 python benchmarks/bench_host_miss_choice.py [--seeds 0,3] \
        [--out docs/bench_host_miss_choice.md]

A cold start (`--preload 0`, 120 s of arrivals measured from 0 s) at 24 x 1,500, Zipf 0.9, 1x on the
GPU profile, the shipped settings. `scheduling.choose_replica` is wrapped where the simulator calls
it; a grant counts as a miss when no replica with room holds the adapter on its device or is named
for it by the placement table (where the host tier, then the node's cluster-tier copy, decides:
`ClusterView.host_holders`, `ClusterView.cluster_local`).
The wrapper reaches the controller only from the policies' Python sources (a compiled controller
calls the compiled function directly): hence `LORA_CLUSTER_PURE_PYTHON=1`; without it the script stops.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import common

import lora_cluster.cluster.controller as controller_module
from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.sim.simulation import SimConfig, Simulation


def measure(seed: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    choose = controller_module.choose_replica

    def counted(ticket: Ticket, view: ClusterView, placement: Mapping[str, tuple[str, ...]]) -> str | None:
        room, aid = view.free_ids(), ticket.adapter_id
        near = (*view.holders(aid), *placement.get(aid, ())) if aid is not None else ()
        if room and aid is not None and not any(r in room for r in near):
            in_host = [r for r in view.tiers.host_holders(aid) if r in room]
            counts["misses"] += 1
            counts["room"] += len(room)
            counts["host_holder_with_room"] += bool(in_host)
            counts["only_host_holders_with_room"] += bool(in_host) and len(in_host) == len(room)
            if not in_host:
                counts["cluster_local_with_room"] += any(r in room for r in view.tiers.cluster_local(aid))
                counts["busy_host_holder"] += bool(view.tiers.host_holders(aid))
        return choose(ticket, view, placement)

    controller_module.choose_replica = counted  # type: ignore[assignment]
    try:
        Simulation(SimConfig(nodes=24, adapters=1500, zipf=0.9, load=1.0, seed=seed, warmup=0.0,
                             duration=120.0, preload=0)).finish()
    finally:
        controller_module.choose_replica = choose
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seeds", default="0,3")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lines = common.header("Misses the host-tier preference could steer (simulator, GPU profile, cold start)",
                          "LORA_CLUSTER_PURE_PYTHON=1 python benchmarks/bench_host_miss_choice.py "
                          + " ".join(argv or sys.argv[1:]),
                          level=2, changed={})
    lines += ["", "| seed | grants that miss | replicas with room per miss "
              "| with a host-tier holder with room | of those, every replica with room is one "
              "| else, a replica with room beside a cluster-tier copy "
              "| else, a host-tier holder without room |",
              "|" + "---|" * 7]
    for seed in (int(s) for s in args.seeds.split(",")):
        c = measure(seed)
        if not c["misses"]:
            raise SystemExit("no miss counted: run with LORA_CLUSTER_PURE_PYTHON=1 (see the docstring)")
        lines.append(f"| {seed} | {c['misses']} | {c['room'] / max(1, c['misses']):.2f} "
                     f"| {c['host_holder_with_room']} | {c['only_host_holders_with_room']} "
                     f"| {c['cluster_local_with_room']} | {c['busy_host_holder']} |")
    common.emit("\n".join(lines), args.out, title="bench_host_miss_choice", doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

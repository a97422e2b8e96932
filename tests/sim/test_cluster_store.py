"""The cluster tier and prefetch in the simulator (`sim.cluster_store`): first uses on a cold start copy
from other nodes instead of S3, a copy costs the profile's node-to-node figure, and prefetch fills the
cluster tier ahead of requests within its bandwidth."""

from __future__ import annotations

import dataclasses

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim import SimConfig, Simulation, run
from lora_cluster.sim.cluster_store import ClusterTierSettings
from lora_cluster.sim.profile import MB, load_profile
from lora_cluster.sim.workload import SimRequest

GPU = load_profile("gpu")
COLD = dict(nodes=6, adapters=120, zipf=1.0, load=1.0, duration=30, warmup=0, max_loras=4, preload=0)


def test_the_gpu_profile_states_its_node_to_node_cost() -> None:
    assert GPU.node_to_node is not None, "the GPU profile has tiers.peer"
    assert GPU.peer_fetch_s(128 * MB) < GPU.fetch_s("s3", 128 * MB) / 4, \
        "a 128 MiB copy between nodes is several times faster than its S3 download"


def test_a_cold_start_copies_from_peers_instead_of_s3() -> None:
    on = run(SimConfig(**COLD))
    off = run(SimConfig(**COLD, cluster_tier=False))
    assert on.adapter_loads["peer"] > 0, "with the cluster tier, nodes copy adapters from each other"
    assert off.adapter_loads["peer"] == 0, "without it, no copy between nodes"
    assert on.adapter_loads["s3"] < off.adapter_loads["s3"], "fewer downloads from S3"
    assert on.details["cluster_tier"]["published"] > 0, "adapters fetched once are published"
    met = {run_: r.classes["interactive"]["slo_attainment"] or 0.0 for run_, r in (("on", on), ("off", off))}
    assert met["on"] >= met["off"], "first uses are no slower"


def test_a_copy_from_a_peer_takes_the_node_to_node_time() -> None:
    no_prefetch = ClusterTierSettings(prefetch=False)
    sim = Simulation(SimConfig(**{**COLD, "duration": 5}, cluster_tier_settings=no_prefetch))
    first, second = list(sim.replicas.values())[:2]
    interactive = SlaClasses().get("interactive")
    nbytes = sim.workload.sizes["a5"]
    first.add(SimRequest(10**6, "a5", interactive, prompt=8, output=1, arrival=0.0, measured=False), 0.0)
    sim.advance(GPU.fetch_s("s3", nbytes) + 1e-6)
    assert first.node_id in sim.cluster.index.holders("a5"), "the node that fetched it from S3 published it"
    start = sim.loop.now
    request = SimRequest(10**6 + 1, "a5", interactive, prompt=8, output=1, arrival=start, measured=False)
    second.add(request, start)
    sim.advance(start + GPU.peer_fetch_s(nbytes) - 1e-6)
    assert "a5" in second.adapters.loading and "a5" not in second.adapters.fetched, "still copying"
    sim.advance(start + GPU.peer_fetch_s(nbytes) + 1e-6)
    assert second.node_id in sim.cluster.index.holders("a5"), "the copy arrived after the node-to-node time"


def test_prefetch_fills_the_cluster_tier_within_its_bandwidth() -> None:
    settings = ClusterTierSettings(bytes_per_s_per_node=64 * MB)
    sim = Simulation(SimConfig(**{**COLD, "load": 0.05}, cluster_tier_settings=settings))
    sim.advance(20.0)
    cluster = sim.cluster
    assert cluster.prefetched > 0, "adapters were fetched ahead of requests"
    bound = 64 * MB * COLD["nodes"] * (20.0 + 1) + max(sim.workload.sizes.values())
    assert cluster.planner.handed_out_bytes <= bound, "prefetch stays within its bandwidth"
    lanes = dataclasses.asdict(settings)["lanes_per_node"]
    assert all(n <= lanes for n in cluster.lanes.values()), "at most lanes_per_node prefetches per node"


def test_a_cluster_in_service_runs_the_same_with_or_without_the_cluster_tier() -> None:
    warm = {**COLD, "preload": COLD["adapters"], "warmup": 5}
    on, off = run(SimConfig(**warm)), run(SimConfig(**warm, cluster_tier=False))
    assert on.classes == off.classes, "every adapter preloaded: the same requests met their targets"
    assert on.details["cluster_tier"]["prefetched"] == 0, "preloaded adapters count as published: no prefetch"

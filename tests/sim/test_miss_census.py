"""The miss census (`sim.census.MissCensus`): why a request missed its adapter, by popularity band."""

from __future__ import annotations

from types import SimpleNamespace

from sim_profiles import SYNTHETIC

from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.census import MissCensus, RankBuckets

SMALL = {"nodes": 4, "adapters": 60, "zipf": 1.0, "load": 1.2, "duration": 10, "warmup": 2, "seed": 1,
         "max_loras": 4, "policy": "lora-cluster"}


def replica(refs: dict[str, int] | None = None, loading: dict[str, bool] | None = None) -> SimpleNamespace:
    """What the census reads of a replica: its device slots (adapter -> references) and its fetches
    (adapter -> whether it is a host prefetch, True, or a load for a request, False)."""
    return SimpleNamespace(adapters=SimpleNamespace(refs=refs or {}, loading=loading or {}))


def census_of(replicas: dict[str, SimpleNamespace], now: float = 5.0) -> MissCensus:
    buckets = RankBuckets({"hot": 1, "warm": 2, "tail": 3}.__getitem__, (1, 2))
    return MissCensus(replicas, buckets, clock=lambda: now, start=1.0, end=10.0)


def request(adapter: str, joined: bool = False) -> SimpleNamespace:
    return SimpleNamespace(adapter=adapter, joined=joined)


def test_a_miss_is_cold_a_copy_or_joined_by_where_its_adapter_is() -> None:
    replicas = {"r0": replica(), "r1": replica(refs={"hot": 0}), "r2": replica(loading={"warm": False}),
                "r3": replica(loading={"tail": True})}
    census = census_of(replicas)
    census.missed(replicas["r0"], request("hot"))
    census.missed(replicas["r0"], request("warm"))
    census.missed(replicas["r0"], request("tail"))
    census.missed(replicas["r2"], request("warm", joined=True))
    counts = census.result()
    assert counts["1-1"] == {"cold": 0, "copy": 1, "joined": 0}, f"idle in another's slot: a copy ({counts})"
    assert counts["2-2"] == {"cold": 0, "copy": 1, "joined": 1}, (
        f"loading elsewhere for a request: a copy; loading here: joined ({counts})")
    assert counts["3+"] == {"cold": 1, "copy": 0, "joined": 0}, (
        f"only a host prefetch elsewhere: cold, no device holds it ({counts})")


def test_the_replica_it_reached_is_no_copy_of_itself() -> None:
    replicas = {"r0": replica(loading={"hot": False}), "r1": replica()}
    census = census_of(replicas)
    census.missed(replicas["r0"], request("hot"))
    assert census.result()["1-1"]["cold"] == 1, "its own load started for it is not another replica's copy"


def test_misses_outside_the_measured_period_are_not_counted() -> None:
    replicas = {"r0": replica()}
    for now in (0.5, 10.0):
        census = census_of(replicas, now=now)
        census.missed(replicas["r0"], request("tail"))
        assert sum(census.result()["3+"].values()) == 0, f"at {now} s: outside [1, 10)"


def test_wired_to_a_simulation_it_counts_misses_and_changes_nothing() -> None:
    plain = Simulation(SimConfig(**SMALL), SYNTHETIC).finish()
    sim = Simulation(SimConfig(**SMALL), SYNTHETIC)
    census = MissCensus(sim.replicas, sim.census.buckets, clock=sim.loop.clock, start=SMALL["warmup"],
                        end=sim.end)
    sim.on_miss = census.missed
    observed = sim.finish()
    assert observed.hit_rate == plain.hit_rate, "an observer: the run is the same"
    counts = census.result()
    assert list(counts) == list(sim.census.buckets.labels), "the slot census's bands"
    assert counts["17+"]["cold"] > 0, f"adapters beyond the cluster's 16 slots miss cold ({counts})"

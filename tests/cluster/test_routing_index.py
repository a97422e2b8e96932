"""Routing by index gives the full rank's choice: `RoutingIndex.ranked` is a prefix of `rank_replicas`
over every replica's view, on 1,000 random cluster states (seeded), with the index updated through
its commands as a live router updates it (stats, ongoing changes, placements, replicas leaving and
joining, time passing placements' ttl), with replicas reporting cached prompt prefixes and requests
carrying theirs, and replicas reporting the adapters their host tiers hold."""

from __future__ import annotations

import random

from helpers import FakeClock

from lora_cluster.cluster.prefix_keys import GRAIN, MAX_DEPTH
from lora_cluster.cluster.routing_index import MAX_KEY_HOLDERS, RoutingIndex
from lora_cluster.cluster.routing_score import cached_tokens, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats

TTL_S = 5.0


def chain(name: str, depth: int) -> tuple[str, ...]:
    """The routing keys of a prompt prefix (`prefix_keys.routing_keys`' shape: one per GRAIN tokens)."""
    return tuple(f"{name}.{level}" for level in range(depth))


def random_prefixes(rng: random.Random, chains: list[str]) -> tuple[str, ...]:
    """The keys a replica reports: some of the keys of some chains, each to a random depth."""
    picked = rng.sample(chains, rng.randint(0, min(3, len(chains))))
    keys = [key for name in picked for key in chain(name, rng.choice([1, 2, 5, 12, MAX_DEPTH // GRAIN]))]
    return tuple(rng.sample(keys, rng.randint(min(1, len(keys)), min(6, len(keys)))))


def random_stats(rng: random.Random, adapters: list[str], chains: list[str] = ()) -> RoutingStats:
    """A report with ties likely (few distinct values), unknown fields, loading adapters, thrash,
    cached prefixes of `chains`."""
    if rng.random() < 0.1:
        return RoutingStats()  # not reported yet: every routing field unknown
    max_loras = rng.choice([None, 1, 2, 4])
    slots = 4 if max_loras is None else max_loras
    resident = tuple(rng.sample(adapters, rng.randint(0, min(slots, len(adapters)))))
    loading = tuple(rng.sample(adapters, rng.randint(0, 1)))
    return RoutingStats(resident=resident, loading=loading, max_loras=max_loras,
                        empty_adapter_slots=rng.choice([None, 0, 1, slots - len(resident)]),
                        free_adapter_slots=rng.choice([None, 0, 1, 2]),
                        max_num_seqs=rng.choice([None, 2, 4]), num_running=rng.randint(0, 4),
                        num_waiting=rng.randint(0, 2), miss_penalty=rng.choice([0.0, 0.0, 0.5, 1.0]),
                        prefixes=random_prefixes(rng, list(chains)),
                        host_held=tuple(rng.sample(adapters, rng.randint(0, min(3, len(adapters))))))


class Cluster:
    """The state a router sees: reports, ongoing counts, the clock; an index fed like the live one."""

    def __init__(self, rng: random.Random, spare: int):
        self.rng, self.spare, self.clock = rng, spare, FakeClock(100.0)
        self.adapters = [f"a{k}" for k in range(rng.randint(1, 12))]
        self.chains = [f"c{k}" for k in range(rng.randint(1, 6))]
        self.ongoing: dict[str, int] = {}
        self.index = RoutingIndex(miss_cost=rng.choice([0.5, 2.0, 4.0]), placement_ttl_s=TTL_S,
                                  clock=self.clock, ongoing=lambda rid: self.ongoing[rid])
        self.replace([f"r{i:02d}" for i in range(rng.randint(1, 24))])

    def replace(self, replica_ids: list[str]) -> None:
        self.ongoing = {rid: self.ongoing.get(rid, self.rng.randint(0, 6)) for rid in replica_ids}
        self.index.replace({rid: random_stats(self.rng, self.adapters, self.chains) for rid in replica_ids})

    def step(self) -> None:
        """One random change, signalled as the live router signals it."""
        rng, ids = self.rng, sorted(self.ongoing)
        what = rng.random()
        if what < 0.35:
            rid = rng.choice(ids)
            self.ongoing[rid] = max(0, self.ongoing[rid] + rng.choice([-2, -1, 1, 1, 3]))
            self.index.touch(rid)
        elif what < 0.6:
            self.index.record(rng.choice(ids), rng.choice(self.adapters))
        elif what < 0.75:
            self.index.set_stats(rng.choice(ids), random_stats(rng, self.adapters, self.chains))
        elif what < 0.9:
            self.clock.now += rng.choice([0.5, 1.0, TTL_S / 2, TTL_S])
            if rng.random() < 0.3:
                self.index.prune()
        else:
            kept = [rid for rid in ids if rng.random() < 0.8] or ids[:1]
            joined = [f"r{i:02d}" for i in rng.sample(range(40), 3)]  # may rejoin under an old id
            self.replace(sorted(set(kept) | set(joined)))

    def full_rank(self, adapter_id: str | None, placed: tuple[str, ...],
                  prefix: tuple[str, ...]) -> list[str]:
        """What the router built before the index: every replica's view, then `rank_replicas`."""
        views = [self.index.view(rid, adapter_id if rid in placed else None) for rid in sorted(self.ongoing)]
        return rank_replicas(adapter_id, views, self.index.miss_cost, prefix)


def test_the_ranked_prefix_is_the_full_rank_on_1000_random_cluster_states() -> None:
    rng = random.Random(2027)
    states = prefixes = 0
    for trial in range(100):
        cluster = Cluster(rng, spare=rng.choice([1, 1, 2, 4]))
        for _ in range(10):
            for _ in range(rng.randint(0, 12)):
                cluster.step()
            states += 1
            adapter_id = rng.choice([*cluster.adapters, "new-adapter", None])
            placed = tuple(rid for rid in sorted(cluster.ongoing) if rng.random() < 0.15)
            prefix = rng.choice([(), chain(rng.choice(cluster.chains), rng.choice([1, 3, 8, 40])),
                                 chain("unseen", 3)])
            prefixes += bool(prefix)
            full = cluster.full_rank(adapter_id, placed if adapter_id else (), prefix)
            ranked = cluster.index.ranked(adapter_id, placed if adapter_id else (), spare=cluster.spare,
                                          prefix=prefix)
            assert ranked, f"trial {trial}: a cluster with replicas ranks one"
            assert ranked == full[:len(ranked)], (
                f"trial {trial}, adapter {adapter_id!r}, placed {placed}, prefix {prefix}: the index ranked "
                f"{ranked}, the full rank begins {full[:len(ranked)]}")
            holders = {rid for rid in full if (adapter_id is not None
                       and (adapter_id in cluster.index.view(rid).adapters or rid in placed))
                       or cached_tokens(prefix, cluster.index.view(rid))}
            others = [rid for rid in ranked if rid not in holders]
            assert len(others) >= min(cluster.spare, len(full) - len(holders)), (
                f"trial {trial}: the prefix holds {cluster.spare} replicas outside the adapter's and the "
                "prompt prefix's holders, or every replica")
            if rng.random() < 0.5:
                cluster.index.record(ranked[0], adapter_id)
    assert states == 1000, "1,000 cluster states were checked"
    assert prefixes > 500, "most of them with a request carrying a prompt prefix"


def test_a_replica_that_left_is_never_ranked_and_one_that_rejoins_is_ranked_afresh() -> None:
    clock = FakeClock(0.0)
    ongoing = {"r1": 0, "r2": 5}
    index = RoutingIndex(miss_cost=4.0, placement_ttl_s=TTL_S, clock=clock, ongoing=lambda rid: ongoing[rid])
    busy = RoutingStats(resident=("a",), max_num_seqs=4, max_loras=2, empty_adapter_slots=1,
                        free_adapter_slots=1)
    index.replace({"r1": busy, "r2": busy})
    assert index.choose("a") == "r1", "the holder with fewer requests first"
    index.replace({"r2": busy})
    assert index.ranked("a", placed=("r1",), spare=4) == ["r2"], (
        "a replica that left is neither ranked nor taken from the placement table")
    ongoing["r1"] = 9
    index.replace({"r1": RoutingStats(), "r2": busy})
    assert index.ranked("a", spare=4) == ["r2", "r1"], (
        "a replica that rejoins is ranked by its new report (holds nothing) and its count, not its old entry")


def test_a_placement_counts_until_its_ttl_then_no_longer() -> None:
    clock = FakeClock(0.0)
    index = RoutingIndex(miss_cost=4.0, placement_ttl_s=TTL_S, clock=clock, ongoing=lambda rid: 0)
    one_slot = RoutingStats(max_num_seqs=4, max_loras=1, empty_adapter_slots=1, free_adapter_slots=1)
    index.replace({"r1": one_slot, "r2": one_slot})
    index.record("r1", "x")
    assert index.choose("x") == "r1", "a new adapter follows its recent placement"
    assert index.choose("y") == "r2", "another new adapter avoids the replica whose only slot x took"
    clock.now += TTL_S
    assert index.choose("y") == "r1", (
        "at the ttl the placement expires: r1 is empty again and ranks first by id")


def test_a_prefix_every_replica_caches_costs_a_bounded_number_of_candidates() -> None:
    replicas = [f"r{i:03d}" for i in range(4 * MAX_KEY_HOLDERS)]
    index = RoutingIndex(miss_cost=4.0, placement_ttl_s=TTL_S, clock=FakeClock(0.0), ongoing=lambda rid: 0)
    index.replace({rid: RoutingStats(max_num_seqs=4, max_loras=2, prefixes=chain("system", 2))
                   for rid in replicas})
    ranked = index.ranked("a", spare=1, prefix=chain("system", 2))
    assert len(index.prefix_holders[chain("system", 2)[-1]]) == MAX_KEY_HOLDERS, (
        f"a key keeps at most {MAX_KEY_HOLDERS} holders, however many replicas report it")
    assert len(ranked) <= MAX_KEY_HOLDERS + 1, (
        "the ranked candidates are the key's bounded holders and the spare, not every replica")
    assert cached_tokens(chain("system", 2), index.view(ranked[0])) == 2 * GRAIN, (
        "the first choice caches the prefix")

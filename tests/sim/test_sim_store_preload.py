"""The simulator's node store starts as after the engine's `preload` fetched its adapters one by one
from S3 (most popular kept in host memory): `NodeStore.preload` computes that state directly, so a
1,024-node x 20,000-adapter run does not put every adapter into every node's tiers."""

from __future__ import annotations

import random

import pytest

from lora_cluster.sim.store import NodeStore


def fetched_one_by_one(ids: list[str], sizes: dict[str, int], host: int, disk: int) -> NodeStore:
    store = NodeStore(host_bytes=host, disk_bytes=disk)
    for adapter_id in reversed(ids):  # least popular first, as `preload` documents
        store.fetched(adapter_id, sizes[adapter_id], "s3")
    return store


@pytest.mark.parametrize("seed", range(20))
def test_preload_equals_fetching_each_adapter_in_turn(seed: int) -> None:
    rng = random.Random(seed)
    ids = [f"a{k}" for k in range(rng.randrange(0, 300))]
    sizes = {a: rng.choice([1, 2, 5, 40, 200]) for a in ids}
    host, disk = rng.randrange(0, 400), rng.randrange(100, 3000)
    expected = fetched_one_by_one(ids, sizes, host, disk)
    store = NodeStore(host_bytes=host, disk_bytes=disk)
    store.preload(ids, sizes)
    for a in ids:
        assert store.tier(a) == expected.tier(a), f"seed {seed}: {a}'s tier differs from one by one"
    used = (store.host.used, store.disk.used)
    assert used == (expected.host.used, expected.disk.used), "bytes used per tier"
    late = f"a{len(ids)}"
    sizes[late] = 150
    store.fetched(late, 150, "s3")
    expected.fetched(late, 150, "s3")
    tiers = [store.tier(a) for a in ids]
    assert tiers == [expected.tier(a) for a in ids], "the same LRU order evicts the same adapters"

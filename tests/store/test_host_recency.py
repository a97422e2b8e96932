"""The host tier's adapters by recent use (`HostCache.recent`), which the replica's report lists as
`host_held`: a hit or a load makes an adapter the most recent; at most `limit` are listed."""

from __future__ import annotations

import torch

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.store.host_cache import HostCache


def weights(adapter_id: str) -> LoraWeights:
    a, b = {(0, "q_proj"): torch.ones(2, 4)}, {(0, "q_proj"): torch.ones(4, 2)}
    return LoraWeights(adapter_id, 2, frozenset({"q_proj"}), {"q_proj": 1.0}, a, b)


def test_recent_lists_the_most_recently_used_first_and_at_most_limit() -> None:
    cache = HostCache(1 << 20)
    for adapter_id in ("a", "b", "c", "d"):
        cache.put(weights(adapter_id), 0.1)
    assert cache.recent(10) == ["d", "c", "b", "a"], "without hits, the last stored comes first"
    cache.get("a")
    assert cache.recent(10) == ["a", "d", "c", "b"], "a hit makes an adapter the most recent"
    cache.put(weights("c"), 0.1)
    assert cache.recent(2) == ["c", "a"], "storing again makes it the most recent; limit bounds the list"
    cache.remove("c")
    assert cache.recent(10) == ["a", "d", "b"], "a removed adapter is not listed"
    assert cache.recent(0) == [], "a limit of 0 lists nothing"


def test_int8_hits_count_as_use_too() -> None:
    cache = HostCache(1 << 20, int8=True)
    cache.put(weights("x"), 0.1)
    cache.put(weights("y"), 0.1)
    cache.get("x")
    assert cache.recent(1) == ["x"], "a hit on an int8 copy makes it the most recent"

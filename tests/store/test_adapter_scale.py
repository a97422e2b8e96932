"""Thousands of known adapters: what the engine thread asks the store costs O(1) per adapter, not
O(adapters known)."""

from __future__ import annotations

from pathlib import Path

from lora_cluster.store.disk_cache import DiskCache
from lora_cluster.store.tier import TierIndex


def _write(dest: Path, size: int) -> dict[str, str]:
    (dest / "adapter_model.safetensors").write_bytes(b"x" * size)
    return {}


def test_disk_keys_of_an_adapter_follow_fills_replacements_and_evictions(tmp_path):
    cache = DiskCache(tmp_path / "disk", 3_000)
    with cache.fill("k1", "a", lambda d: _write(d, 1_000)):
        pass
    with cache.fill("k2", "a", lambda d: _write(d, 1_000)):
        pass
    with cache.fill("k3", "b", lambda d: _write(d, 500)):
        pass
    assert sorted(cache.adapter_keys("a")) == ["k1", "k2"], "both entries of adapter a are found"
    assert cache.adapter_keys("b") == ["k3"], "adapter b has its own entry"
    assert cache.remove("k1"), "k1 existed"
    assert cache.adapter_keys("a") == ["k2"], "a removed entry leaves the adapter's keys"
    with cache.fill("k4", "c", lambda d: _write(d, 2_400)):  # evicts what it must to fit
        pass
    for adapter_id in ("a", "b", "c"):
        keys = cache.adapter_keys(adapter_id)
        assert all(k in cache for k in keys), f"every key listed for {adapter_id} is in the cache"
    assert cache.adapter_keys("c") == ["k4"], "the new entry is listed"
    reopened = DiskCache(tmp_path / "disk", 3_000)
    assert reopened.adapter_keys("c") == ["k4"], "the index is rebuilt from the entries at start"
    assert reopened.adapter_keys("gone") == [], "an adapter without entries has no keys"


def test_admitting_into_a_tier_with_room_scores_no_entry():
    scored: list[str] = []

    def priority(adapter_id: str) -> float:
        scored.append(adapter_id)
        return 0.0

    index = TierIndex(10_000, priority=priority)
    for i in range(2_000):
        assert index.admit(f"k{i}", f"a{i}", 1, 0.1) == [], "an entry that fits evicts nothing"
    assert scored == [], "admissions that fit never score the thousands of entries already held"
    assert index.admit("big", "big", 9_000, 0.1) is not None, "an entry that needs room is admitted"
    assert len(scored) == 2_000, "only an admission that must evict scores the entries (once each)"

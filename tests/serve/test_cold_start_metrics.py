"""The cold-start counters at the ingress's /metrics (`metrics_exposition.render`, as the other replica
metrics tests read them): a replica's demand prefetch (bytes and prefetches done, failed, skipped) and
its cluster tier (copies received and refused, publications made and skipped), one series per replica.
The prefetch counts come from a real `DemandPrefetch` filling a real store's host tier."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import torch

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.serve.ops import metrics_exposition
from lora_cluster.serve.replica.demand_prefetch import DemandPrefetch
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy


class Hot:
    """The controller's hot list (its stand-in: the unit tier runs no controller actor)."""

    async def hot(self, k: int) -> list[tuple[str, int]] | None:
        return [("a1", 50), ("zz", 40)]  # zz: no source offers it, so its prefetch fails


class NoLiveLoads:
    def live_fetches(self) -> int:
        return 0


def sample(text: str, name: str, replica: str) -> float | None:
    found = re.search(rf'^{name}{{replica="{replica}"}} (\S+)$', text, re.M)
    return None if found is None else float(found[1])


def test_prefetch_and_cluster_tier_counters_are_exported_per_replica(demo_zoo, tmp_path: Path) -> None:
    base = load_base_model(str(demo_zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    store = TieredAdapterStore([str(demo_zoo.adapters_dir)], AdmissionPolicy(base.dims.shapes(), 64),
                               disk_cache_dir=tmp_path / "disk")
    prefetch = DemandPrefetch(Hot(), store, NoLiveLoads(), bytes_per_s=1e12, max_bytes=1 << 30, period_s=60)
    asyncio.run(prefetch.poll())
    for _ in range(200):  # bounded: each step hands out or settles one prefetch
        prefetch.step()
        store.wait_prefetches(10)
        if prefetch.counts["prefetched"] + prefetch.counts["failed"] >= 2 and prefetch.in_flight() is None:
            break
    tier = {"cluster_tier_fetches": 3, "cluster_tier_refused": 1, "cluster_tier_publications": 2,
            "cluster_tier_publications_skipped": 0}
    metrics_exposition.set_replica_stats_source(
        lambda: {"r1": RoutingStats(max_loras=4, engine={**prefetch.counters(), **tier}),
                 "r2": RoutingStats(max_loras=4)})
    text = metrics_exposition.render().decode()
    assert sample(text, "lora_cluster_prefetches_total", "r1") == 1.0, "one prefetch landed (a1)"
    assert sample(text, "lora_cluster_prefetch_bytes_total", "r1") == float(store.host.nbytes("a1") or -1), (
        "the bytes prefetched are a1's host copy")
    assert sample(text, "lora_cluster_prefetch_failures_total", "r1") == 1.0, "zz's prefetch failed"
    assert sample(text, "lora_cluster_prefetch_skipped_total", "r1") == 0.0, "no live load made it skip"
    assert sample(text, "lora_cluster_cluster_tier_fetches_total", "r1") == 3.0, "copies from peers"
    assert sample(text, "lora_cluster_cluster_tier_refused_total", "r1") == 1.0, "copies refused"
    assert sample(text, "lora_cluster_cluster_tier_publications_total", "r1") == 2.0, "publications"
    assert sample(text, "lora_cluster_cluster_tier_publications_skipped_total", "r1") == 0.0, "skipped ones"
    assert sample(text, "lora_cluster_prefetches_total", "r2") is None, (
        "a replica that reports no prefetch counters has no series (never a 0)")
    store.close()

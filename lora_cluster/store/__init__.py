"""The adapter store: sources by URI, admission checks, and the host and disk cache tiers.

`build_adapter_loader(config, shapes, device)` builds the `AdapterStore` (the protocols,
`store.ports`) for a config: the `TieredAdapterStore` (the default, `adapter_store="tiered"`), or
the plain `FolderAdapterLoader` with `adapter_store="folder"`. The caller wires it into the engine
as its `EnginePort` (`engine.factory.build_engine`, the replica) and talks to its `AdapterCatalog`
itself. See docs/adapter-store.md.

Importing this package imports torch; the pure policies the store runs (`replica_policy.eviction`,
`replica_policy.tier_stats`) are in `replica_policy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_cluster.store.folder_loader import FolderAdapterLoader
from lora_cluster.store.lifecycle import TRANSITIONS, AdapterState, Lifecycle
from lora_cluster.store.sources import AdapterInfo, open_source
from lora_cluster.store.store import TieredAdapterStore

if TYPE_CHECKING:
    import torch

    from lora_cluster.adapter_format import ModelShapes
    from lora_cluster.config import EngineConfig
    from lora_cluster.store.ports import AdapterStore, ClusterTierPort


def build_adapter_loader(config: EngineConfig, shapes: ModelShapes, device: torch.device,
                         cluster_tier: ClusterTierPort | None = None) -> AdapterStore:
    """The adapter store of `config` (see the module docstring); `cluster_tier` (the tiered store's
    tier between host memory and the sources) is wired by a caller that runs under Ray."""
    if config.adapter_store == "folder":
        return FolderAdapterLoader(config.adapter_source, shapes, config.max_lora_rank,
                                   max_merged_adapters=config.max_merged_adapters,
                                   merge_seed=config.merge_seed)
    return TieredAdapterStore.from_config(config, shapes, device, cluster_tier=cluster_tier)


__all__ = ["TRANSITIONS", "AdapterInfo", "AdapterState", "FolderAdapterLoader", "Lifecycle",
           "TieredAdapterStore", "build_adapter_loader", "open_source"]

"""The adapter store: sources by URI, admission checks, and the host and disk cache tiers.

`build_adapter_loader(config, shapes, device)` builds the engine's `AdapterLoader` (the protocol,
`store.loader`) for a config: the `TieredAdapterStore` (the default, `adapter_store="tiered"`), or
the plain `FolderAdapterLoader` with `adapter_store="folder"`. The caller wires it into the engine
(`engine.factory.build_engine`). See docs/adapter-store.md.

Importing this package imports no torch: the names below load their module on first use, so pure
parts (`store.policy`, `store.loader`, `store.lifecycle`) are importable without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lora_cluster.adapter_format import ModelShapes
    from lora_cluster.config import EngineConfig
    from lora_cluster.store.lifecycle import TRANSITIONS, AdapterState, Lifecycle
    from lora_cluster.store.loader import AdapterLoader
    from lora_cluster.store.sources import AdapterInfo, open_source
    from lora_cluster.store.store import TieredAdapterStore

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "TRANSITIONS": "lora_cluster.store.lifecycle",
    "AdapterState": "lora_cluster.store.lifecycle",
    "Lifecycle": "lora_cluster.store.lifecycle",
    "AdapterInfo": "lora_cluster.store.sources",
    "open_source": "lora_cluster.store.sources",
    "TieredAdapterStore": "lora_cluster.store.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_adapter_loader(config: EngineConfig, shapes: ModelShapes, device: torch.device) -> AdapterLoader:
    """The engine's default adapter loader for `config` (see the module docstring)."""
    if config.adapter_store == "folder":
        from lora_cluster.store.folder_loader import FolderAdapterLoader

        return FolderAdapterLoader(config.adapter_source, shapes, config.max_lora_rank,
                                   max_merged_adapters=config.max_merged_adapters,
                                   merge_seed=config.merge_seed)
    from lora_cluster.store.store import TieredAdapterStore

    return TieredAdapterStore.from_config(config, shapes, device)


__all__ = ["TRANSITIONS", "AdapterInfo", "AdapterState", "Lifecycle", "TieredAdapterStore",
           "build_adapter_loader", "open_source"]

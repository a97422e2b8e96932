"""An engine wired to the adapter store its config names: the one place callers build one from.

`Engine` receives its `EnginePort` and never builds one (`store.ports`). `build_engine` takes
`Engine`'s arguments and, unless the caller passes its own `adapter_loader`, wires
`store.build_adapter_loader`: the tiered adapter store of `adapter_source` (the default,
`adapter_store="tiered"`) or the plain folder loader (`adapter_store="folder"`), built once the base
model's shapes and device are known.
"""

from __future__ import annotations

from lora_cluster.config import EngineConfig
from lora_cluster.engine.llm_engine import Engine, LoaderFactory
from lora_cluster.store import build_adapter_loader
from lora_cluster.store.ports import EnginePort


def build_engine(
    model: str | None = None,
    adapter_source: str | list[str] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    *,
    config: EngineConfig | None = None,
    adapter_loader: EnginePort | LoaderFactory | None = None,
    **overrides: object,
) -> Engine:
    """`Engine(model, adapter_source, max_loras, max_lora_rank, config=config, **overrides)` whose
    loader is `adapter_loader`, or (None) the adapter store of its config."""
    return Engine(model, adapter_source, max_loras, max_lora_rank, config=config,
                  adapter_loader=build_adapter_loader if adapter_loader is None else adapter_loader,
                  **overrides)

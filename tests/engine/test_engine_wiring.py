"""The caller wires the adapter store into the engine (the pure policies both run import without torch:
tests/project/test_layering.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lora_cluster.engine import Engine, build_engine
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.folder_loader import FolderAdapterLoader

if TYPE_CHECKING:
    import torch

    from lora_cluster.adapter_format import ModelShapes
    from lora_cluster.config import EngineConfig

def test_the_engine_is_given_its_loader() -> None:
    with pytest.raises(TypeError, match="'loader'"):  # among its other parts: `build_engine` builds them
        Engine(model="unused")  # type: ignore[call-arg]


def test_build_engine_wires_the_store_its_config_names(demo_model_dir: Path, demo_adapters_dir: Path,
                                                      tmp_path: Path) -> None:
    tiered = build_engine(model=str(demo_model_dir), adapter_source=str(demo_adapters_dir), max_loras=2,
                          disk_cache_dir=str(tmp_path / "disk"))
    folder = build_engine(model=str(demo_model_dir), adapter_source=str(demo_adapters_dir), max_loras=2,
                          adapter_store="folder")
    try:
        assert isinstance(tiered.loader, TieredAdapterStore), "the tiered store is the default loader"
        assert isinstance(folder.loader, FolderAdapterLoader), "adapter_store='folder': the folder loader"
    finally:
        tiered.close()
        folder.close()


def test_a_loader_the_caller_passes_is_the_engines(demo_model_dir: Path, demo_adapters_dir: Path) -> None:
    made: list[FolderAdapterLoader] = []

    def factory(config: EngineConfig, shapes: ModelShapes, device: torch.device) -> FolderAdapterLoader:
        made.append(FolderAdapterLoader([str(demo_adapters_dir)], shapes, config.max_lora_rank))
        return made[-1]

    engine = build_engine(model=str(demo_model_dir), max_loras=2, adapter_loader=factory)
    try:
        assert made and engine.loader is made[0], "the engine serves from the loader its caller built"
    finally:
        engine.close()

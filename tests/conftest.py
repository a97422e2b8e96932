"""Shared test fixtures and fakes: the one place for them (add new ones here, keep each short)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_cluster.demo import DemoZoo, build_demo_zoo


@pytest.fixture(scope="session")
def demo_zoo(tmp_path_factory: pytest.TempPathFactory) -> DemoZoo:
    """The tiny demo zoo (16 adapters a0..a15, seed 0), built once per test session. Treat as read-only."""
    return build_demo_zoo(tmp_path_factory.mktemp("demo") / "zoo", num_adapters=16, size="tiny", seed=0)


@pytest.fixture(scope="session")
def demo_model_dir(demo_zoo: DemoZoo) -> Path:
    """Folder of the tiny demo base model (config, safetensors, tokenizer)."""
    return demo_zoo.model_dir


@pytest.fixture(scope="session")
def demo_adapters_dir(demo_zoo: DemoZoo) -> Path:
    """Folder holding the demo adapters, one sub-folder per adapter id."""
    return demo_zoo.adapters_dir

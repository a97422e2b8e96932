"""The test suite never writes into the user's ~/.cache/lora-cluster (conftest points every default cache
folder into a temp folder, and fails any test after which that folder changed)."""

from __future__ import annotations

from pathlib import Path

from conftest import REAL_CACHE, cache_fingerprint

from lora_cluster.config import ServeConfig
from lora_cluster.store.cold_tiers import default_disk_cache_dir


def test_default_cache_folders_are_in_the_sessions_temp_folder(private_cache_home: Path):
    demo_dir = Path(ServeConfig().demo_dir)
    disk_dir = default_disk_cache_dir()
    assert demo_dir.is_relative_to(private_cache_home), f"demo zoo default: {demo_dir}"
    assert disk_dir.is_relative_to(private_cache_home), f"disk tier default: {disk_dir}"
    assert not demo_dir.is_relative_to(REAL_CACHE), "the demo zoo's default is not the user's cache"
    assert not disk_dir.is_relative_to(REAL_CACHE), "the disk tier's default is not the user's cache"


def test_the_guard_notices_a_write_into_a_cache_folder(tmp_path: Path):
    folder = tmp_path / "lora-cluster"
    empty = cache_fingerprint(folder)
    (folder / "demo-zoo").mkdir(parents=True)
    created = cache_fingerprint(folder)
    (folder / "demo-zoo" / "manifest.json").write_text("{}")
    assert created != empty, "creating the folder changes its fingerprint"
    assert cache_fingerprint(folder) != created, "writing a file below it changes its fingerprint"

"""Where the release state is kept by default (`release_state_uri: auto`, `releases.state_location`):
the first writable folder adapter source, else (one ingress replica) the disk tier's folder, else
memory with one WARNING; explicit values are kept as given. Real folders under tmp_path; the last
tests run an ingress app in process (no Ray)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from app_client import FakeDispatcher, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.releases.state_location import AUTO, locate_state

S3 = "s3://bucket/zoo"


def test_explicit_values_are_kept_with_their_kind():
    found = {uri: (loc.uri, loc.kind) for uri in ("", "/srv/state", "file:///srv/state", "s3://b/p")
             for loc in [locate_state(uri, ["/zoo"], "/disk", several_ingresses=False)]}
    on_s3 = locate_state("adapter_source", [S3], "/disk", several_ingresses=False)
    assert found[""] == ("", "memory"), "empty is the ingress's memory, as asked"
    assert found["/srv/state"] == ("/srv/state", "folder"), "a folder is kept as given"
    assert found["file:///srv/state"] == ("file:///srv/state", "folder"), "file:// is a folder"
    assert found["s3://b/p"] == ("s3://b/p", "s3"), "an s3:// prefix is S3"
    assert (on_s3.uri, on_s3.kind) == ("adapter_source", "s3"), "adapter_source under an S3 source is S3"


def test_auto_picks_the_first_writable_folder_source(tmp_path):
    first, second = tmp_path / "zoo-a", tmp_path / "zoo-b"
    first.mkdir()
    second.mkdir()
    location = locate_state(AUTO, [S3, "hf://org/repo", str(first), str(second)], str(tmp_path / "disk"),
                            several_ingresses=True)
    assert (location.uri, location.kind) == (str(first / ".lora-cluster"), "folder"), (
        f"the .lora-cluster folder under the first local folder source: {location}")
    assert not (first / ".lora-cluster").exists(), "nothing is written before the state's first write"


def test_auto_skips_a_folder_source_it_cannot_write_into(tmp_path):
    missing, blocked, usable = tmp_path / "missing", tmp_path / "blocked", tmp_path / "usable"
    blocked.mkdir()
    (blocked / ".lora-cluster").write_text("a file where the state's folder would go")
    usable.mkdir()
    sources = [str(missing), f"file://{blocked}", str(usable)]
    location = locate_state(AUTO, sources, None, several_ingresses=False)
    assert location.uri == str(usable / ".lora-cluster"), (
        f"a missing source and one whose .lora-cluster is not a folder are skipped: {location}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_auto_skips_a_read_only_folder_source(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        location = locate_state(AUTO, [str(read_only)], str(tmp_path / "disk"), several_ingresses=False)
    finally:
        read_only.chmod(0o755)
    assert location.uri == str(tmp_path / "disk" / ".lora-cluster"), f"read-only, skipped: {location}"


def test_auto_without_a_folder_source_uses_the_disk_tier_folder_with_one_ingress(tmp_path):
    disk = tmp_path / "cache" / "adapters"  # not created yet: the disk tier creates it on first use
    location = locate_state(AUTO, [S3], str(disk), several_ingresses=False)
    assert (location.uri, location.kind) == (str(disk / ".lora-cluster"), "folder"), (
        f"the disk tier folder keeps the state of the one ingress: {location}")


def test_auto_keeps_several_ingresses_off_the_node_local_disk_tier(tmp_path):
    location = locate_state(AUTO, [S3], str(tmp_path / "disk"), several_ingresses=True)
    assert (location.uri, location.kind) == ("", "memory"), f"no shared disk tier: {location}"
    assert "node-local" in location.reason, f"the reason says why: {location.reason}"


def test_auto_without_any_writable_place_is_memory(tmp_path):
    location = locate_state(AUTO, [S3], None, several_ingresses=False)
    assert (location.uri, location.kind) == ("", "memory"), f"no folder source, no disk tier: {location}"


def test_the_shipped_default_is_auto():
    assert ServeConfig.model_fields["releases"].default_factory().release_state_uri == AUTO, (  # type: ignore[misc]
        "release_state_uri defaults to auto")


def app_config(source: Path, **extra: object) -> ServeConfig:
    return ServeConfig(model="base", adapter_source=[str(source)], release_state_uri=AUTO, **extra)


async def test_by_default_a_release_is_kept_beside_the_adapters_and_outlives_the_ingress(tmp_path):
    source = tmp_path / "zoo"
    source.mkdir()
    first = {"lora_name": "fin", "lora_path": "/zoo/fin-1"}
    async with serving(FakeTokenizer(), FakeDispatcher(), app_config(source)) as client:
        await client.post("/v1/load_lora_adapter", json=first)
        created = (await client.post("/v1/adapters/fin/releases", json={"lora_path": "/zoo/fin-2"})).json()
    async with serving(FakeTokenizer(), FakeDispatcher(), app_config(source)) as client:
        listed = (await client.get("/v1/adapters/fin/releases")).json()
    assert (source / ".lora-cluster" / "releases.json").is_file(), "the state is a file beside the adapters"
    assert listed["state_store"] == "folder", f"the releases API names where they are kept: {listed}"
    assert [r["id"] for r in listed["data"]] == [created["id"]], "a new ingress finds the release"


async def test_by_default_with_nowhere_to_write_the_releases_are_in_memory_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lora_cluster.serve.http.context"):
        async with serving(FakeTokenizer(), FakeDispatcher(),
                           ServeConfig(model="base", adapter_source=[S3], adapter_store="folder",
                                       release_state_uri=AUTO)) as client:
            await client.post("/v1/load_lora_adapter", json={"lora_name": "fin", "lora_path": "/zoo/fin-1"})
            listed = (await client.get("/v1/adapters/fin/releases")).json()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert listed["state_store"] == "memory", f"the releases API says the state is in memory: {listed}"
    assert len(warnings) == 1 and "memory" in warnings[0], f"one WARNING at the ingress's start: {warnings}"

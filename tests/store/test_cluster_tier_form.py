"""What the cluster tier publishes: each node's stored form (the source's files, or with `host_int8` the
int8 host copy, encrypted when the weights were), checksummed, counted against the tier's budget at its
stored size, and taken as it is by a receiving node, which never re-quantizes from full precision.

Real stores (`TieredAdapterStore`, a remote source over a folder, disk caches in tmp_path) and the tier
actor's real body (`ClusterTierIndex`: form matching, budget); only Ray's object store is replaced, by a
dict in this process (`InProcessTier`): the unit tier starts no Ray.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_sources import FolderAsRemote

from lora_cluster.adapter_format import WEIGHTS_FILE, load_peft_adapter
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.serve.replica.cluster_tier import ClusterTierIndex
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE, encrypt_adapter_folder
from lora_cluster.store.int8_form import INT8_ENC_FILE, INT8_FILE, encode
from lora_cluster.store.quant import quantize

KEY = bytes(range(32))


class InProcessTier:
    """A node's `ClusterTierPort` over a shared `ClusterTierIndex`, objects in a dict (Ray's object
    store's stand-in); publication runs at once, checksums are verified on every fetch."""

    def __init__(self, index: ClusterTierIndex, objects: dict[int, dict[str, bytes]], node_id: str):
        self.index, self.objects, self.node_id = index, objects, node_id
        self.ids = itertools.count(len(objects))

    def fetch_into(self, adapter_id: str, dest: Path, form: str) -> dict[str, str] | None:
        found = self.index.locate(adapter_id, self.node_id, form)
        if found is None:
            return None
        holder, boxed, digests = found
        files = self.objects[boxed[0]]
        ok = all(hashlib.sha256(files[n]).hexdigest() == d for n, d in digests.items())
        if ok:
            for name, data in files.items():
                (dest / name).write_bytes(data)
        self.index.copy_ended(adapter_id, holder, self.node_id, ok)
        return dict(digests) if ok else None

    def publish(self, adapter_id: str, files: dict[str, bytes], form: str) -> None:
        nbytes = sum(map(len, files.values()))
        if self.index.claim(adapter_id, nbytes):
            ref = next(self.ids) + 1000
            self.objects[ref] = dict(files)
            digests = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
            self.index.publish(adapter_id, self.node_id, [ref], nbytes, digests, form)  # type: ignore[list-item]


@pytest.fixture(scope="module")
def shapes(demo_model_dir: Path) -> Any:
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


def node(source: Path, shapes: Any, tmp_path: Path, name: str, index: ClusterTierIndex,
         objects: dict[int, dict[str, bytes]], **options: Any) -> tuple[TieredAdapterStore, FolderAsRemote]:
    remote = FolderAsRemote(source)
    policy = AdmissionPolicy(shapes, 64, key=options.pop("key", None),
                             require_encryption=options.pop("require_encryption", False))
    store = TieredAdapterStore([remote], policy, disk_cache_dir=tmp_path / name,
                               cluster_tier=InProcessTier(index, objects, name), **options)
    return store, remote


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x, y)


def test_an_int8_node_publishes_its_int8_copy_and_a_peer_takes_it_as_is(demo_zoo, shapes, tmp_path) -> None:
    index, objects = ClusterTierIndex(1 << 30), {}
    one, source_one = node(demo_zoo.adapters_dir, shapes, tmp_path, "one", index, objects, host_int8=True)
    two, source_two = node(demo_zoo.adapters_dir, shapes, tmp_path, "two", index, objects, host_int8=True)
    float_bytes = (demo_zoo.adapters_dir / "a2" / WEIGHTS_FILE).stat().st_size
    one.load("a2")
    assert source_one.fetches == 1, "node one fetched a2 from its source"
    (published,) = objects.values()
    assert set(published) == {"adapter_config.json", INT8_FILE}, "node one published the int8 form"
    assert index.tier.bytes == sum(map(len, published.values())), "the budget counts the published bytes"
    assert index.tier.bytes < 0.3 * float_bytes, (
        f"the tier holds a2's int8 bytes ({index.tier.bytes}), not its float bytes ({float_bytes})")
    got = two.load("a2")
    assert source_two.fetches == 0, "node two never read a2's full-precision weights"
    assert two.stats.snapshot()["cluster"]["loads"] == 1, "node two copied a2 through the cluster tier"
    on_disk = sorted(p.name for p in (tmp_path / "two").rglob("*.safetensors*"))
    assert on_disk == [INT8_FILE], "node two's disk tier keeps the int8 form it received"
    mine = one.host.get("a2")
    assert mine is not None, "node one's host tier holds a2"
    assert all(same(got.a[k], mine.a[k]) and same(got.b[k], mine.b[k]) for k in mine.a), (
        "node two serves exactly node one's int8 copy, dequantized: nothing was quantized again")
    assert two.host.nbytes("a2") == one.host.nbytes("a2"), "node two's host tier keeps the int8 copy"
    two.host.remove("a2")
    again = two.load("a2")
    assert (source_two.fetches, two.stats.snapshot()["cluster"]["loads"]) == (0, 1), (
        "node two reloads a2 from its own disk copy of the int8 form")
    assert all(same(again.a[k], mine.a[k]) for k in mine.a), "the disk copy gives the same weights"


def test_encrypted_adapters_are_published_encrypted_in_int8(demo_zoo, shapes, tmp_path) -> None:
    encrypted = tmp_path / "encrypted"
    encrypt_adapter_folder(demo_zoo.adapters_dir / "a3", encrypted / "a3", KEY)
    index, objects = ClusterTierIndex(1 << 30), {}
    one, _ = node(encrypted, shapes, tmp_path, "one", index, objects, host_int8=True, key=KEY)
    two, source_two = node(encrypted, shapes, tmp_path, "two", index, objects, host_int8=True, key=KEY,
                           require_encryption=True)
    one.load("a3")
    (published,) = objects.values()
    assert set(published) == {"adapter_config.json", INT8_ENC_FILE}, "the int8 form is published encrypted"
    plain = encode(quantize(one.host.get("a3")), b"", None)[INT8_FILE]  # type: ignore[arg-type]
    assert plain[:64] not in published[INT8_ENC_FILE], "no clear int8 bytes leave the node"
    got = two.load("a3")
    assert source_two.fetches == 0, "node two, which requires encryption, took the encrypted int8 copy"
    assert got.rank == one.load("a3").rank, "node two serves a3"


def test_a_peer_copy_failing_admission_is_refused_and_the_source_serves(demo_zoo, shapes, tmp_path) -> None:
    index, objects = ClusterTierIndex(1 << 30), {}
    two, source_two = node(demo_zoo.adapters_dir, shapes, tmp_path, "two", index, objects, host_int8=True)
    bad = quantize(load_peft_adapter("a4", demo_zoo.adapters_dir / "a4", shapes, 64))
    bad.a[next(iter(bad.a))].scale[0] = float("nan")  # checksummed as published, and not servable
    config = (demo_zoo.adapters_dir / "a4" / "adapter_config.json").read_bytes()
    InProcessTier(index, objects, "elsewhere").publish("a4", encode(bad, config, None), "int8")
    got = two.load("a4")
    assert torch.isfinite(got.a[next(iter(bad.a))]).all(), "node two serves finite weights"
    assert source_two.fetches == 1, "node two refused the copy and fetched a4 from its source"
    assert two.stats.snapshot()["cluster"]["failures"] == 1, "the refused copy is counted"


def test_a_node_asks_only_for_its_own_form(demo_zoo, shapes, tmp_path) -> None:
    index, objects = ClusterTierIndex(1 << 30), {}
    floats, _ = node(demo_zoo.adapters_dir, shapes, tmp_path, "floats", index, objects)
    int8, source_int8 = node(demo_zoo.adapters_dir, shapes, tmp_path, "int8", index, objects, host_int8=True)
    floats.load("a5")
    (published,) = objects.values()
    assert WEIGHTS_FILE in published, "a float node publishes the source's files"
    int8.load("a5")
    assert source_int8.fetches == 1, "an int8 node does not take the files form: its source serves"


def test_a_float_node_publishes_encrypted_files_as_the_source_holds_them(demo_zoo, shapes, tmp_path) -> None:
    encrypted = tmp_path / "encrypted"
    shutil.rmtree(encrypted, ignore_errors=True)
    encrypt_adapter_folder(demo_zoo.adapters_dir / "a6", encrypted / "a6", KEY)
    index, objects = ClusterTierIndex(1 << 30), {}
    one, _ = node(encrypted, shapes, tmp_path, "one", index, objects, key=KEY)
    two, source_two = node(encrypted, shapes, tmp_path, "two", index, objects, key=KEY)
    one.load("a6")
    (published,) = objects.values()
    assert ENC_WEIGHTS_FILE in published and WEIGHTS_FILE not in published, "published encrypted"
    two.load("a6")
    assert source_two.fetches == 0, "node two copied the encrypted files through the tier"

"""The adapter store's tiers and sources without S3: local folders with checksums, the hub cache
offline, the disk cache's crash safety, int8 host copies, pinning and prefetch, config and CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import GREEDY
from remote_sources import FolderAsRemote, populate_hf_cache

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.cli import main
from lora_cluster.config import EngineConfig, build_config
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import (
    AdapterBaseModelError,
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterNotFoundError,
    AdapterRankError,
    ConfigError,
)
from lora_cluster.store import AdapterState, TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy, admit_folder
from lora_cluster.store.checksum import write_checksums
from lora_cluster.store.crypto import encrypt_adapter_folder
from lora_cluster.store.disk_cache import DiskCache
from lora_cluster.store.quant import dequantize, quantize


@pytest.fixture(scope="module")
def shapes(demo_model_dir: Path):
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


def store_for(sources, shapes, **options) -> TieredAdapterStore:
    policy = AdmissionPolicy(shapes, options.pop("max_rank", 64), **options.pop("policy", {}))
    return TieredAdapterStore(sources, policy, **options)


def copy_adapter(demo_zoo, aid: str, dst: Path) -> Path:
    shutil.copytree(demo_zoo.adapters_dir / aid, dst)
    return dst


# ----- local folders -------------------------------------------------------------------------


def test_local_folder_checksums_sidecars_and_errors(demo_zoo, shapes, tmp_path):
    root = tmp_path / "src"
    ok_dir = copy_adapter(demo_zoo, "a0", root / "ok")
    write_checksums(ok_dir, ["adapter_config.json", "adapter_model.safetensors"])
    bad = copy_adapter(demo_zoo, "a0", root / "bad")
    (bad / "adapter_model.safetensors.sha256").write_text("0" * 64 + "\n")
    garbled = copy_adapter(demo_zoo, "a0", root / "garbled")
    (garbled / "checksums.sha256").write_text("not a checksum line\n")
    store = store_for([str(root), f"file://{demo_zoo.adapters_dir}"], shapes)
    ok = store.load("ok")
    want = load_peft_adapter("a0", root / "ok", shapes, 64)
    assert torch.equal(ok.a[(0, "q_proj")], want.a[(0, "q_proj")]), "checksummed weights load unchanged"
    with pytest.raises(AdapterIntegrityError, match=r"'bad'.*sha256 mismatch"):
        store.load("bad")
    with pytest.raises(AdapterIntegrityError, match=r"'garbled'.*line 1"):
        store.load("garbled")
    assert store.load("a5").rank == 32, "an id only the second source offers is served from it"
    with pytest.raises(AdapterNotFoundError, match=r"'zz'.*not found in"):
        store.load("zz")
    assert store.state("ok") is AdapterState.IN_HOST, "a loaded adapter is IN_HOST"
    assert store.state("bad") is AdapterState.FAILED, "a refused adapter is FAILED"
    listed = {i.adapter_id: i for i in store.describe_adapters()}
    missing = {"ok", "bad", "a0", "a15"} - set(listed)
    assert missing == set(), f"both sources' adapters are listed, missing {missing}"
    assert listed["ok"].sha256 is not None, "the sha256 from checksums.sha256 is listed"
    assert listed["a2"].rank == 32, "the listing reads the rank from the config"
    assert listed["a2"].size_bytes > 200_000, "the listing reports the size of the weights"


def test_base_model_check_and_rank(demo_zoo, shapes, tmp_path, caplog):
    other = copy_adapter(demo_zoo, "a0", tmp_path / "src" / "other")
    config = json.loads((other / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "org/not-it"
    (other / "adapter_config.json").write_text(json.dumps(config))
    strict = store_for([str(tmp_path / "src")], shapes, policy={"base_model": "/models/tiny",
                                                               "base_model_check": "strict"})
    with pytest.raises(AdapterBaseModelError, match=r"'other'.*'org/not-it'"):
        strict.load("other")
    warn = store_for([str(tmp_path / "src")], shapes, policy={"base_model": "/models/tiny"})
    assert warn.load("other").rank == 8, "base_model_check=warn still serves the adapter"
    assert "org/not-it" in caplog.text, "base_model_check=warn logs the declared base model"
    with pytest.raises(AdapterRankError, match="max_lora_rank=16"):
        store_for([str(demo_zoo.adapters_dir)], shapes, max_rank=16).load("a2")


def _break(demo_zoo, folder: Path, fault: str) -> None:
    """Make `folder` an adapter with `fault` (or no folder at all)."""
    if fault == "missing-folder":
        return
    copy_adapter(demo_zoo, "a2" if fault == "rank-too-high" else "a0", folder)
    weights = folder / "adapter_model.safetensors"
    if fault in ("no-weights", "pickle-only"):
        weights.unlink()
    if fault == "pickle-only":
        (folder / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    if fault == "corrupt":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    if fault == "no-config":
        (folder / "adapter_config.json").unlink()


REFUSALS = {  # fault -> (error, reason); a2 has rank 32, the policy allows 16
    "missing-folder": (AdapterNotFoundError, "no adapter folder"),
    "no-config": (AdapterNotFoundError, "no adapter_config.json in the adapter folder"),
    "no-weights": (AdapterFormatError, "no adapter_model.safetensors in the adapter folder"),
    "pickle-only": (AdapterFormatError, "adapter_model.bin is pickle; only adapter_model.safetensors"),
    "corrupt": (AdapterFormatError, "adapter_model.safetensors is corrupt"),
    "rank-too-high": (AdapterRankError, "rank 32 exceeds max_lora_rank=16"),
}


@pytest.mark.parametrize("fault", sorted(REFUSALS))
def test_plain_loader_and_admission_refuse_alike_without_server_paths(demo_zoo, shapes, tmp_path, fault):
    error, reason = REFUSALS[fault]
    folder = tmp_path / "adapters" / fault
    _break(demo_zoo, folder, fault)
    with pytest.raises(error) as plain:
        load_peft_adapter(fault, folder, shapes, 16)
    with pytest.raises(error) as admitted:
        admit_folder(fault, folder, AdmissionPolicy(shapes, 16))
    assert f"adapter {fault!r}: {reason}" in str(plain.value), "the plain loader names the adapter and reason"
    assert type(admitted.value) is type(plain.value), "admission refuses with the plain loader's error class"
    assert str(admitted.value) == str(plain.value), "admission refuses with the plain loader's message"
    assert str(tmp_path) not in str(plain.value), "the message does not reveal the server's folder"


def test_encrypted_local_adapter_and_require_encryption(demo_zoo, shapes, tmp_path, monkeypatch):
    key = bytes(range(32))
    encrypt_adapter_folder(demo_zoo.adapters_dir / "a4", tmp_path / "enc" / "a4", key)
    copy_adapter(demo_zoo, "a0", tmp_path / "enc" / "plain")
    monkeypatch.setenv("MY_KEY", key.hex())
    config = EngineConfig(model=str(demo_zoo.model_dir), adapter_source=[str(tmp_path / "enc")],
                          encryption_key_env="MY_KEY", require_encryption=True)
    store = TieredAdapterStore.from_config(config, shapes, torch.device("cpu"))
    got, want = store.load("a4"), load_peft_adapter("a4", demo_zoo.adapters_dir / "a4", shapes, 64)
    assert all(torch.equal(got.b[k], want.b[k]) for k in want.b), "decrypted weights equal the plaintext ones"
    with pytest.raises(AdapterIntegrityError, match=r"'plain'.*require_encryption"):
        store.load("plain")
    key_file = tmp_path / "key"
    key_file.write_bytes(key)  # a mounted secret with raw bytes wins over the env variable
    monkeypatch.setenv("MY_KEY", "00" * 32)
    with_file = config.model_copy(update={"encryption_key_file": str(key_file)})
    from_file = TieredAdapterStore.from_config(with_file, shapes, torch.device("cpu"))
    assert from_file.load("a4").rank == want.rank, "the key file wins over the env key"


def test_cli_encrypt_tree_and_errors(demo_zoo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORA_CLUSTER_ADAPTER_KEY", "ab" * 32)
    assert main(["encrypt", str(demo_zoo.adapters_dir), str(tmp_path / "all")]) == 0, "a tree encrypts"
    assert len(capsys.readouterr().out.splitlines()) == 16, "one line per encrypted adapter"
    assert (tmp_path / "all" / "a15" / "adapter_model.safetensors.enc").is_file(), \
        "each adapter keeps its relative path under the output folder"
    assert main(["encrypt", str(demo_zoo.adapters_dir / "a0"), str(tmp_path / "all")]) == 1, \
        "encrypting into a folder that is not empty fails"
    monkeypatch.delenv("LORA_CLUSTER_ADAPTER_KEY")
    assert main(["encrypt", str(demo_zoo.adapters_dir / "a0"), str(tmp_path / "x")]) == 2, \
        "encrypting without a key is a usage error"
    assert "no key" in capsys.readouterr().err, "the CLI says that no key is configured"


# ----- hub cache (offline) ---------------------------------------------------------------------


def test_hub_source_offline_from_cache(demo_zoo, shapes, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    files = {name: (demo_zoo.adapters_dir / "a3" / name).read_bytes()
             for name in ("adapter_config.json", "adapter_model.safetensors")}
    populate_hf_cache(cache, "acme/solo-adapter", files)
    populate_hf_cache(cache, "acme/collection", {f"{aid}/{n}": (demo_zoo.adapters_dir / aid / n).read_bytes()
                                                 for aid in ("a1", "a6") for n in files}, revision="v1")
    tampered = populate_hf_cache(cache, "acme/tampered", files)
    blob = (tampered / "adapter_model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = store_for(["hf://acme/solo-adapter", "hf://acme/collection@v1", "hf://acme/tampered",
                       "hf://acme/absent"], shapes)
    assert store.load("solo-adapter").rank == 8, "a root adapter is served by the repo's name"
    assert [(o.name, n.name) for a, o, n in store.lifecycle.log if a == "solo-adapter"] == [
        ("REMOTE", "ON_DISK"), ("ON_DISK", "IN_HOST")], "a hub adapter climbs from REMOTE one tier a step"
    want = load_peft_adapter("a6", demo_zoo.adapters_dir / "a6", shapes, 64)
    assert torch.equal(store.load("a6").a[(1, "q_proj")], want.a[(1, "q_proj")]), \
        "a repo sub-folder at a revision serves the adapter's weights"
    with pytest.raises(AdapterIntegrityError, match=r"'tampered'.*sha256 mismatch"):
        store.load("tampered")
    with pytest.raises(AdapterNotFoundError, match=r"'a9'.*not found in the configured adapter sources"):
        store.load("a9")
    assert store.list_adapters() == ["solo-adapter", "a1", "a6", "tampered"], \
        "offline, the listing shows what the hub cache holds, in source order"
    locations = {i.adapter_id: i.location for i in store.describe_adapters()}
    assert locations["a6"] == "hf://acme/collection@v1/a6", "the location keeps the revision and sub-folder"
    store.register("mine", "hf://acme/collection@v1/a1")
    assert store.load("mine").rank == 16, "a hub location can be registered under a new id"


# ----- disk cache --------------------------------------------------------------------------


def _fetcher(src: Path, names=("adapter_config.json", "adapter_model.safetensors")):
    from lora_cluster.store.checksum import sha256_file

    def fetch(dest: Path) -> dict[str, str]:
        for name in names:
            shutil.copyfile(src / name, dest / name)
        return {name: sha256_file(dest / name) for name in names}

    return fetch


def test_disk_cache_is_atomic_bounded_and_survives_restart(demo_zoo, tmp_path):
    root = tmp_path / "disk"
    cache = DiskCache(root, 400_000)
    for aid in ("a0", "a1", "a2"):  # 16 KB + 60 KB + 267 KB fit; a 4th large one evicts
        with cache.fill(aid, aid, _fetcher(demo_zoo.adapters_dir / aid)) as entry:
            assert not entry.transient, f"{aid} fits the budget and is kept"
            assert entry.path.parent == root / "entries", f"{aid} is committed under entries/"
    with cache.open("a0"):
        with cache.fill("a5", "a5", _fetcher(demo_zoo.adapters_dir / "a5")) as entry:
            assert not entry.transient, "a5 is admitted by evicting an idle entry"
        assert "a0" in cache, "a leased entry is never the victim"
    assert cache.bytes <= 400_000, f"the cache holds {cache.bytes} bytes, over its budget"
    assert "a2" not in cache, "the idle large entry was evicted for a5"
    assert cache.stats.tiers["disk"].evictions >= 1, "the eviction is counted"

    def crash(dest: Path) -> dict[str, str]:
        (dest / "adapter_model.safetensors").write_bytes(b"half a file")
        raise OSError("connection lost")

    with pytest.raises(OSError), cache.fill("a9", "a9", crash):
        pass
    assert "a9" not in cache, "a failed download is not an entry"
    assert list((root / "staging").iterdir()) == [], "a failed download leaves nothing in staging"

    def huge(dest: Path) -> dict[str, str]:
        (dest / "x").write_bytes(b"0" * 500_000)
        return {"x": "0" * 64}

    with cache.fill("huge", "huge", huge) as e:
        assert e.transient, "a download larger than the budget is not admitted"
        assert e.path.is_dir(), "a download larger than the budget is used once from staging"
    assert not e.path.exists(), "the transient download is deleted after use"

    # a crash mid-commit leaves staging leftovers and an entry without entry.json; a truncated file
    (root / "staging" / "tmp123").mkdir()
    (root / "staging" / "tmp123" / "adapter_model.safetensors").write_bytes(b"partial")
    shutil.copytree(root / "entries" / "a1", root / "entries" / "no-manifest")
    (root / "entries" / "no-manifest" / "entry.json").unlink()
    shutil.copytree(root / "entries" / "a1", root / "entries" / "truncated")
    meta = json.loads((root / "entries" / "truncated" / "entry.json").read_text())
    (root / "entries" / "truncated" / "entry.json").write_text(json.dumps({**meta, "adapter_id": "t"}))
    (root / "entries" / "truncated" / "adapter_model.safetensors").write_bytes(b"short")
    restarted = DiskCache(root, 400_000)
    assert sorted(restarted.keys()) == sorted(cache.keys()), "a restart keeps exactly the committed entries"
    assert list((root / "staging").iterdir()) == [], "a restart wipes staging leftovers"
    assert not (root / "entries" / "truncated").exists(), "a restart deletes an entry with a truncated file"
    assert not (root / "entries" / "no-manifest").exists(), "a restart deletes an entry without entry.json"
    assert restarted.bytes == cache.bytes, "a restart counts the same bytes"
    smaller = DiskCache(root, 50_000)  # the budget shrank between runs: the least recent go
    assert smaller.bytes <= 50_000, f"a smaller budget is enforced at start, got {smaller.bytes} bytes"
    assert len(smaller.keys()) < len(cache.keys()), "entries were evicted to fit the smaller budget"


def test_tampered_disk_copy_is_refetched(demo_zoo, shapes, tmp_path):
    source = FolderAsRemote(demo_zoo.adapters_dir)
    store = store_for([source], shapes, disk_cache_dir=tmp_path / "disk")
    store.load("a1")
    entry = next((tmp_path / "disk" / "entries").iterdir()) / "adapter_model.safetensors"
    data = bytearray(entry.read_bytes())
    data[200] ^= 0x10  # bit rot in the cache, same size
    entry.write_bytes(bytes(data))
    again = store_for([source], shapes, disk_cache_dir=tmp_path / "disk")
    want = load_peft_adapter("a1", demo_zoo.adapters_dir / "a1", shapes, 64)
    assert torch.equal(again.load("a1").a[(0, "k_proj")], want.a[(0, "k_proj")]), \
        "the tampered disk copy is not served"
    assert source.fetches == 2, "the tampered disk copy is fetched again from the source"


# ----- host tier: int8 ---------------------------------------------------------------------


def test_int8_host_copy_error_against_float(demo_zoo, shapes):
    weights = load_peft_adapter("a2", demo_zoo.adapters_dir / "a2", shapes, 64)
    q = quantize(weights)
    back = dequantize(q)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    worst = {}
    for key, a in weights.a.items():
        b = weights.b[key]
        rel = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
        x_in = x[:, : a.shape[1]]
        worst["A"] = max(worst.get("A", 0), rel(back.a[key], a))
        worst["B"] = max(worst.get("B", 0), rel(back.b[key], b))
        worst["BA x"] = max(worst.get("BA x", 0), rel(x_in @ back.a[key].T @ back.b[key].T, x_in @ a.T @ b.T))
    print("int8 relative Frobenius error (worst module):", {k: f"{v:.4%}" for k, v in worst.items()})
    assert q.nbytes < 0.3 * weights.nbytes, "int8 copies take under 30% of the float bytes"
    assert worst["A"] < 0.01, f"int8 A error {worst['A']:.4%} is at most 1%"
    assert worst["B"] < 0.01, f"int8 B error {worst['B']:.4%} is at most 1%"
    assert worst["BA x"] < 0.015, f"int8 LoRA output error {worst['BA x']:.4%} is at most 1.5%"

    store = store_for([str(demo_zoo.adapters_dir)], shapes, host_int8=True)
    first, second = store.load("a2"), store.load("a2")  # the second comes from the int8 host copy
    assert first is not second, "a host hit with host_int8 dequantizes a new float copy"
    assert store.host.bytes == q.nbytes, "the host tier holds the int8 copy"
    error = (second.a[(0, "q_proj")] - first.a[(0, "q_proj")]).abs().max()
    assert error <= first.a[(0, "q_proj")].abs().amax(dim=1).max() / 254 + 1e-7, \
        "the dequantized copy is within half an int8 step of the float weights"


# ----- engine wiring: device pinning, usage, preload, promotion, config ---------------------------


def test_engine_pinned_adapter_stays_on_device_and_uses_return_to_zero(make_engine, demo_zoo, shapes,
                                                                       tmp_path):
    store = store_for([str(demo_zoo.adapters_dir)], shapes, max_rank=32, pinned=["a0"],
                      disk_cache_dir=tmp_path / "disk")
    engine = make_engine(adapter_source=None, max_loras=2, max_lora_rank=32, adapter_loader=store)
    assert engine.pool.policy.inner is store.slot_policy(), (
        "the caller's store chooses the device victims (inside adapter rotation's slot policy)"
    )
    store.wait_prefetches()
    assert store.state("a0") is AdapterState.IN_HOST, "pinned adapters are loaded at start"
    engine.generate(["hello"], adapter_ids=["a0"], sampling=GREEDY)
    for batch in (["a1", "a2", "a3"], ["a4", "a5"], ["a6", None, "a7"]):
        outs = engine.generate(["the cat sat"] * len(batch), adapter_ids=batch, sampling=GREEDY)
        assert [o.finish_reason for o in outs] == ["length"] * len(batch), "every request completes"
        assert engine.pool.slot_of("a0") is not None, "the pinned adapter is never the victim"
    assert store.state("a0") is AdapterState.ON_DEVICE, "the pinned adapter ends on the device"
    assert [store.usage.uses(f"a{i}") for i in range(8)] == [0] * 8, "finished requests release their uses"
    snap = store.snapshot()
    assert snap["tiers"]["device"]["evictions"] >= 4, "eight adapters through two slots evict"
    assert snap["states"]["ON_DEVICE"] == 2, "two adapters sit on the device"
    engine.add_request("r", "abc", "a9", GREEDY)
    assert store.usage.uses("a9") == 1, "a queued request counts as a use"
    engine.abort("r")
    assert store.usage.uses("a9") == 0, "an aborted request releases its use"
    engine.close()


def test_queued_adapter_is_not_evicted_from_device(make_engine, demo_zoo, shapes, tmp_path):
    store = store_for([str(demo_zoo.adapters_dir)], shapes, max_rank=32, disk_cache_dir=tmp_path / "disk")
    engine = make_engine(adapter_source=None, max_loras=2, max_lora_rank=32, adapter_loader=store)
    engine.generate(["x", "y"], adapter_ids=["a0", "a1"], sampling=GREEDY)  # both resident, idle
    store.request_started("a0")  # as if a request for a0 were queued
    engine.generate(["z"], adapter_ids=["a2"], sampling=GREEDY)
    assert engine.pool.slot_of("a0") is not None, "the adapter of a queued request stays on the device"
    assert engine.pool.slot_of("a1") is None, "the idle adapter is the victim"
    engine.close()


def test_preload_and_hot_promotion(demo_zoo, shapes):
    clock = [0.0]
    store = store_for([str(demo_zoo.adapters_dir)], shapes, preload=["a3", "a4"], prefetch_min_requests=3,
                      prefetch_window_s=10, clock=lambda: clock[0])
    store.wait_prefetches(timeout=30)
    assert {store.state("a3"), store.state("a4")} == {AdapterState.IN_HOST}
    weights = store.load("a3")
    store.usage.on_device("a3", True)
    store.host.remove("a3")  # host pressure dropped its copy while it sits on the device
    for _ in range(3):
        store.usage.request_started("a3")
    store.wait_prefetches(timeout=30)
    assert "a3" in store.host and store.state("a3") is AdapterState.ON_DEVICE  # promoted back to host
    assert store.usage.priority("a3") > store.usage.priority("a4")
    clock[0] = 100.0  # long after the window: no longer hot, priority decays
    assert not store.usage.tracker.is_hot("a3") and store.usage.priority("a3") < 0.01
    assert weights.rank == 8


def test_config_fields_env_and_validation(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_HOST_CACHE_BYTES", "512MiB")
    monkeypatch.setenv("LORA_CLUSTER_DISK_CACHE_BYTES", "2GB")
    monkeypatch.setenv("LORA_CLUSTER_PINNED", "a0, a1")
    monkeypatch.setenv("LORA_CLUSTER_HOST_INT8", "true")
    config = EngineConfig(model="m", max_loras=4)
    assert (config.host_cache_bytes, config.disk_cache_bytes) == (512 << 20, 2_000_000_000)
    assert config.pinned == ["a0", "a1"] and config.host_int8 and config.adapter_store == "tiered"
    with pytest.raises(ConfigError, match="pinned adapters need fewer than max_loras=2"):
        build_config(EngineConfig, model="m", max_loras=2)
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        build_config(EngineConfig, model="m", host_cache_bytes="lots")

"""The adapter store's tiers and sources without S3: local folders with checksums, the hub cache
offline, the disk cache's crash safety, int8 host copies, pinning and prefetch, config and CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FolderAsRemote, populate_hf_cache

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.cli import main
from lora_cluster.config import EngineConfig, build_config
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.model_loader import load_base_model
from lora_cluster.errors import (
    AdapterBaseModelError,
    AdapterIntegrityError,
    AdapterNotFoundError,
    AdapterRankError,
    ConfigError,
)
from lora_cluster.store import AdapterState, TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.checksum import write_checksums
from lora_cluster.store.crypto import encrypt_adapter_folder
from lora_cluster.store.disk_cache import DiskCache
from lora_cluster.store.quant import dequantize, quantize

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


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
    assert torch.equal(ok.a[(0, "q_proj")], load_peft_adapter("a0", root / "ok", shapes, 64).a[(0, "q_proj")])
    with pytest.raises(AdapterIntegrityError, match=r"'bad'.*sha256 mismatch"):
        store.load("bad")
    with pytest.raises(AdapterIntegrityError, match=r"'garbled'.*line 1"):
        store.load("garbled")
    assert store.load("a5").rank == 32  # second source: first match wins, the rest still serve
    with pytest.raises(AdapterNotFoundError, match=r"'zz'.*not found in"):
        store.load("zz")
    assert store.state("ok") is AdapterState.IN_HOST and store.state("bad") is AdapterState.FAILED
    listed = {i.adapter_id: i for i in store.describe_adapters()}
    assert {"ok", "bad", "a0", "a15"} <= set(listed) and listed["ok"].sha256 is not None
    assert listed["a2"].rank == 32 and listed["a2"].size_bytes > 200_000


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
    assert warn.load("other").rank == 8 and "org/not-it" in caplog.text
    with pytest.raises(AdapterRankError, match="max_lora_rank=16"):
        store_for([str(demo_zoo.adapters_dir)], shapes, max_rank=16).load("a2")


def test_encrypted_local_adapter_and_require_encryption(demo_zoo, shapes, tmp_path, monkeypatch):
    key = bytes(range(32))
    encrypt_adapter_folder(demo_zoo.adapters_dir / "a4", tmp_path / "enc" / "a4", key)
    copy_adapter(demo_zoo, "a0", tmp_path / "enc" / "plain")
    monkeypatch.setenv("MY_KEY", key.hex())
    config = EngineConfig(model=str(demo_zoo.model_dir), adapter_source=[str(tmp_path / "enc")],
                          encryption_key_env="MY_KEY", require_encryption=True)
    store = TieredAdapterStore.from_config(config, shapes, torch.device("cpu"))
    got, want = store.load("a4"), load_peft_adapter("a4", demo_zoo.adapters_dir / "a4", shapes, 64)
    assert all(torch.equal(got.b[k], want.b[k]) for k in want.b)
    with pytest.raises(AdapterIntegrityError, match=r"'plain'.*require_encryption"):
        store.load("plain")
    key_file = tmp_path / "key"
    key_file.write_bytes(key)  # a mounted secret with raw bytes wins over the env variable
    monkeypatch.setenv("MY_KEY", "00" * 32)
    with_file = config.model_copy(update={"encryption_key_file": str(key_file)})
    from_file = TieredAdapterStore.from_config(with_file, shapes, torch.device("cpu"))
    assert from_file.load("a4").rank == want.rank


def test_cli_encrypt_tree_and_errors(demo_zoo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORA_CLUSTER_ADAPTER_KEY", "ab" * 32)
    assert main(["encrypt", str(demo_zoo.adapters_dir), str(tmp_path / "all")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 16
    assert (tmp_path / "all" / "a15" / "adapter_model.safetensors.enc").is_file()
    assert main(["encrypt", str(demo_zoo.adapters_dir / "a0"), str(tmp_path / "all")]) == 1  # not empty
    monkeypatch.delenv("LORA_CLUSTER_ADAPTER_KEY")
    assert main(["encrypt", str(demo_zoo.adapters_dir / "a0"), str(tmp_path / "x")]) == 2
    assert "no key" in capsys.readouterr().err


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
    assert store.load("solo-adapter").rank == 8
    assert [(o.name, n.name) for a, o, n in store.lifecycle.log if a == "solo-adapter"] == [
        ("REMOTE", "ON_DISK"), ("ON_DISK", "IN_HOST")]
    want = load_peft_adapter("a6", demo_zoo.adapters_dir / "a6", shapes, 64)
    assert torch.equal(store.load("a6").a[(1, "q_proj")], want.a[(1, "q_proj")])
    with pytest.raises(AdapterIntegrityError, match=r"'tampered'.*sha256 mismatch"):
        store.load("tampered")
    with pytest.raises(AdapterNotFoundError, match=r"'a9'.*hf://acme/absent"):
        store.load("a9")
    assert store.list_adapters() == ["solo-adapter", "a1", "a6", "tampered"]
    assert {i.adapter_id: i.location for i in store.describe_adapters()}["a6"] == "hf://acme/collection@v1/a6"
    store.register("mine", "hf://acme/collection@v1/a1")
    assert store.load("mine").rank == 16


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
            assert not entry.transient and entry.path.parent == root / "entries"
    with cache.open("a0"):
        with cache.fill("a5", "a5", _fetcher(demo_zoo.adapters_dir / "a5")) as entry:
            assert not entry.transient
        assert "a0" in cache  # leased: never the victim
    assert cache.bytes <= 400_000 and "a2" not in cache and cache.stats.tiers["disk"].evictions >= 1

    def crash(dest: Path) -> dict[str, str]:
        (dest / "adapter_model.safetensors").write_bytes(b"half a file")
        raise OSError("connection lost")

    with pytest.raises(OSError), cache.fill("a9", "a9", crash):
        pass
    assert "a9" not in cache and list((root / "staging").iterdir()) == []
    def huge(dest: Path) -> dict[str, str]:
        (dest / "x").write_bytes(b"0" * 500_000)
        return {"x": "0" * 64}

    with cache.fill("huge", "huge", huge) as e:
        assert e.transient and e.path.is_dir()  # larger than the budget: used once from staging
    assert not e.path.exists()

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
    assert sorted(restarted.keys()) == sorted(cache.keys())
    assert list((root / "staging").iterdir()) == [] and not (root / "entries" / "truncated").exists()
    assert restarted.bytes == cache.bytes
    smaller = DiskCache(root, 50_000)  # the budget shrank between runs: the least recent go
    assert smaller.bytes <= 50_000 and len(smaller.keys()) < len(cache.keys())


def test_tampered_disk_copy_is_refetched(demo_zoo, shapes, tmp_path):
    source = FolderAsRemote(demo_zoo.adapters_dir)
    store = store_for([], shapes, disk_cache_dir=tmp_path / "disk")
    store.sources = [source]
    store.load("a1")
    entry = next((tmp_path / "disk" / "entries").iterdir()) / "adapter_model.safetensors"
    data = bytearray(entry.read_bytes())
    data[200] ^= 0x10  # bit rot in the cache, same size
    entry.write_bytes(bytes(data))
    again = store_for([], shapes, disk_cache_dir=tmp_path / "disk")
    again.sources = [source]
    want = load_peft_adapter("a1", demo_zoo.adapters_dir / "a1", shapes, 64)
    assert torch.equal(again.load("a1").a[(0, "k_proj")], want.a[(0, "k_proj")]) and source.fetches == 2


# ----- host tier: int8 ---------------------------------------------------------------------


def test_int8_host_copy_error_against_float(demo_zoo, shapes):
    weights = load_peft_adapter("a2", demo_zoo.adapters_dir / "a2", shapes, 64)
    q = quantize(weights)
    back = dequantize(q)
    assert q.nbytes < 0.3 * weights.nbytes
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
    assert worst["A"] < 0.01 and worst["B"] < 0.01 and worst["BA x"] < 0.015

    store = store_for([str(demo_zoo.adapters_dir)], shapes, host_int8=True)
    first, second = store.load("a2"), store.load("a2")  # the second comes from the int8 host copy
    assert first is not second and store.host.bytes == q.nbytes
    assert (second.a[(0, "q_proj")] - first.a[(0, "q_proj")]).abs().max() <= \
        first.a[(0, "q_proj")].abs().amax(dim=1).max() / 254 + 1e-7


# ----- engine wiring: device pinning, usage, preload, promotion, config ---------------------------


def test_engine_pinned_adapter_stays_on_device_and_uses_return_to_zero(demo_zoo):
    engine = Engine(str(demo_zoo.model_dir), str(demo_zoo.adapters_dir), max_loras=2, max_lora_rank=32,
                    pinned=["a0"])
    store = engine.loader
    assert isinstance(store, TieredAdapterStore) and engine.pool.policy is store.usage
    store.wait_prefetches()
    assert store.state("a0") is AdapterState.IN_HOST  # pinned adapters are loaded at start
    engine.generate(["hello"], adapter_ids=["a0"], sampling=GREEDY)
    for batch in (["a1", "a2", "a3"], ["a4", "a5"], ["a6", None, "a7"]):
        outs = engine.generate(["the cat sat"] * len(batch), adapter_ids=batch, sampling=GREEDY)
        assert all(o.finish_reason == "length" for o in outs)
        assert engine.pool.slot_of("a0") is not None  # never the victim
    assert store.state("a0") is AdapterState.ON_DEVICE
    assert all(store.usage.uses(f"a{i}") == 0 for i in range(8))
    snap = store.snapshot()
    assert snap["tiers"]["device"]["evictions"] >= 4 and snap["states"]["ON_DEVICE"] == 2
    engine.add_request("r", "abc", "a9", GREEDY)
    assert store.usage.uses("a9") == 1
    engine.abort("r")
    assert store.usage.uses("a9") == 0
    engine.close()


def test_queued_adapter_is_not_evicted_from_device(demo_zoo):
    engine = Engine(str(demo_zoo.model_dir), str(demo_zoo.adapters_dir), max_loras=2, max_lora_rank=32)
    engine.generate(["x", "y"], adapter_ids=["a0", "a1"], sampling=GREEDY)  # both resident, idle
    engine.loader.usage.request_started("a0")  # as if a request for a0 were queued
    engine.generate(["z"], adapter_ids=["a2"], sampling=GREEDY)
    assert engine.pool.slot_of("a0") is not None and engine.pool.slot_of("a1") is None


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

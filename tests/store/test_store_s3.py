"""The adapter store against a real S3-compatible server (moto's server mode on 127.0.0.1).

Listing, cold loads, missing and corrupt objects, the server going away mid-download, retries with
backoff, checksum mismatches, encryption at rest, restart survival of the disk cache, single flight
under 32 concurrent callers, and generation parity with the folder loader.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.cli import main
from lora_cluster.engine import SamplingParams
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import (
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterLoadError,
    AdapterNotFoundError,
)
from lora_cluster.store import AdapterState, TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.crypto import parse_key

BIG = "a2"  # rank 32, all seven projections: ~262 KB of weights, larger than the proxy's cut point


@pytest.fixture(scope="module")
def shapes(demo_model_dir: Path):
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


def make_store(s3, shapes, tmp_path: Path, prefix: str = "zoo", **options) -> TieredAdapterStore:
    key = options.pop("key", None)
    policy = options.pop("policy", None) or AdmissionPolicy(shapes, 64, key=key)
    options.setdefault("disk_cache_dir", tmp_path / "disk")
    options.setdefault("fetch_backoff_s", 0.01)
    return TieredAdapterStore([f"s3://{s3.bucket}/{prefix}"], policy, **options)


def same_weights(a, b) -> bool:
    return a.a.keys() == b.a.keys() and all(torch.equal(a.a[k], b.a[k]) and torch.equal(a.b[k], b.b[k])
                                            for k in a.a)


def disk_files(tmp_path: Path) -> list[str]:
    root = tmp_path / "disk"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def record_gets(store: TieredAdapterStore) -> list[str]:
    """URL paths of every GetObject the store's S3 client sends from now on."""
    keys: list[str] = []
    store.sources[0].client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **kw: keys.append(params["url_path"]))
    return keys


def test_listing_reports_rank_modules_size_checksum_without_weights(s3, demo_zoo, shapes, tmp_path):
    for aid in ("a0", "a1", BIG):
        s3.upload(demo_zoo.adapters_dir / aid, f"zoo/{aid}")
    weights = (demo_zoo.adapters_dir / "a1" / "adapter_model.safetensors").read_bytes()
    digest = hashlib.sha256(weights).hexdigest()
    s3.put("zoo/a1/checksums.sha256", f"{digest}  adapter_model.safetensors\n".encode())
    s3.put("zoo/not-an-adapter/readme.txt", b"hello")
    store = make_store(s3, shapes, tmp_path)
    gets = record_gets(store)
    infos = {i.adapter_id: i for i in store.describe_adapters()}
    assert sorted(infos) == ["a0", "a1", BIG], "every prefix with a config is listed, the others are not"
    assert store.list_adapters() == ["a0", "a1", BIG], "list_adapters names the described ones"
    assert infos[BIG].rank == 32, "the rank comes from adapter_config.json"
    assert infos[BIG].target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                         "v_proj"), "the target modules come from adapter_config.json, sorted"
    folder_bytes = sum(p.stat().st_size for p in (demo_zoo.adapters_dir / BIG).iterdir())
    assert infos[BIG].size_bytes == folder_bytes, "the size is the sum of the adapter's object sizes"
    assert infos[BIG].etag, "the weights object's ETag is reported"
    assert not infos[BIG].encrypted, "a plaintext adapter is not reported as encrypted"
    assert infos["a1"].sha256 == digest, "the sha256 declared in checksums.sha256 is reported"
    assert infos["a0"].sha256 is None, "an adapter without a declared sha256 reports none"
    assert infos["a0"].location == f"s3://{s3.bucket}/zoo/a0", "the location is the adapter's own URI"
    weight_gets = [k for k in gets if k.endswith(".safetensors")]
    assert weight_gets == [], f"listing must not read weights, but got {weight_gets}"
    assert store.state(BIG) is None, "listing is not loading: the adapter has no lifecycle state"


def test_cold_load_fills_disk_and_host_then_survives_restart_without_server(
        s3, s3_proxy, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / BIG, f"zoo/{BIG}")
    s3.point_at(s3_proxy.endpoint)
    store = make_store(s3, shapes, tmp_path)
    weights = store.load(BIG)
    assert same_weights(weights, load_peft_adapter(BIG, demo_zoo.adapters_dir / BIG, shapes, 64)), \
        "weights loaded from S3 equal the folder loader's"
    transitions = [(old.name, new.name) for _, old, new in store.lifecycle.log]
    assert transitions == [("REMOTE", "ON_DISK"), ("ON_DISK", "IN_HOST")], "one tier per step"
    stats = store.snapshot()["tiers"]
    assert stats["host"]["misses"] == 1, "the cold load missed the host tier once"
    assert stats["disk"]["misses"] == 1, "the cold load missed the disk tier once"
    assert stats["source"]["loads"] == 1, "the cold load read the source once"
    assert store.load(BIG) is weights, "a second load returns the host copy"
    assert store.snapshot()["tiers"]["host"]["hits"] == 1, "the second load is a host hit"
    assert any(f.endswith("adapter_model.safetensors") for f in disk_files(tmp_path)), \
        "the weights were kept in the disk cache"

    s3_proxy.kill()  # the object store is gone: a restarted replica serves from its disk cache
    again = make_store(s3, shapes, tmp_path)
    assert same_weights(again.load(BIG), weights), "a restarted store serves the same weights from disk"
    assert again.snapshot()["tiers"]["disk"]["hits"] == 1, "the restarted store found the adapter on disk"
    assert again.state(BIG) is AdapterState.IN_HOST, "the disk copy was loaded into host memory"
    with pytest.raises(AdapterLoadError, match=r"'a0'.*after 4 attempts"):
        again.load("a0")  # not cached, and the server is unreachable


def test_missing_adapter_and_missing_objects(s3, demo_zoo, shapes, tmp_path):
    config = (demo_zoo.adapters_dir / "a0" / "adapter_config.json").read_bytes()
    s3.put("zoo/config-only/adapter_config.json", config)
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/a0")
    store = make_store(s3, shapes, tmp_path)
    with pytest.raises(AdapterNotFoundError, match=r"'nope'.*not found in the configured adapter sources"):
        store.load("nope")
    with pytest.raises(AdapterFormatError, match=r"'config-only'.*no adapter_model.safetensors"):
        store.load("config-only")
    # the weights object disappears between the listing and the download
    located = store.sources[0].locate("a0", "a0")
    s3.client.delete_object(Bucket=s3.bucket, Key="zoo/a0/adapter_model.safetensors")
    store.sources[0].locate = lambda adapter_id, subpath: located
    with pytest.raises(AdapterNotFoundError, match=r"'a0'.*NoSuchKey"):
        store.load("a0")
    assert disk_files(tmp_path) == [], "failed downloads leave nothing in the disk cache"


def test_corrupt_object_is_refused_and_not_cached(s3, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/bad")
    s3.put("zoo/bad/adapter_model.safetensors", b"\x00garbage" * 1000)
    store = make_store(s3, shapes, tmp_path)
    with pytest.raises(AdapterFormatError, match=r"'bad'.*corrupt"):
        store.load("bad")
    assert disk_files(tmp_path) == [], "an adapter that fails admission is dropped from the disk cache"
    assert store.state("bad") is AdapterState.FAILED, "the refused adapter is FAILED"
    assert store.snapshot()["tiers"]["host"]["failures"] == 1, "the failure is counted once"


def test_server_dies_mid_download_clear_error_backoff_no_partial_file(
        s3, s3_proxy, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / BIG, f"zoo/{BIG}")
    s3.point_at(s3_proxy.endpoint)
    s3_proxy.die_after = 64 << 10  # the server goes away 64 KB into the weights
    sleeps: list[float] = []
    store = make_store(s3, shapes, tmp_path, fetch_retries=3, fetch_backoff_s=0.1, sleep=sleeps.append)
    with pytest.raises(AdapterLoadError) as info:
        store.load(BIG)
    message = str(info.value)
    assert f"'{BIG}'" in message, "the error names the adapter"
    assert "adapter_model.safetensors failed after 4 attempts" in message, "it names the file and tries"
    assert len(sleeps) == 3, "3 retries sleep 3 times"
    assert 0.05 <= sleeps[0] < 0.15, f"the first backoff is fetch_backoff_s with jitter, got {sleeps[0]}"
    assert 0.2 <= sleeps[2] < 0.6, f"the third backoff is 4x the first (exponential), got {sleeps[2]}"
    assert disk_files(tmp_path) == [], "nothing half-written is left, in entries/ or staging/"
    assert store.state(BIG) is AdapterState.FAILED, "the adapter is FAILED after the retries ran out"
    assert store.snapshot()["tiers"]["source"]["retries"] == 3, "every retry is counted"


def test_connection_cut_once_is_retried(s3, s3_proxy, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / BIG, f"zoo/{BIG}")
    s3.point_at(s3_proxy.endpoint)
    s3_proxy.cuts = 1  # the first connection is reset 64 KB into a response
    store = make_store(s3, shapes, tmp_path)
    assert same_weights(store.load(BIG), load_peft_adapter(BIG, demo_zoo.adapters_dir / BIG, shapes, 64)), \
        "the retried download yields the complete weights"
    assert store.snapshot()["tiers"]["source"]["retries"] == 1, "the cut connection cost one retry"
    staged = [f for f in disk_files(tmp_path) if f.startswith("staging/")]
    assert staged == [], f"the cut download left no staging files, got {staged}"


def test_checksum_mismatch_metadata_and_manifest(s3, demo_zoo, shapes, tmp_path):
    weights = (demo_zoo.adapters_dir / "a0" / "adapter_model.safetensors").read_bytes()
    good = hashlib.sha256(weights).hexdigest()
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/meta-bad",
              metadata={"adapter_model.safetensors": {"sha256": "0" * 64}})
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/manifest-bad")
    s3.put("zoo/manifest-bad/checksums.sha256", f"{'f' * 64}  adapter_model.safetensors\n".encode())
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/good",
              metadata={"adapter_model.safetensors": {"sha256": good}})
    s3.put("zoo/good/checksums.sha256", f"{good}  adapter_model.safetensors\n".encode())
    store = make_store(s3, shapes, tmp_path)
    with pytest.raises(AdapterIntegrityError, match=r"'meta-bad'.*sha256 mismatch for adapter_model"):
        store.load("meta-bad")
    with pytest.raises(AdapterIntegrityError, match=r"'manifest-bad'.*sha256 mismatch"):
        store.load("manifest-bad")
    assert disk_files(tmp_path) == [], "adapters failing their checksums are not kept on disk"
    assert store.load("good").adapter_id == "good", "matching metadata and manifest digests are accepted"
    strict = make_store(s3, shapes, tmp_path / "other",
                        policy=AdmissionPolicy(shapes, 64, require_checksum=True))
    assert strict.load("good").adapter_id == "good", "require_checksum accepts a declared, matching digest"
    s3.upload(demo_zoo.adapters_dir / "a0", "zoo/a0")
    with pytest.raises(AdapterIntegrityError, match=r"'a0'.*no sha256 is declared"):
        strict.load("a0")


def test_encrypted_adapter_round_trip_and_tampering(s3, demo_zoo, shapes, tmp_path, capsys):
    key_file, enc = tmp_path / "adapter.key", tmp_path / "enc"
    code = main(["encrypt", str(demo_zoo.adapters_dir / "a1"), str(enc / "a1"), "--key-file", str(key_file),
                 "--generate-key"])
    assert code == 0, "lora-cluster encrypt succeeds"
    assert "encrypted:" in capsys.readouterr().out, "the CLI reports what it encrypted"
    assert key_file.stat().st_mode & 0o777 == 0o600, "a generated key file is readable by its owner only"
    assert sorted(p.name for p in (enc / "a1").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors.enc", "checksums.sha256"], \
        "the encrypted folder holds the clear config, the encrypted weights and their checksums"
    plaintext = (demo_zoo.adapters_dir / "a1" / "adapter_model.safetensors").read_bytes()
    assert plaintext[64:128] not in (enc / "a1" / "adapter_model.safetensors.enc").read_bytes(), \
        "the plaintext weights do not appear in the encrypted file"
    s3.upload(enc / "a1", "zoo/secret")
    s3.upload(enc / "a1", "zoo/tampered")
    blob = bytearray(s3.get("zoo/tampered/adapter_model.safetensors.enc"))
    blob[len(blob) // 2] ^= 0x01
    s3.put("zoo/tampered/adapter_model.safetensors.enc", bytes(blob))
    manifest = s3.get("zoo/tampered/checksums.sha256").decode().splitlines()
    fixed = [f"{hashlib.sha256(blob).hexdigest()}  adapter_model.safetensors.enc" if "enc" in line else line
             for line in manifest]  # an attacker who also rewrites the checksums is caught by GCM
    s3.put("zoo/tampered/checksums.sha256", "\n".join(fixed).encode())

    key = parse_key(key_file.read_bytes(), "test")
    store = make_store(s3, shapes, tmp_path, key=key)
    assert store.describe_adapters()[0].encrypted, "the listing reports encrypted weights"
    plain = load_peft_adapter("a1", demo_zoo.adapters_dir / "a1", shapes, 64)
    assert same_weights(store.load("secret"), plain), "the decrypted weights equal the plaintext adapter's"
    cached = [f for f in disk_files(tmp_path) if f.endswith(".enc")]
    assert len(cached) == 1, f"the disk cache keeps the encrypted file, got {disk_files(tmp_path)}"
    assert plaintext[64:128] not in (tmp_path / "disk" / cached[0]).read_bytes(), \
        "the disk cache holds the weights encrypted"
    with pytest.raises(AdapterIntegrityError, match=r"'tampered'.*failed authentication"):
        store.load("tampered")
    no_key = make_store(s3, shapes, tmp_path / "nokey")
    with pytest.raises(AdapterIntegrityError, match=r"'secret'.*encrypted but no key"):
        no_key.load("secret")
    wrong_key = make_store(s3, shapes, tmp_path / "wrong", key=bytes(32))
    with pytest.raises(AdapterIntegrityError, match=r"wrong key or tampered"):
        wrong_key.load("secret")


def test_32_threads_one_cold_adapter_one_download(s3, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / BIG, f"zoo/{BIG}")
    store = make_store(s3, shapes, tmp_path)
    gets = record_gets(store)
    fetch, fetches = store.sources[0].fetch, []

    def slow_fetch(*args):
        fetches.append(1)
        threading.Event().wait(0.2)  # keep the flight in the air while the others arrive
        return fetch(*args)

    store.sources[0].fetch = slow_fetch
    barrier, results, errors = threading.Barrier(32), [], []

    def worker():
        barrier.wait()
        try:
            results.append(store.load(BIG))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], "no caller fails"
    assert len(results) == 32, "every caller gets weights"
    assert all(r is results[0] for r in results), "every caller gets the same weights object"
    assert len(fetches) == 1, "one download for 32 callers"
    weight_gets = [k for k in gets if k.endswith("/adapter_model.safetensors")]
    assert len(weight_gets) == 1, f"one GET of the weights for 32 callers, got {weight_gets}"
    host = store.snapshot()["tiers"]["host"]
    assert host["misses"] == 1, "one caller missed the host tier and led the flight"
    assert host["loads"] == 1, "the host tier was filled once"
    assert host["coalesced"] + host["hits"] == 31, "the other 31 joined the flight or hit the host copy"


def test_generation_from_s3_equals_generation_from_folder(make_engine, s3, demo_zoo, tmp_path):
    ids = ["a0", "a2", "a7"]
    for aid in ids:
        s3.upload(demo_zoo.adapters_dir / aid, f"zoo/{aid}")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = ["the quick brown fox", "Please mend the lantern", "hello there"]
    from_folder = make_engine(max_loras=2, max_lora_rank=32, adapter_store="folder")
    from_s3 = make_engine(adapter_source=f"s3://{s3.bucket}/zoo", max_loras=2, max_lora_rank=32,
                          disk_cache_dir=str(tmp_path / "disk"))
    expected = from_folder.generate(prompts, adapter_ids=ids, sampling=greedy)
    got = from_s3.generate(prompts, adapter_ids=ids, sampling=greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected], "S3 and folder generate alike"
    assert len({tuple(o.token_ids) for o in got}) == 3, "the three adapters produce three different outputs"
    assert isinstance(from_s3.loader, TieredAdapterStore), "the engine's default loader is the tiered store"
    assert from_s3.loader.usage.uses("a0") == 0, "finished requests release their adapter"
    assert from_s3.loader.state("a0") in (AdapterState.ON_DEVICE, AdapterState.IN_HOST), \
        "a used adapter stays on the device or in host memory"
    from_s3.close()
    from_folder.close()


def test_register_s3_location(s3, demo_zoo, shapes, tmp_path):
    s3.upload(demo_zoo.adapters_dir / "a3", "elsewhere/custom")
    s3.monkeypatch.delenv("AWS_ENDPOINT_URL")  # the S3-specific endpoint variable works as well
    s3.monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    store = make_store(s3, shapes, tmp_path)
    store.register("mine", f"s3://{s3.bucket}/elsewhere/custom")
    assert "mine" in store.list_adapters(), "a registered adapter is listed"
    assert store.state("mine") is AdapterState.IN_HOST, "register validates by loading into host memory"
    want = load_peft_adapter("a3", demo_zoo.adapters_dir / "a3", shapes, 64)
    assert same_weights(store.load("mine"), want), "the registered id serves the weights at its location"
    with pytest.raises(AdapterNotFoundError, match=r"'other'.*no adapter at"):
        store.register("other", f"s3://{s3.bucket}/elsewhere/missing")
    assert store.unregister("mine"), "unregistering a registered id reports it"
    assert not store.unregister("mine"), "unregistering it again reports nothing to forget"
    with pytest.raises(AdapterNotFoundError):
        store.load("mine")


def test_listing_reads_no_object_and_describing_reads_each_small_file_once(s3, demo_zoo, shapes, tmp_path):
    for i in range(12):
        s3.upload(demo_zoo.adapters_dir / f"a{i % 3}", f"zoo/x{i}")
    weights = (demo_zoo.adapters_dir / "a1" / "adapter_model.safetensors").read_bytes()
    digest = hashlib.sha256(weights).hexdigest()
    s3.put("zoo/x1/checksums.sha256", f"{digest}  adapter_model.safetensors\n".encode())
    store = make_store(s3, shapes, tmp_path)
    gets = record_gets(store)
    assert sorted(store.list_adapters()) == sorted(f"x{i}" for i in range(12)), "every adapter is listed"
    assert gets == [], "listing adapter ids reads no object (the key listing alone)"
    infos = {i.adapter_id: i for i in store.describe_adapters()}
    assert len(infos) == 12, "every adapter is described (configs read concurrently)"
    assert infos["x1"].sha256 == digest, "the declared checksum is reported"
    assert len(gets) == 13, "the first description reads each config and the checksums file once"
    store.describe_adapters()
    assert len(gets) == 13, "describing again reads nothing new (small files cached by ETag)"

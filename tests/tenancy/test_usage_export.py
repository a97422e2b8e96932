"""The usage export (`tenancy.usage_export`, `tenancy.usage_export_target`): each closed minute's sums as
one Parquet file per minute under `usage/date=YYYY-MM-DD/`, read back with pyarrow; written once, and
rewritten under the same key (never a second file) when the minute changes or a write was not marked."""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from lora_cluster.config import ServeConfig
from lora_cluster.errors import ConfigError
from lora_cluster.tenancy.usage_export import (
    COLUMNS,
    RESIDENCY_COLUMNS,
    UsageExporter,
    minute_key,
    require_pyarrow,
)
from lora_cluster.tenancy.usage_export_target import FolderTarget, open_export_target
from lora_cluster.tenancy.usage_record import Outcome, Residency, UsageBatch, UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore

T0 = 1_795_995_600.0  # 2026-11-29T23:40:00Z, a minute boundary
M0 = int(T0 // 60)
CLOSE_S = 15.0


def rec(rid: str, tenant: str = "acme", at: float = T0 + 1, **kw) -> UsageRecord:
    base = dict(request_id=rid, tenant=tenant, adapter="a1", version=2, sla_class="standard",
                base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=3, output_tokens=5,
                device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=at)
    return UsageRecord(**{**base, **kw})


@pytest.fixture
def store(tmp_path):
    s = UsageStore(tmp_path / "usage.db", retention_s=10 * 365 * 86400.0)
    yield s
    s.close()


def exporter_for(store: UsageStore, target) -> UsageExporter:
    store.track_exports(target.where)
    return UsageExporter(store, target, CLOSE_S)


def export(exporter: UsageExporter, now: float) -> int:
    return asyncio.run(exporter.export_due(now))


def read_dataset(root: Path) -> list[dict]:
    table = ds.dataset(root / "usage", format="parquet", partitioning="hive").to_table()
    return sorted(table.to_pylist(), key=lambda r: (r["minute_start"], r["tenant"]))


def files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))


def test_each_closed_minute_is_one_file_partitioned_by_day_with_the_stores_sums(store, tmp_path):
    store.record([rec("r1"), rec("r2", tenant="beta", output_tokens=7), rec("r3", at=T0 + 61)])
    out = tmp_path / "export"
    written = export(exporter_for(store, FolderTarget(out)), T0 + 120 + CLOSE_S)
    assert written == 2, "both closed minutes were written"
    assert files(out) == [f"usage/date=2026-11-29/part-{M0}.parquet",
                          f"usage/date=2026-11-29/part-{M0 + 1}.parquet"], "one file per minute, by UTC day"
    rows = read_dataset(out)
    assert [(r["tenant"], r["requests"], r["output_tokens"]) for r in rows] == \
        [("acme", 1, 5), ("beta", 1, 7), ("acme", 1, 5)], "one row per tenant and minute, the store's sums"
    assert rows[0]["date"] == "2026-11-29", "the day partition reads as a column"
    assert rows[0]["minute_start"].timestamp() == T0, "minute_start is the minute's start, in UTC"
    assert (rows[0]["version"], rows[0]["cached_tokens"], rows[0]["device_s"]) == (2, 3, 0.5), \
        "version, cached tokens and device-seconds are exported as stored"


def test_the_schema_is_the_documented_one(store, tmp_path):
    store.record([rec("r1")])
    out = tmp_path / "export"
    export(exporter_for(store, FolderTarget(out)), T0 + 60 + CLOSE_S)
    schema = pq.read_schema(out / minute_key(M0))
    assert [(f.name, str(f.type)) for f in schema] == list(COLUMNS), \
        "the columns and types are COLUMNS, in order"
    assert not any(f.nullable for f in schema), "no column is nullable"


def test_a_minute_is_written_only_once_it_is_closed(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    store.record([rec("r1")])
    assert export(exporter, T0 + 60 + CLOSE_S - 1) == 0, "a minute whose late records may still come waits"
    assert export(exporter, T0 + 60 + CLOSE_S) == 1, "it is written once closed"
    assert export(exporter, T0 + 600) == 0, "a written minute that did not change is not written again"


def test_a_late_change_rewrites_the_same_key_with_the_new_sums(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    store.record([rec("r1")])
    export(exporter, T0 + 600)
    store.record([rec("r2", output_tokens=9)])  # a batch that arrived late, for the same minute
    assert export(exporter, T0 + 600) == 1, "the changed minute is written again"
    assert files(out) == [minute_key(M0)], "under the same key: still one file for the minute"
    rows = read_dataset(out)
    assert (rows[0]["requests"], rows[0]["output_tokens"]) == (2, 14), "the file holds the new sums"


def test_a_request_moved_to_a_later_minute_leaves_the_files_adding_up(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    store.record([rec("r1", outcome=Outcome.FAILED, device_s=0.2)])
    export(exporter, T0 + 600)
    store.record([rec("r1", at=T0 + 61, device_s=0.3)])  # its retry ended a minute later: one record
    export(exporter, T0 + 600)
    rows = read_dataset(out)
    assert [(r["minute_start"].timestamp(), r["requests"]) for r in rows] == [(T0 + 60, 1)], \
        "the old minute's file is rewritten without it; the request is counted once, in its new minute"
    assert rows[0]["device_s"] == pytest.approx(0.5), "with both attempts' device-seconds"


class CrashAfterWrite:
    """A real folder target whose process 'dies' right after a write lands (the write is not marked)."""

    def __init__(self, root: Path):
        self.inner, self.where = FolderTarget(root), str(root)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        raise OSError("killed after the write")


def test_a_restart_after_an_unmarked_write_overwrites_the_same_key(tmp_path):
    out, db = tmp_path / "export", tmp_path / "usage.db"
    store = UsageStore(db, retention_s=10 * 365 * 86400.0)
    store.record([rec("r1"), rec("r2")])
    with pytest.raises(OSError):
        export(exporter_for(store, CrashAfterWrite(out)), T0 + 600)
    store.close()
    reopened = UsageStore(db, retention_s=10 * 365 * 86400.0)
    assert export(exporter_for(reopened, FolderTarget(out)), T0 + 600) == 1, \
        "the minute written but not marked is still pending after the restart"
    reopened.close()
    assert files(out) == [minute_key(M0)], "written again under the same key, never a second file"
    assert read_dataset(out)[0]["requests"] == 2, "the minute's two requests, counted once"


class ChangeDuringWrite:
    """A folder target during whose write the store takes a late record for the minute being written."""

    def __init__(self, root: Path, store: UsageStore):
        self.inner, self.where, self.store = FolderTarget(root), str(root), store

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self.store.record([rec("late", output_tokens=1)])


def test_a_change_racing_the_write_leaves_the_minute_pending(store, tmp_path):
    out = tmp_path / "export"
    store.record([rec("r1")])
    racing = exporter_for(store, ChangeDuringWrite(out, store))
    export(racing, T0 + 600)
    assert store.pending_exports(M0 + 10, 10) != [], "the minute changed after it was read: still pending"
    export(UsageExporter(store, FolderTarget(out), CLOSE_S), T0 + 600)
    assert read_dataset(out)[0]["requests"] == 2, "the next round writes the sums with the late record"


def test_a_new_target_gets_every_minute_stored_before(tmp_path):
    db, out = tmp_path / "usage.db", tmp_path / "export"
    store = UsageStore(db, retention_s=10 * 365 * 86400.0)
    store.record([rec("r1"), rec("r2", at=T0 + 3600)])  # stored while export was off
    assert store.track_exports(str(out)) == 2, "both minutes stored so far are pending for a new target"
    store.close()
    reopened = UsageStore(db, retention_s=10 * 365 * 86400.0)
    assert reopened.track_exports(str(out)) == 2, "a known target is not sent them a second time"
    export(UsageExporter(reopened, FolderTarget(out), CLOSE_S), T0 + 7200)
    assert reopened.track_exports(str(out)) == 0, "once written, nothing is pending for the same target"
    reopened.close()


def test_s3_target_writes_the_minute_files_under_its_prefix(store, s3):
    target = open_export_target(f"s3://{s3.bucket}/billing/prod")
    store.record([rec("r1"), rec("r2", tenant="beta")])
    export(exporter_for(store, target), T0 + 600)
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert keys == [f"billing/prod/usage/date=2026-11-29/part-{M0}.parquet"], "one object, under the prefix"
    table = pq.read_table(io.BytesIO(s3.get(keys[0])))
    assert table.column("tenant").to_pylist() == ["acme", "beta"], "the object is the minute's Parquet file"


def read_residency(root: Path) -> list[tuple[float, str, str, float]]:
    table = ds.dataset(root / "residency", format="parquet", partitioning="hive").to_table()
    return sorted((r["minute_start"].timestamp(), r["adapter"], r["replica"], r["slot_s"])
                  for r in table.to_pylist())


def record_two_adapters_over_two_minutes(store: UsageStore) -> None:
    store.record_residency(M0, "r0", {"a1": 60.0, "a2": 20.0})
    store.record_residency(M0, "r1", {"a1": 30.0})
    store.record_residency(M0 + 1, "r0", {"a2": 45.0})


def test_residency_is_exported_once_per_closed_minute_per_adapter_and_replica(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    record_two_adapters_over_two_minutes(store)
    assert export(exporter, T0 + 120 + CLOSE_S) == 2, "both closed minutes with residency are written"
    assert [f for f in files(out) if f.startswith("residency/")] == [
        f"residency/date=2026-11-29/part-{M0}.parquet", f"residency/date=2026-11-29/part-{M0 + 1}.parquet"], \
        "one residency file per minute, by UTC day"
    assert read_residency(out) == [(T0, "a1", "r0", 60.0), (T0, "a1", "r1", 30.0), (T0, "a2", "r0", 20.0),
                                   (T0 + 60, "a2", "r0", 45.0)], "the store's slot-seconds, per replica"
    schema = pq.read_schema(out / minute_key(M0, "residency"))
    assert [(f.name, str(f.type)) for f in schema] == list(RESIDENCY_COLUMNS), "the documented schema"
    assert not any(f.nullable for f in schema), "no column is nullable"
    assert export(exporter, T0 + 600) == 0, "an unchanged minute is not written again"


def test_residency_changed_after_export_rewrites_the_same_key(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    record_two_adapters_over_two_minutes(store)
    export(exporter, T0 + 600)
    store.record_residency(M0, "r0", {"a1": 5.0})  # a replica's late report for the exported minute
    assert export(exporter, T0 + 600) == 1, "the changed minute is written again"
    assert [f for f in files(out) if f.startswith("residency/")] == [
        minute_key(M0, "residency"), minute_key(M0 + 1, "residency")], "under the same keys, no new file"
    assert read_residency(out)[0] == (T0, "a1", "r0", 65.0), "the file holds the new slot-seconds"


def test_residency_a_replica_ships_in_its_batch_is_exported_with_its_load_seconds(store, tmp_path):
    out = tmp_path / "export"
    exporter = exporter_for(store, FolderTarget(out))
    export(exporter, T0 - 600)  # the target is known: what arrives later is pending by the batch alone
    shipped = (Residency(M0, "a1", "r0", slot_s=50.0, load_s=1.5),)
    assert store.record_batch(UsageBatch("r0-x", 1, (), shipped)) == 0, "no request records in the batch"
    assert export(exporter, T0 + 600) == 1, "the batch's minute is pending and written"
    table = pq.read_table(out / minute_key(M0, "residency")).to_pydict()
    assert (table["slot_s"], table["load_s"]) == ([50.0], [1.5]), "slot and load seconds, as shipped"


def test_a_new_target_gets_the_residency_stored_before(tmp_path):
    store = UsageStore(tmp_path / "usage.db", retention_s=10 * 365 * 86400.0)
    record_two_adapters_over_two_minutes(store)  # stored while export was off
    out = tmp_path / "export"
    assert export(exporter_for(store, FolderTarget(out)), T0 + 600) == 2, "both minutes are backfilled"
    store.close()
    assert len(read_residency(out)) == 4, "with their residency"


def test_s3_target_writes_residency_and_rewrites_it_under_the_same_key(store, s3):
    exporter = exporter_for(store, open_export_target(f"s3://{s3.bucket}/billing/prod"))
    record_two_adapters_over_two_minutes(store)
    export(exporter, T0 + 600)
    store.record_residency(M0 + 1, "r0", {"a2": 15.0})
    export(exporter, T0 + 600)
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]
                  if "/residency/" in o["Key"])
    assert keys == [f"billing/prod/{minute_key(M0, 'residency')}",
                    f"billing/prod/{minute_key(M0 + 1, 'residency')}"], "one per minute, under the prefix"
    table = pq.read_table(io.BytesIO(s3.get(keys[1])))
    assert table.to_pydict()["slot_s"] == [60.0], "the rewritten object holds the new slot-seconds"
    assert pq.read_table(io.BytesIO(s3.get(keys[0]))).num_rows == 3, "two adapters over two replicas"


def test_a_malformed_uri_is_a_config_error():
    with pytest.raises(ConfigError, match="usage_export_uri"):
        open_export_target("gs://bucket/usage")
    with pytest.raises(ConfigError, match="s3://bucket"):
        open_export_target("s3:///usage")


def test_without_pyarrow_the_export_is_refused_naming_the_extra(monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # `import pyarrow` raises ImportError
    with pytest.raises(ConfigError, match=r"pyarrow is not installed.*lora-cluster\[parquet\]"):
        require_pyarrow("s3://bucket/usage")


def test_the_fields_are_overridable_from_the_environment(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_USAGE_STORE_URI", "postgresql://lora@db.internal:5432/usage")
    monkeypatch.setenv("LORA_CLUSTER_USAGE_EXPORT_URI", "s3://bucket/usage")
    monkeypatch.setenv("LORA_CLUSTER_USAGE_EXPORT_INTERVAL_S", "30")
    tenancy = ServeConfig(model="-").tenancy
    assert tenancy.usage_store_uri == "postgresql://lora@db.internal:5432/usage", \
        "LORA_CLUSTER_USAGE_STORE_URI sets the PostgreSQL store"
    assert tenancy.usage_export_uri == "s3://bucket/usage", "LORA_CLUSTER_USAGE_EXPORT_URI sets the URI"
    assert tenancy.usage_export_interval_s == 30.0, "LORA_CLUSTER_USAGE_EXPORT_INTERVAL_S sets the interval"

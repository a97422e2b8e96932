"""The usage-store deployment (`serve.ops.usage_sink`) on its stores and targets: its export task
(`usage_export_uri`), started by the first call, writes the closed minutes' Parquet files to a real S3
server (moto) in the background; a sink whose node lacks pyarrow does not start; on a real PostgreSQL
server (`usage_store_uri`; skipped where PostgreSQL or psycopg is not installed) it takes each batch
once and answers queries; the app does not build with an export or a store it cannot use."""

from __future__ import annotations

import asyncio
import io
import sys
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
from postgres_server import start_postgres

from lora_cluster.errors import ConfigError
from lora_cluster.serve.ops.usage_sink import UsageSinkCore
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch, UsageRecord

T0 = 1_795_995_600.0  # 2026-11-29T23:40:00Z: long closed


def rec(rid: str, tenant: str) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant=tenant, adapter="a1", version=1, sla_class="standard",
                       base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=0, output_tokens=5,
                       device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=T0 + 1)


async def test_the_sink_exports_closed_minutes_to_s3_in_the_background(tmp_path, s3):
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=10 * 365 * 86400.0,
                         export_uri=f"s3://{s3.bucket}/usage-export", export_interval_s=0.05)
    try:
        await sink.record(UsageBatch("replica-1", 1, (rec("r1", "acme"), rec("r2", "beta"))))
        keys: list[str] = []
        for _ in range(200):  # at most 4 s
            keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
            if keys:
                break
            await asyncio.sleep(0.02)
        assert keys == [f"usage-export/usage/date=2026-11-29/part-{int(T0 // 60)}.parquet"], \
            "the background task wrote the closed minute's file"
        table = pq.read_table(io.BytesIO(s3.get(keys[0])))
        assert table.column("requests").to_pylist() == [1, 1], "one row per tenant, one request each"
        await asyncio.sleep(0.2)  # a few more rounds
        assert sink.exporter is not None and sink.exporter.written == 1, "an unchanged minute is written once"
    finally:
        sink.close()


async def test_a_failed_export_round_keeps_its_minutes_for_the_next(tmp_path, s3, caplog):
    bucket = f"{s3.bucket}-later"  # does not exist yet: every write fails
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=10 * 365 * 86400.0,
                         export_uri=f"s3://{bucket}/usage-export", export_interval_s=0.05)
    try:
        with caplog.at_level("WARNING", logger="lora_cluster.serve.ops.usage_sink"):
            await sink.record(UsageBatch("replica-1", 1, (rec("r1", "acme"),)))
            for _ in range(200):  # at most 4 s, until the first round has failed
                if any("usage export" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # a few more failed rounds
        warnings = [r for r in caplog.records if "usage export" in r.getMessage()]
        assert len(warnings) == 1, f"one log line per outage: {[r.getMessage() for r in warnings]}"
        assert bucket in warnings[0].getMessage(), "the line names the target"
        s3.client.create_bucket(Bucket=bucket)
        keys: list[str] = []
        for _ in range(200):  # at most 4 s
            keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=bucket).get("Contents", [])]
            if keys:
                break
            await asyncio.sleep(0.02)
        assert keys == [f"usage-export/usage/date=2026-11-29/part-{int(T0 // 60)}.parquet"], \
            "the minute was still pending, and is written once the bucket answers"
    finally:
        sink.close()


async def test_a_backlog_is_written_in_rounds_without_a_pause(tmp_path):
    out = tmp_path / "export"
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=10 * 365 * 86400.0,
                         export_uri=str(out), export_interval_s=3600.0)  # a pause would stop the test
    assert sink.exporter is not None, "the export is on"
    sink.exporter.max_per_round = 2
    try:
        records = tuple(replace(rec(f"r{k}", "acme"), ended_at=T0 + 60 * k) for k in range(5))
        await sink.record(UsageBatch("replica-1", 1, records))  # five minutes: rounds of 2, 2 and 1
        files: list[str] = []
        for _ in range(200):  # at most 4 s
            files = sorted(p.name for p in out.rglob("*.parquet"))
            if len(files) == 5:
                break
            await asyncio.sleep(0.02)
        assert files == [f"part-{int(T0 // 60) + k}.parquet" for k in range(5)], \
            "the full rounds were followed at once by the next, until the backlog was written"
    finally:
        sink.close()


def test_a_sink_without_pyarrow_does_not_start(tmp_path, monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match="pyarrow"):
        UsageSinkCore(str(tmp_path / "usage.db"), 86400.0, export_uri=str(tmp_path / "export"))


async def test_the_sink_keeps_usage_in_postgres_across_a_restart():
    with start_postgres() as url:
        if url is None:
            pytest.skip("PostgreSQL (initdb, pg_ctl) or psycopg is not installed here")
        sink = UsageSinkCore(url, retention_s=10 * 365 * 86400.0)
        batch = UsageBatch("replica-1", 1, (rec("r1", "acme"), rec("r2", "beta")))
        assert await sink.record(batch) == 2, "both requests are new"
        sink.close()
        restarted = UsageSinkCore(url, retention_s=10 * 365 * 86400.0)
        assert await restarted.record(batch) == 0, "the batch resent after a restart writes nothing"
        rows = await restarted.query(group_by=("tenant",))
        restarted.close()
    assert [(r["tenant"], r["requests"]) for r in rows] == [("acme", 1), ("beta", 1)], \
        "the usage stored before the restart, each request once"


def test_the_app_does_not_build_with_an_export_it_cannot_write(monkeypatch):
    from lora_cluster.config import load_config
    from lora_cluster.serve.app import usage_sink

    with pytest.raises(ConfigError, match="usage_export_uri 'gs://bucket'"):
        usage_sink(load_config({"model": "-", "usage_export_uri": "gs://bucket"}))
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"lora-cluster\[parquet\]"):
        usage_sink(load_config({"model": "-", "usage_export_uri": "s3://bucket/usage"}))


def test_the_app_does_not_build_with_a_postgres_store_it_cannot_open(monkeypatch):
    from lora_cluster.config import load_config
    from lora_cluster.serve.app import usage_sink

    with pytest.raises(ConfigError, match="usage_store_uri is a postgresql:// URL"):
        load_config({"model": "-", "usage_store_uri": "/var/lib/usage.db"})
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ConfigError, match=r"lora-cluster\[postgres\]"):
        usage_sink(load_config({"model": "-", "usage_store_uri": "postgresql://lora@127.0.0.1/usage"}))

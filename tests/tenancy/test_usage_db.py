"""The usage store on each of its databases (`tenancy.usage_db`): the same SQL on SQLite and on a real
PostgreSQL server (tests/postgres_server.py; skipped where PostgreSQL or psycopg is not installed):
one record per request, sums and groups, each batch once across a reopen, pruning, the export's
pending minutes, residency; and the answers' types (whole numbers stay ints)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import pytest
from postgres_server import start_postgres

from lora_cluster.errors import ConfigError
from lora_cluster.tenancy.usage_db import PostgresDatabase, open_usage_database
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch, UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore

T0 = 1_795_995_600.0  # 2026-11-29T23:40:00Z, a minute boundary
KEEP = 10 * 365 * 86400.0  # keeps T0's per-request rows


def rec(rid: str, tenant: str = "acme", **kw) -> UsageRecord:
    base = dict(request_id=rid, tenant=tenant, adapter="a1", version=1, sla_class="standard",
                base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=2, output_tokens=5,
                device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=T0 + 1)
    return UsageRecord(**{**base, **kw})


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str | None]:
    with start_postgres() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path, postgres_url) -> str:
    """Where a fresh store lives: a SQLite file, or a new database on the PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "usage.db")
    if postgres_url is None:
        pytest.skip("PostgreSQL (initdb, pg_ctl) or psycopg is not installed here")
    import psycopg

    name = f"usage_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_url.rsplit("/", 1)[0] + f"/{name}"


def test_a_request_in_parts_is_one_record_and_the_sums_follow(location):
    store = UsageStore(location, retention_s=KEEP)
    assert store.record([rec("r1", outcome=Outcome.FAILED, output_tokens=0, device_s=0.2)]) == 1, "new"
    assert store.record([rec("r1", device_s=0.3, preempted=True)]) == 0, "a later part is not a new record"
    merged = store.get("r1")
    assert merged is not None and merged.outcome is Outcome.PREEMPTED_RESUMED, "the merged outcome"
    assert merged.device_s == pytest.approx(0.5), "both parts' device-seconds"
    (row,) = store.query(group_by=("tenant",))
    assert (row["tenant"], row["requests"], row["output_tokens"]) == ("acme", 1, 5), \
        "the sums count the request once, with its latest tokens"
    assert type(row["requests"]) is int and type(row["prompt_tokens"]) is int, "whole sums are ints"
    assert type(row["device_s"]) is float, "seconds are floats"
    store.close()


def test_groups_by_hour_day_and_filters_read_the_same(location):
    store = UsageStore(location, retention_s=KEEP)
    store.record([rec("r1"), rec("r2", tenant="beta", version=2), rec("r3", ended_at=T0 + 3600)])
    rows = store.query(group_by=("day", "hour"))
    assert [(r["day"], r["hour"], r["requests"]) for r in rows] == [
        ("2026-11-29", "2026-11-29T23:00:00Z", 2), ("2026-11-30", "2026-11-30T00:00:00Z", 1)], \
        "hours and days are UTC labels"
    assert [r["requests"] for r in store.query(group_by=(), version=2)] == [1], "filter by version"
    assert store.query(group_by=("tenant",), since=T0 + 3600) == [
        {"tenant": "acme", "requests": 1, "prompt_tokens": 10, "cached_tokens": 2, "output_tokens": 5,
         "device_s": 0.5, "queue_s": 0.1}], "since selects the later minute"
    store.close()


def test_a_batch_is_taken_once_across_a_reopen(location):
    store = UsageStore(location, retention_s=KEEP)
    batch = UsageBatch("replica-1", 1, (rec("r1"), rec("r2")))
    assert store.record_batch(batch) == 2, "the batch's two requests are new"
    store.close()
    reopened = UsageStore(location, retention_s=KEEP)
    assert reopened.record_batch(batch) == 0, "the same batch again, after a reopen, writes nothing"
    assert reopened.query(group_by=())[0]["requests"] == 2, "each request counted once"
    assert reopened.sources() == 1, "one sender remembered"
    reopened.close()


def test_pruning_keeps_the_sums(location):
    store = UsageStore(location, retention_s=60.0)
    store.record_batch(UsageBatch("replica-1", 1, (rec("r1"),)))
    assert store.prune(T0 + 3600) == 1, "the old per-request row is pruned"
    assert store.get("r1") is None and store.sources() == 0, "its record and its sender are forgotten"
    assert store.query(group_by=())[0]["requests"] == 1, "the per-minute sums stay"
    store.close()


def test_export_tracking_and_residency(location):
    store = UsageStore(location, retention_s=KEEP)
    store.record([rec("r1")])
    assert store.track_exports("s3://bucket/usage") == 1, "a new target gets the minute stored before"
    store.record([rec("r2", tenant="beta")])
    (minute, changes), = store.pending_exports(int(T0 // 60) + 10, 10)
    assert [r["tenant"] for r in store.minute_sums(minute)] == ["acme", "beta"], "the minute's rows"
    assert store.exported(minute, changes - 1) is False, "an export of an older reading leaves it pending"
    assert store.exported(minute, changes) is True, "the export of the current reading clears it"
    store.record_residency(int(T0 // 60), "r0", {"a1": 30.0})
    store.record_residency(int(T0 // 60), "r0", {"a1": 15.0})
    assert store.residency() == {"a1": 45.0}, "slot-seconds add up per adapter"
    store.close()


def test_a_store_from_before_the_added_columns_gets_them_on_open(location):
    store = UsageStore(location, retention_s=KEEP)
    store.record([rec("old")])
    store.close()
    db = open_usage_database(location)  # the tables as a release before `load_s` and `delivered` wrote them
    with db.transaction():
        db.execute("ALTER TABLE usage_requests DROP COLUMN delivered")
        db.execute("ALTER TABLE usage_residency DROP COLUMN load_s")
    db.close()
    store = UsageStore(location, retention_s=KEEP)
    old = store.get("old")
    store.record([rec("new", outcome=Outcome.CANCELLED, output_tokens=9)])
    store.record([rec("new", outcome=Outcome.CANCELLED, replica="", output_tokens=4, prompt_tokens=0,
                      cached_tokens=0, device_s=0.0, queue_s=0.0, delivered=True)])
    merged = store.get("new")
    store.record_residency(int(T0 // 60), "r0", {"a1": 30.0})
    residency = store.residency()
    store.close()
    assert old is not None and old.delivered is False, f"a row from before the flag is not delivered: {old}"
    assert merged is not None and merged.delivered and merged.output_tokens == 4, \
        f"a delivered part merges into the reopened store as into a new one: {merged}"
    assert residency == {"a1": 30.0}, f"residency is stored in the reopened table: {residency}"


def test_the_postgres_location_names_no_credentials(postgres_url):
    if postgres_url is None:
        pytest.skip("PostgreSQL (initdb, pg_ctl) or psycopg is not installed here")
    url = postgres_url.replace("lora@", "lora:secret@")
    db = PostgresDatabase(url)
    assert "secret" not in db.where and "lora" not in db.where.split("@")[0].split("//")[1], \
        f"the location for logs and errors carries no user or password: {db.where}"
    db.close()


def test_without_psycopg_a_postgres_store_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ConfigError, match=r"lora-cluster\[postgres\]"):
        open_usage_database("postgresql://lora@127.0.0.1:1/usage")


def test_another_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="postgresql://"):
        open_usage_database("mysql://lora@127.0.0.1/usage")


def test_the_command_reads_the_store_it_is_configured_with(location, monkeypatch, capsys):
    from lora_cluster.cli import main

    store = UsageStore(location, retention_s=KEEP)
    store.record([rec("r1"), rec("r2", tenant="beta")])
    store.close()
    postgres = location.startswith("postgresql://")
    monkeypatch.setenv("LORA_CLUSTER_USAGE_STORE_URI" if postgres else "LORA_CLUSTER_USAGE_DB_PATH", location)
    assert main(["usage", "--format", "csv"]) == 0, "the command reads the configured store"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[:2] for line in lines] == \
        [["tenant", "requests"], ["acme", "1"], ["beta", "1"]], "one row per tenant"


def test_the_command_reports_an_unreachable_database_in_one_line(capsys):
    from helpers import free_tcp_port

    from lora_cluster.cli import main

    pytest.importorskip("psycopg")
    url = f"postgresql://lora:secret@127.0.0.1:{free_tcp_port()}/usage"
    assert main(["usage", "--db", url]) == 1, "an unreachable database fails the command"
    err = capsys.readouterr().err
    assert err.startswith("lora-cluster usage: cannot open the usage store") and err.count("\n") == 1, \
        f"one line on stderr: {err!r}"
    assert "secret" not in err, "the password is not printed"

"""`lora-cluster usage`: the usage store read as a table or CSV, found by LORA_CLUSTER_USAGE_DB_PATH or
`--db`, grouped and filtered as asked; a missing store or an unknown group is one line on stderr."""

from __future__ import annotations

import csv
import io

import pytest
from test_usage_store import T0, rec

from lora_cluster.cli import main
from lora_cluster.tenancy.usage_store import UsageStore


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "usage.db"
    store = UsageStore(path)
    store.record([rec("r1", output_tokens=5, device_s=0.25), rec("r2", output_tokens=7, device_s=0.5),
                  rec("r3", tenant="globex", adapter="b2", ended_at=T0 + 3600, device_s=1.0)])
    store.close()
    return path


def test_usage_as_csv_per_tenant_from_the_configured_store(db, monkeypatch, capsys):
    monkeypatch.setenv("LORA_CLUSTER_USAGE_DB_PATH", str(db))
    assert main(["usage", "--format", "csv"]) == 0, "the command succeeds"
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["tenant"] for r in rows] == ["acme", "globex"], "one row per tenant, sorted"
    assert rows[0]["requests"] == "2", "acme made two requests"
    assert rows[0]["output_tokens"] == "12", "acme's output tokens add up"
    assert float(rows[0]["device_s"]) == pytest.approx(0.75), "acme's device-seconds add up"


def test_usage_table_grouped_by_hour_and_filtered_to_a_tenant(db, capsys):
    assert main(["usage", "--db", str(db), "--group-by", "tenant,hour", "--tenant", "globex"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["tenant", "hour", "requests"], "a header names the columns"
    assert len(lines) == 2, "one row: globex's one hour"
    assert lines[1].split()[:3] == ["globex", "2026-11-30T00:00:00Z", "1"], "globex's hour and count"


def test_usage_errors_are_one_line(tmp_path, db, capsys):
    assert main(["usage", "--db", str(tmp_path / "none.db")]) == 1, "a missing store fails"
    assert "no usage store at" in capsys.readouterr().err, "and says where it looked"
    assert main(["usage", "--db", str(db), "--group-by", "planet"]) == 1, "an unknown group fails"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "group_by 'planet'" in err[0], f"and names the group: {err}"

"""The durable usage store: usage records aggregated per minute in SQLite, one record per request id.

Two tables. `usage_requests` keeps each request's record (exactly one per request id; a later part
of the same request is merged into it by `usage_record.merge`, never added as a second one), for
`retention_s` after it ended (`prune`), which bounds it. `usage_minutes` keeps the per-minute sums per
(tenant, adapter, version, SLA class, base model): requests, prompt, cached and output tokens,
device-seconds and queue-seconds; a merged part moves the request's old contribution out of its
bucket and the merged one in, so the sums always equal the sum of the records, and they outlive the
per-request rows. `usage_residency` keeps slot-seconds per (minute, adapter, replica).

Every write is one transaction (a killed process loses nothing it committed; WAL journal). Calls
block on the disk: an event loop calls them on a worker thread. One store object per process.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import astuple, fields
from pathlib import Path

from lora_cluster.errors import RequestError
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord, merge

GROUPS = ("tenant", "adapter", "version", "class", "hour", "day")  # what `query` may group by
_GROUP_SQL = {"tenant": "tenant", "adapter": "adapter", "version": "version", "class": "sla_class",
              "hour": "strftime('%Y-%m-%dT%H:00:00Z', minute * 60, 'unixepoch')",
              "day": "strftime('%Y-%m-%d', minute * 60, 'unixepoch')"}
SUMS = ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "device_s", "queue_s")
_KEY = ("minute", "tenant", "adapter", "version", "sla_class", "base_model")
_COLUMNS = [f.name for f in fields(UsageRecord)]
_UPSERT_REQUEST = f"INSERT OR REPLACE INTO usage_requests VALUES ({', '.join('?' * len(_COLUMNS))})"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage_requests ({", ".join(_COLUMNS)}, PRIMARY KEY (request_id));
CREATE INDEX IF NOT EXISTS usage_requests_ended ON usage_requests (ended_at);
CREATE TABLE IF NOT EXISTS usage_minutes ({", ".join(_KEY)}, {", ".join(SUMS)},
    PRIMARY KEY ({", ".join(_KEY)}));
CREATE TABLE IF NOT EXISTS usage_residency (minute, adapter, replica, slot_s,
    PRIMARY KEY (minute, adapter, replica));
"""


class UsageStore:
    """Usage records in a SQLite file (see the module docstring)."""

    def __init__(self, path: str | Path, retention_s: float = 7 * 86400.0):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_s
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def record(self, records: Iterable[UsageRecord]) -> int:
        """Store records (merging parts of a request already stored); returns how many were new."""
        new = 0
        with self._transaction():
            for part in records:
                before = self._get(part.request_id)
                if before is None:
                    new += 1
                else:
                    self._bucket(before, -1)
                rec = part if before is None else merge(before, part)
                self._db.execute(_UPSERT_REQUEST,
                                 (*astuple(rec)[:-3], rec.outcome.value, rec.ended_at, int(rec.preempted)))
                self._bucket(rec, +1)
        return new

    def record_residency(self, minute: int, replica: str, slot_s: Mapping[str, float]) -> None:
        """Add slot-seconds of residency per adapter, for one replica and minute."""
        with self._transaction():
            for adapter, seconds in slot_s.items():
                self._db.execute(
                    "INSERT INTO usage_residency VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE "
                    "SET slot_s = slot_s + excluded.slot_s", (minute, adapter, replica, seconds))

    def get(self, request_id: str) -> UsageRecord | None:
        """The record of one request, while it is retained."""
        return self._get(request_id)

    def query(self, *, group_by: tuple[str, ...] = ("tenant",), tenant: str | None = None,
              adapter: str | None = None, version: int | None = None, sla_class: str | None = None,
              since: float | None = None, until: float | None = None) -> list[dict[str, object]]:
        """Sums per group over the minutes in [since, until) (Unix seconds), filtered; rows sorted."""
        bad = [g for g in group_by if g not in GROUPS]
        if bad:
            raise RequestError(f"group_by {bad[0]!r} is not one of {', '.join(GROUPS)}")
        where, args = ["1"], []
        for column, value in (("tenant", tenant), ("adapter", adapter), ("version", version),
                              ("sla_class", sla_class)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if since is not None:
            where.append("minute >= ?")
            args.append(int(since // 60))
        if until is not None:
            where.append("minute < ?")
            args.append(-int(-until // 60))
        keys = [f"{_GROUP_SQL[g]} AS \"{g}\"" for g in group_by]
        sums = [f"SUM({s}) AS {s}" for s in SUMS]
        order = f" GROUP BY {', '.join(map(str, range(1, len(keys) + 1)))} ORDER BY " \
                f"{', '.join(map(str, range(1, len(keys) + 1)))}" if keys else ""
        cursor = self._db.execute(f"SELECT {', '.join([*keys, *sums])} FROM usage_minutes "
                                  f"WHERE {' AND '.join(where)}{order}", args)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor if row[len(keys)] is not None]

    def residency(self, *, since: float | None = None) -> dict[str, float]:
        """Slot-seconds per adapter since `since` (Unix seconds), all replicas."""
        minute = -1 if since is None else int(since // 60)
        rows = self._db.execute("SELECT adapter, SUM(slot_s) FROM usage_residency WHERE minute >= ? "
                                "GROUP BY adapter ORDER BY adapter", (minute,))
        return dict(rows.fetchall())

    def prune(self, now: float) -> int:
        """Forget per-request records that ended more than `retention_s` before `now` (the per-minute
        sums stay); returns how many."""
        with self._transaction():
            return self._db.execute("DELETE FROM usage_requests WHERE ended_at < ?",
                                    (now - self.retention_s,)).rowcount

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> sqlite3.Connection:
        self._db.execute("BEGIN")
        return self._db

    def _get(self, request_id: str) -> UsageRecord | None:
        row = self._db.execute("SELECT * FROM usage_requests WHERE request_id = ?", (request_id,)).fetchone()
        if row is None:
            return None
        values = dict(zip(_COLUMNS, row, strict=True))
        return UsageRecord(**{**values, "outcome": Outcome(values["outcome"]),
                              "preempted": bool(values["preempted"])})

    def _bucket(self, rec: UsageRecord, sign: int) -> None:
        """Add (sign +1) or take out (-1) a record's contribution to its minute's sums."""
        key = (rec.minute, rec.tenant, rec.adapter, rec.version, rec.sla_class, rec.base_model)
        values = [sign * v for v in (1, rec.prompt_tokens, rec.cached_tokens, rec.output_tokens,
                                     rec.device_s, rec.queue_s)]
        self._db.execute(
            f"INSERT INTO usage_minutes VALUES ({', '.join('?' * (len(_KEY) + len(SUMS)))}) ON CONFLICT DO "
            f"UPDATE SET {', '.join(f'{s} = {s} + excluded.{s}' for s in SUMS)}", (*key, *values))


__all__ = ["GROUPS", "SUMS", "UsageStore"]

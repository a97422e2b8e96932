"""The durable usage store: usage records aggregated per minute in a database, one record per request id.

The database is SQLite (a file on the usage store's node, the default) or PostgreSQL
(`usage_store_uri`), behind `tenancy.usage_db.UsageDatabase`: both run the same SQL.

Two tables. `usage_requests` keeps each request's record (exactly one per request id; a later part
of the same request is merged into it by `usage_record.merge`, never added as a second one), for
`retention_s` after it ended (`prune`), which bounds it. `usage_minutes` keeps the per-minute sums per
(tenant, adapter, version, SLA class, base model): requests, prompt, cached and output tokens,
device-seconds and queue-seconds; a merged part moves the request's old contribution out of its
bucket and the merged one in, so the sums always equal the sum of the records, and they outlive the
per-request rows. `usage_residency` keeps slot-seconds (`slot_s`: the adapter held a device slot) and
load seconds (`load_s`: its fetch and copy into a slot) per (minute, adapter id, replica); a replica
ships them in its batches (`usage_record.Residency`), so they too count exactly once. A file from
before `load_s` (or `usage_requests.delivered`, the record's flag that its output tokens are what
the client received) existed gets the column (0) when it is opened. `query` grouped by adapter alone adds
`slot_s` and `load_s` per adapter name when asked (`residency=True`): the table has no tenant, so the
caller asks only for an unscoped query (an admin's, `lora-cluster usage`).

`usage_batches` makes a sender's batches count exactly once (`usage_record.UsageBatch`): per source,
the highest batch `seq` taken, in the same transaction as the batch's records, so a batch sent again
after its reply was lost (or after the store restarted) writes nothing. One row per source, pruned
with the records (`retention_s` after the source's last batch) and at most `MAX_SOURCES` rows (the
least recently heard of go first).

`usage_export_pending` notes, once `track_exports` is called, each minute whose sums or residency
changed and are not yet exported (`tenancy.usage_export`), with a change count so that an export that
raced a change leaves the minute pending; at most one row per minute, deleted as the minute is exported.
`usage_export_targets` names the export targets seen, so that a new one is sent every minute stored.

Every write is one transaction (a killed process loses nothing it committed). Calls block on the
disk or the network: an event loop calls them on a worker thread. One writing store object per
database (the `UsageSink`); readers (`lora-cluster usage`) may open their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import astuple, fields
from pathlib import Path

from lora_cluster.errors import RequestError
from lora_cluster.tenancy.usage_db import UsageDatabase, open_usage_database
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch, UsageRecord, adapter_version, merge

MAX_SOURCES = 10_000  # senders whose last batch seq the store remembers

GROUPS = ("tenant", "adapter", "version", "class", "hour", "day")  # what `query` may group by
_GROUP_COLUMN = {"tenant": "tenant", "adapter": "adapter", "version": "version", "class": "sla_class"}
SUMS = ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "device_s", "queue_s")
_FLOAT_SUMS = ("device_s", "queue_s")
_KEY = ("minute", "tenant", "adapter", "version", "sla_class", "base_model")
_COLUMNS = [f.name for f in fields(UsageRecord)]
_SQL_TYPES = {"str": "TEXT", "Outcome": "TEXT", "int": "BIGINT", "bool": "BIGINT",
              "float": "DOUBLE PRECISION"}
_REQUEST_COLUMNS = ", ".join(f"{f.name} {_SQL_TYPES[str(f.type).split()[0]]}" for f in fields(UsageRecord))
_KEY_COLUMNS = "minute BIGINT, tenant TEXT, adapter TEXT, version BIGINT, sla_class TEXT, base_model TEXT"
_SUM_COLUMNS = ", ".join(f"{s} {'DOUBLE PRECISION' if s in _FLOAT_SUMS else 'BIGINT'}" for s in SUMS)


def _upsert(table: str, n: int, key: Iterable[str], update: str) -> str:
    return (f"INSERT INTO {table} VALUES ({', '.join('?' * n)}) ON CONFLICT ({', '.join(key)}) "
            f"DO UPDATE SET {update}")


_UPSERT_REQUEST = _upsert("usage_requests", len(_COLUMNS), ["request_id"],
                          ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:]))
_UPSERT_MINUTE = _upsert("usage_minutes", len(_KEY) + len(SUMS), _KEY,
                         ", ".join(f"{s} = usage_minutes.{s} + excluded.{s}" for s in SUMS))
_UPSERT_RESIDENCY = _upsert("usage_residency", 5, ["minute", "adapter", "replica"],
                            "slot_s = usage_residency.slot_s + excluded.slot_s, "
                            "load_s = usage_residency.load_s + excluded.load_s")
_UPSERT_BATCH = _upsert("usage_batches", 3, ["source"], "seq = excluded.seq, seen_at = excluded.seen_at")
_UPSERT_PENDING = _upsert("usage_export_pending", 2, ["minute"], "changes = usage_export_pending.changes + 1")
_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS usage_requests ({_REQUEST_COLUMNS}, PRIMARY KEY (request_id))",
    "CREATE INDEX IF NOT EXISTS usage_requests_ended ON usage_requests (ended_at)",
    f"CREATE TABLE IF NOT EXISTS usage_minutes ({_KEY_COLUMNS}, {_SUM_COLUMNS}, "
    f"PRIMARY KEY ({', '.join(_KEY)}))",
    "CREATE TABLE IF NOT EXISTS usage_residency (minute BIGINT, adapter TEXT, replica TEXT, "
    "slot_s DOUBLE PRECISION, load_s DOUBLE PRECISION DEFAULT 0, PRIMARY KEY (minute, adapter, replica))",
    "CREATE TABLE IF NOT EXISTS usage_batches (source TEXT PRIMARY KEY, seq BIGINT, "
    "seen_at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS usage_export_pending (minute BIGINT PRIMARY KEY, changes BIGINT)",
    "CREATE TABLE IF NOT EXISTS usage_export_targets (target TEXT PRIMARY KEY)",
)
# columns added since the first release: (table, column, type), added (default 0) to an older file
_ADDED_COLUMNS = (("usage_residency", "load_s", "DOUBLE PRECISION"),
                  ("usage_requests", "delivered", "BIGINT"))


def _row(rec: UsageRecord) -> tuple[object, ...]:
    """A record's `usage_requests` row, in `_COLUMNS` order (an outcome as its text, a flag as 0 or 1)."""
    return tuple(value.value if isinstance(value, Outcome) else int(value) if isinstance(value, bool)
                 else value for value in astuple(rec))


class UsageStore:
    """Usage records in a database (see the module docstring): a SQLite file's path, or an open
    `UsageDatabase` (`tenancy.usage_db`: SQLite or PostgreSQL)."""

    def __init__(self, db: str | Path | UsageDatabase, retention_s: float = 7 * 86400.0):
        self.retention_s = retention_s
        self._db: UsageDatabase = open_usage_database(db) if isinstance(db, str | Path) else db
        with self._db.transaction():
            for statement in _SCHEMA:
                self._db.execute(statement)
            for table, column, sql_type in _ADDED_COLUMNS:  # a file from before the column existed
                columns = self._db.execute(f"SELECT * FROM {table} WHERE false").description
                if column not in [c[0] for c in columns]:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type} DEFAULT 0")
        self._tracking = False  # whether changed minutes are noted for export (`track_exports`)

    def record(self, records: Iterable[UsageRecord]) -> int:
        """Store records (merging parts of a request already stored); returns how many were new."""
        with self._db.transaction():
            return self._record(records)

    def record_batch(self, batch: UsageBatch) -> int:
        """Store a sender's batch exactly once (see the module docstring); returns how many requests
        were new, 0 for a batch taken before (then nothing is written)."""
        with self._db.transaction():
            row = self._db.execute("SELECT seq FROM usage_batches WHERE source = ?",
                                   (batch.source,)).fetchone()
            if row is not None and batch.seq <= row[0]:
                return 0
            new = self._record(batch.records)
            for part in batch.residency:
                self._db.execute(_UPSERT_RESIDENCY, (part.minute, part.adapter, part.replica, part.slot_s,
                                                     part.load_s))
                if self._tracking:  # the minute's residency file is written again
                    self._db.execute(_UPSERT_PENDING, (part.minute, 1))
            self._db.execute(_UPSERT_BATCH, (batch.source, batch.seq, batch.seen_at))
            return new

    def _record(self, records: Iterable[UsageRecord]) -> int:
        new = 0
        for part in records:
            before = self._get(part.request_id)
            if before is None:
                new += 1
            else:
                self._bucket(before, -1)
            rec = part if before is None else merge(before, part)
            self._db.execute(_UPSERT_REQUEST, _row(rec))
            self._bucket(rec, +1)
        return new

    def record_residency(self, minute: int, replica: str, slot_s: Mapping[str, float],
                         load_s: Mapping[str, float] | None = None) -> None:
        """Add slot-seconds of residency and load seconds per adapter, for one replica and minute."""
        load_s = load_s or {}
        with self._db.transaction():
            for adapter in {**slot_s, **load_s}:
                self._db.execute(_UPSERT_RESIDENCY, (minute, adapter, replica, slot_s.get(adapter, 0.0),
                                                     load_s.get(adapter, 0.0)))
            if self._tracking and (slot_s or load_s):  # the minute's residency file is written again
                self._db.execute(_UPSERT_PENDING, (minute, 1))

    def get(self, request_id: str) -> UsageRecord | None:
        """The record of one request, while it is retained."""
        return self._get(request_id)

    def query(self, *, group_by: tuple[str, ...] = ("tenant",), tenant: str | None = None,
              adapter: str | None = None, version: int | None = None, sla_class: str | None = None,
              since: float | None = None, until: float | None = None,
              residency: bool = False) -> list[dict[str, object]]:
        """Sums per group over the minutes in [since, until) (Unix seconds), filtered; rows sorted.
        With `residency`, grouped by adapter alone and not filtered by tenant, version or class, each
        row also has `slot_s` and `load_s` (an adapter resident without requests gets a row of its own)."""
        bad = [g for g in group_by if g not in GROUPS]
        if bad:
            raise RequestError(f"group_by {bad[0]!r} is not one of {', '.join(GROUPS)}")
        where, args = ["true"], []
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
        group_sql = {**_GROUP_COLUMN, "hour": self._db.hour_sql, "day": self._db.day_sql}
        keys = [f"{group_sql[g]} AS \"{g}\"" for g in group_by]
        sums = [f"SUM({s}) AS {s}" if s in _FLOAT_SUMS else f"CAST(SUM({s}) AS BIGINT) AS {s}" for s in SUMS]
        order = f" GROUP BY {', '.join(map(str, range(1, len(keys) + 1)))} ORDER BY " \
                f"{', '.join(map(str, range(1, len(keys) + 1)))}" if keys else ""
        cursor = self._db.execute(f"SELECT {', '.join([*keys, *sums])} FROM usage_minutes "
                                  f"WHERE {' AND '.join(where)}{order}", args)
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor if row[len(keys)] is not None]
        if residency and tuple(group_by) == ("adapter",) and tenant is None and version is None \
                and sla_class is None:
            rows = self._with_residency(rows, adapter, int(since // 60) if since is not None else None,
                                        -int(-until // 60) if until is not None else None)
        return rows

    def _with_residency(self, rows: list[dict[str, object]], adapter: str | None, first: int | None,
                        end: int | None) -> list[dict[str, object]]:
        """`rows` (grouped by adapter name) with each adapter's slot- and load seconds in [first, end)."""
        seconds: dict[str, list[float]] = {}
        for adapter_id, slot_s, load_s in self._db.execute(
                "SELECT adapter, SUM(slot_s), SUM(load_s) FROM usage_residency WHERE minute >= ? AND "
                "minute < ? GROUP BY adapter",
                (-1 if first is None else first, 2**62 if end is None else end)):
            name = adapter_version(adapter_id)[0]
            if adapter is None or name == adapter:
                total = seconds.setdefault(name, [0.0, 0.0])
                total[0] += slot_s or 0.0
                total[1] += load_s or 0.0
        by_name = {row["adapter"]: row for row in rows}
        for name in seconds.keys() - by_name.keys():
            by_name[name] = {"adapter": name, **{s: 0.0 if s in _FLOAT_SUMS else 0 for s in SUMS}}
        for name, row in by_name.items():
            row["slot_s"], row["load_s"] = seconds.get(str(name), [0.0, 0.0])
        return [by_name[name] for name in sorted(by_name, key=str)]

    def loads(self, *, since: float | None = None) -> dict[str, float]:
        """Load seconds per adapter id since `since` (Unix seconds), all replicas."""
        minute = -1 if since is None else int(since // 60)
        rows = self._db.execute("SELECT adapter, SUM(load_s) FROM usage_residency WHERE minute >= ? "
                                "GROUP BY adapter ORDER BY adapter", (minute,))
        return dict(rows.fetchall())

    def residency(self, *, since: float | None = None) -> dict[str, float]:
        """Slot-seconds per adapter since `since` (Unix seconds), all replicas."""
        minute = -1 if since is None else int(since // 60)
        rows = self._db.execute("SELECT adapter, SUM(slot_s) FROM usage_residency WHERE minute >= ? "
                                "GROUP BY adapter ORDER BY adapter", (minute,))
        return dict(rows.fetchall())

    def track_exports(self, target: str) -> int:
        """From now on note every minute whose sums change as pending export; a `target` (the export's
        URI) not seen before gets every minute stored so far. Returns how many minutes are pending."""
        with self._db.transaction():
            self._tracking = True
            known = self._db.execute("SELECT 1 FROM usage_export_targets WHERE target = ?", (target,))
            if known.fetchone() is None:
                self._db.execute("INSERT INTO usage_export_targets VALUES (?)", (target,))
                for table in ("usage_minutes", "usage_residency"):
                    self._db.execute(f"INSERT INTO usage_export_pending SELECT DISTINCT minute, 1 "
                                     f"FROM {table} WHERE true ON CONFLICT DO NOTHING")
            return self._db.execute("SELECT COUNT(*) FROM usage_export_pending").fetchone()[0]

    def pending_exports(self, before_minute: int, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` (minute, change count) pending export with minute < `before_minute`, oldest first."""
        return [(m, c) for m, c in self._db.execute(
            "SELECT minute, changes FROM usage_export_pending WHERE minute < ? ORDER BY minute LIMIT ?",
            (before_minute, limit))]

    def minute_sums(self, minute: int) -> list[dict[str, object]]:
        """The sums of one minute per (tenant, adapter, version, class, base model) that count a request,
        sorted by those keys."""
        cursor = self._db.execute(f"SELECT {', '.join(_KEY[1:] + SUMS)} FROM usage_minutes WHERE minute = ? "
                                  f"AND requests != 0 ORDER BY {', '.join(_KEY[1:])}", (minute,))
        return [dict(zip(_KEY[1:] + SUMS, row, strict=True)) for row in cursor]

    def minute_residency(self, minute: int) -> list[dict[str, object]]:
        """The slot-seconds and load seconds of one minute per (adapter, replica), sorted by those keys."""
        cursor = self._db.execute("SELECT adapter, replica, slot_s, load_s FROM usage_residency "
                                  "WHERE minute = ? ORDER BY adapter, replica", (minute,))
        return [{"adapter": a, "replica": r, "slot_s": s, "load_s": ld} for a, r, s, ld in cursor]

    def exported(self, minute: int, changes: int) -> bool:
        """The minute's sums as read at `changes` were exported: no longer pending, unless they changed
        since (then it stays pending and is exported again). Returns whether it left the pending list."""
        with self._db.transaction():
            return self._db.execute("DELETE FROM usage_export_pending WHERE minute = ? AND changes = ?",
                                    (minute, changes)).rowcount > 0

    def prune(self, now: float) -> int:
        """Forget per-request records that ended more than `retention_s` before `now` (the per-minute
        sums stay), and the batch seqs of sources not heard of since, or past `MAX_SOURCES`; returns
        how many records."""
        with self._db.transaction():
            self._db.execute("DELETE FROM usage_batches WHERE seen_at < ?", (now - self.retention_s,))
            self._db.execute("DELETE FROM usage_batches WHERE source NOT IN (SELECT source FROM "
                             "usage_batches ORDER BY seen_at DESC LIMIT ?)", (MAX_SOURCES,))
            return self._db.execute("DELETE FROM usage_requests WHERE ended_at < ?",
                                    (now - self.retention_s,)).rowcount

    def sources(self) -> int:
        """How many senders' batch seqs the store remembers."""
        return self._db.execute("SELECT COUNT(*) FROM usage_batches").fetchone()[0]

    def close(self) -> None:
        self._db.close()

    def _get(self, request_id: str) -> UsageRecord | None:
        row = self._db.execute("SELECT * FROM usage_requests WHERE request_id = ?", (request_id,)).fetchone()
        if row is None:
            return None
        values = dict(zip(_COLUMNS, row, strict=True))
        return UsageRecord(**{**values, "outcome": Outcome(values["outcome"]),
                              "preempted": bool(values["preempted"]), "delivered": bool(values["delivered"])})

    def _bucket(self, rec: UsageRecord, sign: int) -> None:
        """Add (sign +1) or take out (-1) a record's contribution to its minute's sums."""
        key = (rec.minute, rec.tenant, rec.adapter, rec.version, rec.sla_class, rec.base_model)
        values = [sign * v for v in (1, rec.prompt_tokens, rec.cached_tokens, rec.output_tokens,
                                     rec.device_s, rec.queue_s)]
        self._db.execute(_UPSERT_MINUTE, (*key, *values))
        if self._tracking:
            self._db.execute(_UPSERT_PENDING, (rec.minute, 1))


__all__ = ["GROUPS", "MAX_SOURCES", "SUMS", "UsageStore"]

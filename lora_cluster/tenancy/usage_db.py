"""The usage store's databases: SQLite (the embedded default) and PostgreSQL, behind one small protocol.

`UsageStore` writes one SQL for both: typed columns, `INSERT ... ON CONFLICT (key) DO UPDATE` upserts,
`?` placeholders. A database supplies what differs: its placeholders (PostgreSQL's `%s`; the store's
SQL holds no other `?` or `%`), the expressions that turn a Unix minute into an hour or a day
(`hour_sql`, `day_sql`), and how a transaction begins and ends.

* `SqliteDatabase`: a file (`usage_db_path`), WAL journal (a killed process loses nothing it
  committed), one connection used from one thread at a time.
* `PostgresDatabase`: a `postgresql://` URL (`usage_store_uri`) through psycopg 3, an optional
  dependency (`pip install 'lora-cluster[postgres]'`; without it: ConfigError naming the extra). One
  autocommit connection, each store write in one `transaction()`; a connection found closed (the
  server restarted) is opened again on the next call, and the call that found it broken fails (its
  caller retries: a shipper resends its batch, which the store takes exactly once). `where` is the
  URL without user and password.

`open_usage_database` picks by the location's form.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from lora_cluster.errors import ConfigError

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class UsageDatabase(Protocol):
    """A connection the store's SQL runs on (module docstring)."""

    where: str  # for logs and errors: a path or a URL without credentials
    hour_sql: str  # the hour of the column `minute` (a Unix minute), as 2026-11-30T00:00:00Z
    day_sql: str  # its day, as 2026-11-30

    def execute(self, sql: str, args: Sequence[object] = ()) -> Any: ...

    def transaction(self) -> AbstractContextManager[object]: ...

    def close(self) -> None: ...


class SqliteDatabase:
    """A SQLite file (module docstring)."""

    hour_sql = "strftime('%Y-%m-%dT%H:00:00Z', minute * 60, 'unixepoch')"
    day_sql = "strftime('%Y-%m-%d', minute * 60, 'unixepoch')"

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.where = str(path)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")

    def execute(self, sql: str, args: Sequence[object] = ()) -> Any:
        return self._db.execute(sql, args)

    @contextmanager
    def transaction(self) -> Iterator[object]:
        self._db.execute("BEGIN")
        with self._db:  # commits, or rolls back on an exception
            yield self

    def close(self) -> None:
        self._db.close()


class PostgresDatabase:
    """A PostgreSQL database (module docstring)."""

    hour_sql = "to_char(to_timestamp(minute * 60) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:00:00\"Z\"')"
    day_sql = "to_char(to_timestamp(minute * 60) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

    def __init__(self, url: str):
        self._psycopg, self._url = require_psycopg(), url
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
        self.where = f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"
        self._conn = self._connect()

    def _connect(self) -> Any:
        return self._psycopg.connect(self._url, autocommit=True, connect_timeout=10)

    def _live(self) -> Any:
        if self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def execute(self, sql: str, args: Sequence[object] = ()) -> Any:
        return self._live().execute(sql.replace("?", "%s"), tuple(args))

    def transaction(self) -> AbstractContextManager[object]:
        return self._live().transaction()

    def close(self) -> None:
        self._conn.close()


def require_psycopg() -> Any:
    """The `psycopg` module, or ConfigError naming the extra (a PostgreSQL usage store needs it)."""
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError("usage_store_uri names a PostgreSQL database but psycopg is not installed on "
                          "this node: pip install 'lora-cluster[postgres]'") from exc
    return psycopg


def open_usage_database(location: str | Path) -> SqliteDatabase | PostgresDatabase:
    """PostgreSQL for a `postgresql://` URL, else the SQLite file at `location` (`~` expanded)."""
    text = str(location)
    if text.startswith(POSTGRES_SCHEMES):
        return PostgresDatabase(text)
    if "://" in text:
        raise ConfigError(f"usage store {urlsplit(text).scheme}://...: use a SQLite file path or "
                          "postgresql://")
    return SqliteDatabase(Path(text).expanduser())


__all__ = ["POSTGRES_SCHEMES", "PostgresDatabase", "SqliteDatabase", "UsageDatabase", "open_usage_database",
           "require_psycopg"]

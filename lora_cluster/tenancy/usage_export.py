"""The usage export: each closed minute's usage sums written as one Parquet file, for a billing pipeline.

What is exported: the per-minute sums (`UsageStore.minute_sums`), one row per (tenant, adapter,
version, SLA class, base model) that counts a request in the minute, with requests, prompt, cached and
output tokens, device-seconds and queue-seconds: the store's durable unit, kept for good, which a
pipeline rates and adds up as it likes. Per-request records are not exported (they are kept for
`usage_retention_s` only and carry request ids a bill does not need).

Where: `<target>/usage/date=YYYY-MM-DD/part-<minute>.parquet`, `<minute>` the Unix minute (Unix
seconds // 60) and `date` its UTC day: a Hive partition, which Spark, Athena, DuckDB and
`pyarrow.dataset(..., partitioning="hive")` read as a `date` column. The schema is `SCHEMA`, fixed
(a column is never renamed or retyped; one added would be added at the end); `minute_start` is a
UTC timestamp in milliseconds (Parquet has no seconds unit).

Exactly once per minute: a minute's file is its key's only file, written whole (the minute's current
sums) only once the minute is closed, `close_after_s` after its end (the store takes records up to a
flush interval and a send timeout late). A minute the store changes after its export (a late batch,
a request's later part) is pending again and its file is rewritten under the same key with the new
sums; a restart that finds a minute still pending (written, not yet marked) writes the same key
again. A reader never sees a minute twice, and the files always add up to the store's sums.

Residency: the minute's slot-seconds and load seconds per (adapter, replica)
(`UsageStore.minute_residency`), a second dataset `<target>/residency/date=YYYY-MM-DD/part-<minute>.parquet`
(`RESIDENCY_COLUMNS`), under the same rule: a minute is pending when its sums or its residency change,
and its export writes both files (the residency file only when the minute has residency). A separate
dataset, not extra rows, because its key (adapter, replica) and its measures share no column with the
sums' but the minute and the adapter: rows of both in one file would need every other column nullable.
The store keeps no tenant and no version for residency (the engine's slot is keyed by adapter id), so
the files carry none.

The exporter reads the store through `run_store` (the store's own thread) and writes through `run_io`
(another thread: a slow bucket never holds up the store). pyarrow is an optional dependency
(`pip install lora-cluster[parquet]`): `require_pyarrow` is the check made at start.
"""

from __future__ import annotations

import io
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from lora_cluster.errors import ConfigError

T = TypeVar("T")
MAX_MINUTES_PER_ROUND = 1440  # a backfill or a long outage is written a day per round
COLUMNS = (("minute_start", "timestamp[ms, tz=UTC]"), ("tenant", "string"), ("adapter", "string"),
           ("version", "int64"), ("sla_class", "string"), ("base_model", "string"),
           ("requests", "int64"), ("prompt_tokens", "int64"), ("cached_tokens", "int64"),
           ("output_tokens", "int64"), ("device_s", "double"), ("queue_s", "double"))
RESIDENCY_COLUMNS = (("minute_start", "timestamp[ms, tz=UTC]"), ("adapter", "string"), ("replica", "string"),
                     ("slot_s", "double"), ("load_s", "double"))


class ExportSource(Protocol):
    """What the exporter reads and marks (`UsageStore`)."""

    def pending_exports(self, before_minute: int, limit: int) -> list[tuple[int, int]]: ...

    def minute_sums(self, minute: int) -> list[dict[str, object]]: ...

    def minute_residency(self, minute: int) -> list[dict[str, object]]: ...

    def exported(self, minute: int, changes: int) -> bool: ...


class ExportTarget(Protocol):
    """Where the files go (`usage_export_target`): `put` writes or overwrites one key, whole."""

    where: str  # for logs and errors: the URI, no credentials

    def put(self, key: str, data: bytes) -> None: ...


def require_pyarrow(uri: str) -> Any:
    """The `pyarrow` module, or ConfigError naming the missing extra when `usage_export_uri` is set."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigError(f"usage_export_uri is set ({uri!r}) but pyarrow is not installed on this node: "
                          "pip install 'lora-cluster[parquet]', or set usage_export_uri to ''") from exc
    return pyarrow


def schema(columns: tuple[tuple[str, str], ...] = COLUMNS) -> Any:
    """The files' pyarrow schema (`COLUMNS`; `RESIDENCY_COLUMNS` for the residency files)."""
    pa = require_pyarrow("")
    types = {"string": pa.string(), "int64": pa.int64(), "double": pa.float64(),
             "timestamp[ms, tz=UTC]": pa.timestamp("ms", tz="UTC")}
    return pa.schema([pa.field(name, types[kind], nullable=False) for name, kind in columns])


def minute_key(minute: int, dataset: str = "usage") -> str:
    """The key of a minute's file under the target: `<dataset>/date=YYYY-MM-DD/part-<minute>.parquet`
    (`dataset`: `usage` for the sums, `residency` for the slot-seconds)."""
    day = time.strftime("%Y-%m-%d", time.gmtime(minute * 60))
    return f"{dataset}/date={day}/part-{minute}.parquet"


def closed_before(now: float, close_after_s: float) -> int:
    """The first minute not yet closed at `now`: every minute before it ended `close_after_s` ago."""
    return int((now - close_after_s) // 60)


def parquet_bytes(minute: int, rows: list[dict[str, object]],
                  columns: tuple[tuple[str, str], ...] = COLUMNS) -> bytes:
    """One minute's rows as a Parquet file (`columns`: `COLUMNS` for the sums, `RESIDENCY_COLUMNS`);
    token counts are whole numbers in the store."""
    pa = require_pyarrow("")
    import pyarrow.parquet as pq

    values: dict[str, list[object]] = {name: [] for name, _ in columns}
    for row in rows:
        for name, kind in columns:
            value = minute * 60_000 if name == "minute_start" else row[name]  # in ms
            values[name].append(round(value) if kind == "int64" else value)
    table = pa.Table.from_pydict(values, schema=schema(columns))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


async def _direct(fn: Callable[[], T]) -> T:
    return fn()


class UsageExporter:
    """Writes each closed minute's file once, and again only when the store changed it (module docstring)."""

    def __init__(self, source: ExportSource, target: ExportTarget, close_after_s: float, *,
                 run_store: Callable[[Callable[[], Any]], Awaitable[Any]] = _direct,
                 run_io: Callable[[Callable[[], Any]], Awaitable[Any]] = _direct):
        self._source, self.target, self.close_after_s = source, target, close_after_s
        self._run_store, self._run_io = run_store, run_io
        self.max_per_round = MAX_MINUTES_PER_ROUND
        self.written = 0  # minutes written since start, rewrites included

    async def export_due(self, now: float) -> int:
        """Write the file of every pending closed minute (at most `max_per_round`, oldest first); returns
        how many. A failed write raises, leaving that minute and the later ones pending."""
        before = closed_before(now, self.close_after_s)
        pending = await self._run_store(lambda: self._source.pending_exports(before, self.max_per_round))
        for minute, changes in pending:
            rows = await self._run_store(lambda m=minute: self._source.minute_sums(m))
            resided = await self._run_store(lambda m=minute: self._source.minute_residency(m))
            data = await self._run_io(lambda m=minute, r=rows: parquet_bytes(m, r))
            await self._run_io(lambda m=minute, d=data: self.target.put(minute_key(m), d))
            if resided:  # slot-seconds only add up: a minute once with residency never needs an empty file
                data = await self._run_io(
                    lambda m=minute, r=resided: parquet_bytes(m, r, RESIDENCY_COLUMNS))
                await self._run_io(lambda m=minute, d=data: self.target.put(minute_key(m, "residency"), d))
            await self._run_store(lambda m=minute, c=changes: self._source.exported(m, c))
            self.written += 1
        return len(pending)


__all__ = ["COLUMNS", "MAX_MINUTES_PER_ROUND", "RESIDENCY_COLUMNS", "ExportSource", "ExportTarget",
           "UsageExporter", "closed_before", "minute_key", "parquet_bytes", "require_pyarrow", "schema"]

"""The usage store's write cost per batch on SQLite and PostgreSQL, with and without export tracking, and
the Parquet export's cost per minute file, to a folder and to S3 (a moto server on 127.0.0.1).

Workload: `--batches` batches of `--batch` records each (a replica's flush), every record a new request
of one of 20 tenants and 10 adapters, ended over the last 60 minutes. Each store is written once
without export tracking and once with it (`UsageStore.track_exports`: one more upsert per record); the
time is the mean of `record_batch` per batch (one transaction each). Then the 60 minutes are exported
(`UsageExporter.export_due`), and the time per minute file is the round's time divided by the files
written. `--reps` repetitions, the cases alternating within each; the median and the range. PostgreSQL
runs when `--postgres-url` names a server (a fresh database is created and dropped there); S3 when moto
is installed.

Run: python benchmarks/bench_usage_store.py [--batches 50] [--batch 200] [--reps 3] [--postgres-url URL]
     [--out docs/bench_usage_store.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common import emit, header, load_avg

from lora_cluster.tenancy.usage_export import UsageExporter
from lora_cluster.tenancy.usage_export_target import FolderTarget, open_export_target
from lora_cluster.tenancy.usage_record import Outcome, UsageBatch, UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore


def batches(n: int, size: int, now: float, seed: int = 0) -> list[UsageBatch]:
    rng = random.Random(seed)
    out = []
    for b in range(n):
        records = tuple(UsageRecord(
            request_id=f"cmpl-{b}-{k}", tenant=f"t{rng.randrange(20)}", adapter=f"a{rng.randrange(10)}",
            version=1, sla_class="standard", base_model="demo", replica="r0",
            prompt_tokens=rng.randrange(4, 2000), cached_tokens=0, output_tokens=rng.randrange(1, 500),
            device_s=rng.random(), queue_s=rng.random() / 10, outcome=Outcome.COMPLETED,
            ended_at=now - rng.uniform(60, 3600)) for k in range(size))
        out.append(UsageBatch("replica-0", b + 1, records))
    return out


def write_ms(location: str, work: list[UsageBatch], track: bool) -> tuple[float, UsageStore]:
    store = UsageStore(location)
    if track:
        store.track_exports("bench")
    start = time.perf_counter()
    for batch in work:
        store.record_batch(batch)
    return (time.perf_counter() - start) / len(work) * 1e3, store


def export_ms(store: UsageStore, target: object, now: float) -> tuple[float, int]:
    exporter = UsageExporter(store, target, close_after_s=15.0)  # type: ignore[arg-type]
    start = time.perf_counter()
    written = asyncio.run(exporter.export_due(now))
    return (time.perf_counter() - start) / max(written, 1) * 1e3, written


@contextmanager
def postgres_database(url: str) -> Iterator[str]:
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


@contextmanager
def moto_bucket() -> Iterator[str | None]:
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        yield None
        return
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://{host}:{port}")
    boto3.client("s3").create_bucket(Bucket="usage-bench")
    try:
        yield "s3://usage-bench/export"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    now = time.time()
    work = batches(args.batches, args.batch, now)
    writes: dict[tuple[str, str], list[float]] = {}
    exports: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, moto_bucket() as uri:
        for rep in range(args.reps):  # the cases alternate within each repetition: load drifts less
            for track in (False, True):
                ms, store = write_ms(str(Path(tmp) / f"{rep}-{track}.db"), work, track)
                writes.setdefault(("SQLite", "on" if track else "off"), []).append(ms)
                if track:
                    folder_ms, _ = export_ms(store, FolderTarget(Path(tmp) / f"export-{rep}"), now)
                    exports.setdefault("folder", []).append(folder_ms)
                    if uri is not None:
                        store.track_exports(f"{uri}/{rep}")  # a new target: every minute again
                        s3_ms, _ = export_ms(store, open_export_target(f"{uri}/{rep}"), now)
                        exports.setdefault("S3 (moto, 127.0.0.1)", []).append(s3_ms)
                store.close()
                if args.postgres_url:
                    with postgres_database(args.postgres_url) as location:
                        ms, store = write_ms(location, work, track)
                        store.close()
                    writes.setdefault(("PostgreSQL", "on" if track else "off"), []).append(ms)
    rows = [f"| {kind} | {track} | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | "
            f"{statistics.median(v) / args.batch * 1e3:.0f} |" for (kind, track), v in writes.items()]
    export_rows = [f"| {kind} | 60 | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) |"
                   for kind, v in exports.items()]
    lines = header("Usage store: write cost per batch, export cost per minute",
                   "python " + " ".join(sys.argv), changed={},
                   machine_note=f" (load average at the end {load_avg()}; PostgreSQL 15 on the same machine)")
    lines += ["", f"{args.batches} batches of {args.batch} new requests (20 tenants, 10 adapters, "
              "60 minutes).", "",
              "| database | export tracking | ms per batch, median (range) | us per record |",
              "|---|---|---|---|", *rows, "",
              "| export target | minute files | ms per file, median (range) |", "|---|---|---|", *export_rows]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()

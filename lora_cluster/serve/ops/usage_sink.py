"""The usage-store deployment: one replica that owns the `UsageStore` (`usage_db_path`, or `usage_store_uri`).

Replicas and ingresses send their records in batches (`serve.ops.usage_shipper`), not through the
cluster controller. Every store call runs on one worker thread (SQLite writes never block the
event loop; one thread keeps the connection's calls in order). Each batch is one transaction, taken
exactly once by its id (a batch sent again after a lost reply writes nothing), so a killed actor loses
nothing it acknowledged and counts nothing twice; a restarted one reopens the same file. Per-request rows
older than `usage_retention_s` are pruned at most once per `PRUNE_EVERY_S`.

With `usage_export_uri`, a background task (started by the first call, Serve's health checks
included) writes the closed minutes' Parquet files every `usage_export_interval_s`
(`tenancy.usage_export`): it reads the store on the store's thread and writes on a thread of its own.
A failed round is logged (once per outage) and its minutes stay pending in the store for the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from lora_cluster.serve.ops.background import keep_running
from lora_cluster.tenancy.usage_db import open_usage_database
from lora_cluster.tenancy.usage_export import UsageExporter, require_pyarrow
from lora_cluster.tenancy.usage_export_target import open_export_target
from lora_cluster.tenancy.usage_record import UsageBatch
from lora_cluster.tenancy.usage_store import UsageStore

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 3600.0


class UsageSinkCore:
    """The store behind one worker thread (the deployment is a thin wrapper over it)."""

    def __init__(self, db_path: str, retention_s: float, *, export_uri: str = "",
                 export_interval_s: float = 60.0, close_after_s: float = 15.0):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-store")
        self.store = UsageStore(open_usage_database(db_path), retention_s)  # `~`: this node's user's home
        self._pruned_at = -PRUNE_EVERY_S
        self.exporter: UsageExporter | None = None
        self.export_interval_s = export_interval_s
        self._export_task: asyncio.Task[None] | None = None
        if export_uri:
            require_pyarrow(export_uri)
            self.store.track_exports(export_uri)
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-export")
            self.exporter = UsageExporter(self.store, open_export_target(export_uri), close_after_s,
                                          run_store=self._run, run_io=self._run_io)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def _run_io(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn)

    async def record(self, batch: UsageBatch) -> int:
        """Store a batch exactly once (one transaction; `UsageStore.record_batch`); returns how many
        requests were new."""
        self._keep_exporting()
        new = await self._run(self.store.record_batch, batch)
        if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            await self._run(self.store.prune, time.time())  # records end at Unix times
        return new

    async def query(self, **filters: Any) -> list[dict[str, object]]:
        """`UsageStore.query` with the same keywords."""
        self._keep_exporting()
        return await self._run(self.store.query, **filters)

    async def check_health(self) -> None:
        """Serve's health check (every `health_check_period_s`): keeps the export task running."""
        self._keep_exporting()

    def _keep_exporting(self) -> None:
        if self.exporter is not None:
            self._export_task = keep_running(self._export_task, self._export_forever)

    async def _export_forever(self) -> None:
        failing = False
        while self.exporter is not None:
            backlog = False  # a full round: a backlog (a new target, an outage) is written without a pause
            try:
                written = await self.exporter.export_due(time.time())  # minutes are Unix minutes
                backlog = written >= self.exporter.max_per_round
                failing = False
            except Exception as exc:  # the target is down: the minutes stay pending for the next round
                if not failing:
                    log.warning("usage export to %s failed (%s); the minutes stay pending",
                                self.exporter.target.where, type(exc).__name__)
                failing = True
            if not backlog:
                await asyncio.sleep(self.export_interval_s)

    def close(self) -> None:
        if self._export_task is not None:
            self._export_task.cancel()
        if self.exporter is not None:
            self._io.shutdown()

        self._thread.submit(self.store.close).result()
        self._thread.shutdown()


@serve.deployment(name="UsageSink", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000, health_check_period_s=2.0)
class UsageSink(UsageSinkCore):
    """Every replica's usage records, in the store on this deployment's node (one replica)."""


__all__ = ["PRUNE_EVERY_S", "UsageSink", "UsageSinkCore"]

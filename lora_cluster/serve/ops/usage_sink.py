"""The usage-store deployment: one replica that owns the SQLite `UsageStore` at `usage_db_path`.

Replicas and ingresses send their records in batches (`serve.ops.usage_shipper`), not through the
cluster controller. Every store call runs on one worker thread (SQLite writes never block the
event loop; one thread keeps the connection's calls in order). Each batch is one transaction, so a
killed actor loses nothing it acknowledged; a restarted one reopens the same file. Per-request rows
older than `usage_retention_s` are pruned at most once per `PRUNE_EVERY_S`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ray import serve

from lora_cluster.tenancy.usage_record import UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore

PRUNE_EVERY_S = 3600.0


class UsageSinkCore:
    """The store behind one worker thread (the deployment is a thin wrapper over it)."""

    def __init__(self, db_path: str, retention_s: float):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-store")
        self.store = UsageStore(Path(db_path).expanduser(), retention_s)  # `~`: this node's user's home
        self._pruned_at = -PRUNE_EVERY_S

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def record(self, records: list[UsageRecord]) -> int:
        """Store a batch (one transaction); returns how many requests were new."""
        new = await self._run(self.store.record, records)
        if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            await self._run(self.store.prune, time.time())  # records end at Unix times
        return new

    async def query(self, **filters: Any) -> list[dict[str, object]]:
        """`UsageStore.query` with the same keywords."""
        return await self._run(self.store.query, **filters)

    def close(self) -> None:
        self._thread.submit(self.store.close).result()
        self._thread.shutdown()


@serve.deployment(name="UsageSink", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000, health_check_period_s=2.0)
class UsageSink(UsageSinkCore):
    """Every replica's usage records, in the store on this deployment's node (one replica)."""


__all__ = ["PRUNE_EVERY_S", "UsageSink", "UsageSinkCore"]

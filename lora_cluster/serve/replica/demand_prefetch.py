"""Demand prefetch: a replica's host tier filled ahead of requests with the adapters of most recent
demand in the cluster, at the lowest priority (issue 46, item 2).

Demand: every `period_s` (`prefetch_hot_period_s`) the replica asks the cluster controller for its
hot list (`ClusterController.hot_adapters`: the MAX_HOT busiest adapters with their rates; a controller
in shards: each shard's list, merged; `ControllerHotList`), a query apart from its reports. The list
drives a `cluster.prefetch_plan.PrefetchPlanner` (`set_demand`), the policy the simulator runs, which
hands out one adapter at a time to the store's own background lane (`PrefetchStore.prefetch`: its one
prefetch thread, never an engine loader worker). A prefetch goes through the store's tiers: the disk
tier, the cluster tier (another node's copy), or the source, after which the store publishes the
adapter to the cluster tier, so the cluster tier fills too.

Rules:
* lowest priority: nothing is handed out while the engine has a request's adapter fetch queued or
  running (`LiveLoads.live_fetches`); a prefetch that runs already is never interrupted (one adapter
  at most), and a live load of that adapter joins it (the store's single flight);
* bandwidth: the planner's bucket of `bytes_per_s` (`prefetch_bytes_per_s`), charged each adapter's
  real bytes once it lands (`PrefetchPlanner.settle`);
* bytes: an adapter is handed out only while the host tier's bytes plus its size stay within
  `max_bytes` (`prefetch_max_bytes`, at most the host tier's budget), so a prefetch evicts nothing.
  A size is known once an adapter was fetched; before that the largest size seen stands for it (for
  the very first adapter, 0: it may pass the bound by its own size);
* bounded: one prefetch in flight; the demand table, the sizes and the adapters whose prefetch failed
  (skipped until the next hot list) hold hot-list adapters only, at most MAX_HOT each, MAX_SIZES sizes.

Lifecycle (`State`): IDLE -> RUNNING (`start`, on the replica's event loop) -> STOPPED (`stop`: the
loop ends, a prefetch not yet started is cancelled, nothing is handed out after). `step` is the loop's
synchronous body (no blocking work: a lock-guarded read of the host tier and a submit); tests drive it
with an injected clock.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from lora_cluster.cluster.prefetch_plan import PrefetchPlanner
from lora_cluster.serve.ops.background import keep_running

log = logging.getLogger(__name__)
MAX_HOT = 32  # adapters of the controller's hot list a replica asks for
MAX_SIZES = 4096  # adapter sizes remembered (the oldest go first)
TICK_S = 0.2  # how often the loop plans while it runs


class State(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


class HostTier(Protocol):
    """The store's host tier as demand prefetch reads it (`store.host_cache.HostCache`)."""

    def __contains__(self, adapter_id: str) -> bool: ...

    @property
    def bytes(self) -> int: ...

    def nbytes(self, adapter_id: str) -> int | None: ...


class PrefetchStore(Protocol):
    """The store's lowest-priority path (`TieredAdapterStore.prefetch`) and its host tier."""

    @property
    def host(self) -> HostTier: ...

    def prefetch(self, adapter_id: str) -> Future[None]: ...


class LiveLoads(Protocol):
    """The engine's count of request fetches queued or running (`Engine.live_fetches`)."""

    def live_fetches(self) -> int: ...


class HotList(Protocol):
    """The cluster's busiest adapters with their rates (requests per 1,000 s); None: unreachable."""

    async def hot(self, k: int) -> list[tuple[str, int]] | None: ...


class SizeEstimates(dict[str, int]):
    """Adapter -> bytes; an adapter not fetched yet stands at the largest size seen (0 before any)."""

    def __missing__(self, adapter_id: str) -> int:
        return max(self.values(), default=0)

    def learn(self, adapter_id: str, nbytes: int) -> None:
        self.pop(adapter_id, None)
        self[adapter_id] = nbytes
        if len(self) > MAX_SIZES:
            del self[next(iter(self))]


class DemandPrefetch:
    """See the module docstring."""

    def __init__(self, hot: HotList, store: PrefetchStore, live: LiveLoads, *, bytes_per_s: float,
                 max_bytes: int, period_s: float, clock: Callable[[], float] = time.monotonic,
                 tick_s: float = TICK_S):
        self._hot, self._store, self._live = hot, store, live
        self.period_s, self.tick_s, self._clock = period_s, tick_s, clock
        self.sizes = SizeEstimates()
        self.planner = PrefetchPlanner((), self.sizes, bytes_per_s=bytes_per_s, max_bytes=max_bytes,
                                       clock=clock)
        self.state = State.IDLE
        self._flight: tuple[str, int, Future[None]] | None = None  # adapter, its estimate, its future
        self._failed: set[str] = set()  # hot adapters whose prefetch did not land, until the next list
        self._polled_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self.counts = {"prefetched": 0, "prefetched_bytes": 0, "failed": 0, "paused": 0, "polls": 0}

    # ----- queries ------------------------------------------------------------------------

    def in_flight(self) -> str | None:
        """The adapter being prefetched now, if any."""
        return None if self._flight is None else self._flight[0]

    def running(self) -> bool:
        """Whether its loop's task runs now."""
        return self._task is not None and not self._task.done()

    def counters(self) -> dict[str, int]:
        """Its counters as the replica reports them (fields of `serve.ops.metrics.COLD_START_COUNTERS`)."""
        return {"prefetches": self.counts["prefetched"], "prefetch_bytes": self.counts["prefetched_bytes"],
                "prefetch_failures": self.counts["failed"], "prefetch_skipped": self.counts["paused"]}

    # ----- commands -----------------------------------------------------------------------

    def observe_hot(self, hot: Sequence[tuple[str, int]]) -> None:
        """A new hot list (adapter, rate), busiest first: the demand the planner ranks by."""
        self.planner.set_demand(dict(hot[:MAX_HOT]))
        self._failed.clear()

    def step(self) -> str | None:
        """Settle a prefetch that ended, then hand out the next adapter if the rules allow (module
        docstring); returns the adapter handed out now, if any."""
        self._settle()
        if self.state is State.STOPPED or self._flight is not None:
            return None
        live = self._live.live_fetches() > 0
        if live and self.planner.demand:
            self.counts["paused"] += 1
        host = self._store.host
        jobs = self.planner.plan(1, skip=lambda a: a in self._failed or a in host, used_bytes=host.bytes,
                                 live_waiting=live)
        if not jobs:
            return None
        adapter_id = jobs[0]
        self._flight = (adapter_id, self.sizes[adapter_id], self._store.prefetch(adapter_id))
        return adapter_id

    def _settle(self) -> None:
        if self._flight is None or not self._flight[2].done():
            return
        adapter_id, estimate, _ = self._flight
        self._flight = None
        nbytes = self._store.host.nbytes(adapter_id)
        if nbytes is None:  # failed (logged by the store), or the host tier refused it
            self._failed.add(adapter_id)
            self.counts["failed"] += 1
            nbytes = 0
        else:
            self.sizes.learn(adapter_id, nbytes)
            self.counts["prefetched"] += 1
            self.counts["prefetched_bytes"] += nbytes
        self.planner.settle(adapter_id, estimate, nbytes)

    def start(self) -> None:
        """Run the loop on the running event loop (again, if it ended); nothing once stopped."""
        if self.state is not State.STOPPED:
            self.state = State.RUNNING
            self._task = keep_running(self._task, self._run)

    def stop(self) -> None:
        """End the loop; a prefetch not started yet is cancelled (one running ends on its own)."""
        self.state = State.STOPPED
        if self._task is not None:
            self._task.cancel()
        if self._flight is not None:
            self._flight[2].cancel()
            self._flight = None

    async def poll(self) -> None:
        """Ask for the hot list now (a list that cannot be had keeps the previous one)."""
        self._polled_at = self._clock()
        self.counts["polls"] += 1
        hot = await self._hot.hot(MAX_HOT)
        if hot is not None:
            self.observe_hot(hot)

    async def _run(self) -> None:
        while self.state is State.RUNNING:
            if self._clock() - self._polled_at >= self.period_s:
                await self.poll()
            try:
                self.step()
            except Exception:  # a defect here must not end prefetch for good, nor the replica
                log.exception("demand prefetch failed a step")
            await asyncio.sleep(self.tick_s)


class ControllerHotList:
    """`HotList` over the cluster controller's handle, or its shards' handles (each shard's hot list
    holds its own adapters: the lists are merged, busiest first)."""

    def __init__(self, controller: Any):
        self._shards = list(controller) if isinstance(controller, list | tuple) else [controller]

    async def hot(self, k: int) -> list[tuple[str, int]] | None:
        replies = await asyncio.gather(*(self._ask(s, k) for s in self._shards))
        lists = [r for r in replies if r is not None]
        if not lists:
            return None
        merged = [(str(a), int(rate)) for hot in lists for a, rate in hot]
        return heapq.nsmallest(k, merged, key=lambda e: (-e[1], e[0]))

    @staticmethod
    async def _ask(shard: Any, k: int) -> list[tuple[str, int]] | None:
        try:
            return await shard.hot_adapters.remote(k)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("cluster controller unreachable for its hot list: %s", exc)
            return None


__all__ = ["ControllerHotList", "DemandPrefetch", "HotList", "LiveLoads", "PrefetchStore", "State"]

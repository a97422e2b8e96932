"""Adapter fetches waiting for a loader worker, most urgent first.

The rule (`sim.adapters` models it): a fetch waits for one of `workers` threads in the order
of the most urgent request that wants it (lowest priority number), then submission order;
prefetches (priority `PREFETCH`: placement's `start_load`, rotation's device prefetch) go after
every request's fetch. `raise_priority` moves a queued fetch up when a more urgent request wants
it (never down). A fetch already running is never interrupted.

Cold fetches (adapter protection: a one-off adapter's, see `demand`) go after the other
fetches of the same priority, and with a limit (`limit_cold`, set while the replica thrashes) at
most that many of them run at once: a worker that finds only cold fetches beyond that number waits
for a warm one, so that a reload of an adapter with repeated demand never queues behind a storm of
one-off loads. A cold fetch that a repeated adapter's request wants becomes warm
(`raise_priority(..., cold=False)`).

Futures are plain `concurrent.futures.Future`s (`wait`, `result` as usual); `cancel(future)` takes a
queued fetch out of the queue (False once it runs).

`live()` counts the request fetches (priority below `PREFETCH`) queued or running: a background
fetcher outside this queue (the replica's demand prefetch) pauses while it is not zero.

Bounds: at most `max_prefetches` queued prefetches (one more raises `EngineOverloadedError`);
request fetches are bounded by the engine's queues (one fetch per adapter of an unfinished request).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lora_cluster.errors import EngineOverloadedError

PREFETCH = 1 << 30  # priority of prefetches: behind every request's fetch


@dataclass
class _Job:
    fn: Callable[[str], Any]
    key: str
    priority: int
    order: int
    cold: bool = False
    future: Future = field(default_factory=Future)


class FetchQueue:
    """A bounded priority queue of fetches served by `workers` daemon threads (see the module docstring)."""

    def __init__(self, workers: int, *, max_prefetches: int, name: str = "adapter-load",
                 max_cold_running: int | None = None):
        self.max_prefetches, self.max_cold_running = max_prefetches, max_cold_running  # None: no limit
        self._cold_running = 0
        self._live_running = 0  # request fetches (priority < PREFETCH) running now
        self._cv = threading.Condition()
        self._heap: list[tuple[int, bool, int, _Job]] = []
        self._queued: dict[Future, _Job] = {}  # jobs in the heap
        self._orders = itertools.count()
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[str], Any], key: str, priority: int, *, cold: bool = False) -> Future:
        """Queue `fn(key)` at `priority` (lower runs first; `PREFETCH` for prefetches); `cold`: after
        the warm fetches of its priority, and within `max_cold_running`."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the fetch queue is closed")
            if priority >= PREFETCH and self._num_prefetches() >= self.max_prefetches:
                raise EngineOverloadedError(
                    f"prefetch of adapter {key!r} refused: {self.max_prefetches} prefetches already "
                    f"wait for a loader worker"
                )
            job = _Job(fn, key, priority, next(self._orders), cold)
            self._queued[job.future] = job
            heapq.heappush(self._heap, (job.priority, job.cold, job.order, job))
            self._cv.notify()
        return job.future

    def raise_priority(self, future: Future, priority: int, *, cold: bool = True) -> None:
        """A request of `priority` wants the queued fetch `future`: it moves up if that is more urgent
        (a warm request makes a cold fetch warm)."""
        with self._cv:
            job = self._queued.get(future)
            if job is None or (priority, cold) >= (job.priority, job.cold):
                return
            job.priority, job.cold = min(priority, job.priority), job.cold and cold
            self._reheap()
            self._cv.notify_all()

    def limit_cold(self, max_running: int | None) -> None:
        """At most `max_running` cold fetches run at once from now on (None: no limit)."""
        with self._cv:
            if max_running != self.max_cold_running:
                self.max_cold_running = max_running
                self._cv.notify_all()

    def cancel(self, future: Future) -> bool:
        """Take a queued fetch out of the queue and cancel it; False when it already runs or ran."""
        with self._cv:
            if self._queued.pop(future, None) is not None:
                self._reheap()
        return future.cancel()

    def _reheap(self) -> None:
        self._heap = [(j.priority, j.cold, j.order, j) for j in self._queued.values()]
        heapq.heapify(self._heap)

    def queued(self) -> list[str]:
        """Keys of the queued fetches in the order workers will take them (for tests and debugging)."""
        with self._cv:
            return [e[3].key for e in sorted(self._heap, key=lambda e: e[:3])]

    def live(self) -> int:
        """Request fetches (priority below `PREFETCH`) queued or running now (thread-safe)."""
        with self._cv:
            return self._live_running + sum(1 for j in self._queued.values() if j.priority < PREFETCH)

    def close(self) -> None:
        """Cancel queued fetches and let the workers end (running fetches finish on their own)."""
        with self._cv:
            self._closed = True
            for job in self._queued.values():
                job.future.cancel()
            self._queued.clear()
            self._heap.clear()
            self._cv.notify_all()

    def _num_prefetches(self) -> int:
        return sum(1 for j in self._queued.values() if j.priority >= PREFETCH)

    def _next(self) -> _Job | None:
        """The first queued job a worker may run now (a cold one only within `max_cold_running`)."""
        if not self._heap:
            return None
        if self.max_cold_running is None or self._cold_running < self.max_cold_running:
            return self._heap[0][3]
        return next((e[3] for e in sorted(self._heap, key=lambda e: e[:3]) if not e[3].cold), None)

    def _work(self) -> None:
        while True:
            with self._cv:
                while (job := self._next()) is None and not self._closed:
                    self._cv.wait()
                if self._closed or job is None:
                    return
                del self._queued[job.future]
                if self._heap[0][3] is job:
                    heapq.heappop(self._heap)
                else:
                    self._reheap()
                cold, live = job.cold, job.priority < PREFETCH
                self._cold_running += cold
                self._live_running += live
            try:
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = job.fn(job.key)
                except BaseException as e:  # delivered to whoever awaits the future
                    job.future.set_exception(e)
                else:
                    job.future.set_result(result)
            finally:
                with self._cv:
                    self._cold_running -= cold
                    self._live_running -= live
                    self._cv.notify_all()


__all__ = ["PREFETCH", "FetchQueue"]

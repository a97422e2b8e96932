"""Adapter fetches waiting for a loader worker, most urgent first.

The rule (`cluster.sim.adapters` models it): a fetch waits for one of `workers` threads in the order
of the most urgent request that wants it (lowest priority number), then submission order;
prefetches (priority `PREFETCH`: placement's `start_load`, rotation's device prefetch) go after
every request's fetch. `raise_priority` moves a queued fetch up when a more urgent request wants
it (never down). A fetch already running is never interrupted.

Futures are plain `concurrent.futures.Future`s (`wait`, `result` as usual); `cancel(future)` takes a
queued fetch out of the queue (False once it runs).

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
    future: Future = field(default_factory=Future)


class FetchQueue:
    """A bounded priority queue of fetches served by `workers` daemon threads (see the module docstring)."""

    def __init__(self, workers: int, *, max_prefetches: int, name: str = "adapter-load"):
        self.max_prefetches = max_prefetches
        self._cv = threading.Condition()
        self._heap: list[tuple[int, int, _Job]] = []
        self._queued: dict[Future, _Job] = {}  # jobs in the heap
        self._orders = itertools.count()
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[str], Any], key: str, priority: int) -> Future:
        """Queue `fn(key)` at `priority` (lower runs first; `PREFETCH` for prefetches)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the fetch queue is closed")
            if priority >= PREFETCH and self._num_prefetches() >= self.max_prefetches:
                raise EngineOverloadedError(
                    f"prefetch of adapter {key!r} refused: {self.max_prefetches} prefetches already "
                    f"wait for a loader worker"
                )
            job = _Job(fn, key, priority, next(self._orders))
            self._queued[job.future] = job
            heapq.heappush(self._heap, (job.priority, job.order, job))
            self._cv.notify()
        return job.future

    def raise_priority(self, future: Future, priority: int) -> None:
        """A request of `priority` wants the queued fetch `future`: it moves up if that is more urgent."""
        with self._cv:
            job = self._queued.get(future)
            if job is None or priority >= job.priority:
                return
            job.priority = priority
            self._heap = [(j.priority, j.order, j) for j in self._queued.values()]
            heapq.heapify(self._heap)

    def cancel(self, future: Future) -> bool:
        """Take a queued fetch out of the queue and cancel it; False when it already runs or ran."""
        with self._cv:
            if self._queued.pop(future, None) is not None:
                self._heap = [(j.priority, j.order, j) for j in self._queued.values()]
                heapq.heapify(self._heap)
        return future.cancel()

    def queued(self) -> list[str]:
        """Keys of the queued fetches in the order workers will take them (for tests and debugging)."""
        with self._cv:
            return [j.key for _, _, j in sorted(self._heap, key=lambda e: e[:2])]

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

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = heapq.heappop(self._heap)[2]
                del self._queued[job.future]
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = job.fn(job.key)
            except BaseException as e:  # delivered to whoever awaits the future
                job.future.set_exception(e)
            else:
                job.future.set_result(result)


__all__ = ["PREFETCH", "FetchQueue"]

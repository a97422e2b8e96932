"""The simulated clock and its event queue.

Events run in time order; events at the same time run in the order they were scheduled (a
sequence number breaks ties), so a run is a deterministic function of its inputs. `clock` is what
the policies get as their injected `clock=`: they read simulated time, never wall time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # events run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        """Simulated seconds since the start (the policies' clock)."""
        return self.now

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at simulated time `when` (not before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to time `until` (inclusive), or until `stop()` is true between events."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            when, _, fn, args = pop(heap)
            self.now = when
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return
        self.now = max(self.now, until)

    def __len__(self) -> int:
        return len(self._heap)

"""Adapter thrash judged by its cost on this replica (pure; injected clock).

A replica thrashes when loading adapters eats the time that should serve requests. Two shares are
measured over the last `window_s` seconds, both from this replica's own measurements (no switch
count sized for another machine):

* `copy_share`: the share of the step loop's time spent placing adapters into device slots
  (copy seconds / (copy seconds + step seconds)). A placement on the step loop delays every running
  request by its duration: this is the goodput lost to loading on the device.
* `reload_share`: the share of the loader's capacity (`workers` threads) spent on switches, each
  costed at the measured mean load time (host fetch + device copy) of this replica:
  switches x load time / (window x workers). An adapter evicted for another is likely loaded again
  later: each switch costs one more load of that size.

`level` is the larger of the two. Derived thresholds (docs/serving.md#adapter-protection):
`WARN_SHARE` (0.25) and `THRASH_SHARE` (0.5) of that level; equivalently, this replica reaches thrash
at `THRASH_SHARE * workers / load_time_s` switches per second (2 workers: 100/s at 10 ms per load, 5/s
at 200 ms) or when placements take half of the step loop's time. `miss_penalty` rises from 0 at
`WARN_SHARE` to 1 at `THRASH_SHARE`: the replica's soft report that a miss is better served by a
replica that is not thrashing (the router weighs it against queueing; it never refuses a miss).

Bounded: at most `max_events` events are kept per series (running sums: O(1) amortized per call).
Called from the step loop only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

WARN_SHARE = 0.25  # level at which the miss penalty starts rising
THRASH_SHARE = 0.5  # level at which the replica is in thrash (miss penalty 1)
LOAD_TIME_EWMA = 0.2  # weight of the newest load in the measured mean load time


class ThrashMeter:
    """Cost shares of adapter loading over a sliding window (see the module docstring)."""

    def __init__(self, workers: int, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_events: int = 4096):
        self.workers, self.window_s, self._clock = max(1, workers), window_s, clock
        self.max_events = max_events
        self._steps: deque[tuple[float, float]] = deque()  # (time, seconds)
        self._copies: deque[tuple[float, float]] = deque()
        self._sums = {"steps": 0.0, "copies": 0.0}
        self._switches: deque[float] = deque(maxlen=max_events)
        self.load_time_s = 0.0  # measured mean load (fetch + copy); 0 until the first load
        self.step_time_s = 0.0  # measured mean step

    def step(self, seconds: float) -> None:
        """An engine step ran a batch for `seconds`."""
        self._add("steps", self._steps, seconds)
        self.step_time_s = seconds if not self.step_time_s else 0.9 * self.step_time_s + 0.1 * seconds

    def loaded(self, fetch_s: float, copy_s: float, *, evicted: bool) -> None:
        """An adapter was fetched in `fetch_s` and placed in `copy_s` (`evicted`: it replaced another)."""
        self._add("copies", self._copies, copy_s)
        if evicted:
            self._switches.append(self._clock())
        total = fetch_s + copy_s
        a = LOAD_TIME_EWMA
        self.load_time_s = total if not self.load_time_s else (1 - a) * self.load_time_s + a * total

    def copy_share(self) -> float:
        self._prune()
        copy = self._sums["copies"]
        busy = copy + self._sums["steps"]
        return copy / busy if busy > 0 else 0.0

    def reload_share(self) -> float:
        self._prune()
        return len(self._switches) * self.load_time_s / (self.window_s * self.workers)

    def level(self) -> float:
        return max(self.copy_share(), self.reload_share())

    def miss_penalty(self) -> float:
        """0 (misses are fine here) .. 1 (in thrash: a miss is better served elsewhere)."""
        return min(1.0, max(0.0, (self.level() - WARN_SHARE) / (THRASH_SHARE - WARN_SHARE)))

    def switch_budget_per_s(self) -> float | None:
        """Switches per second at which this replica reaches thrash (None: no load measured yet)."""
        return THRASH_SHARE * self.workers / self.load_time_s if self.load_time_s else None

    def snapshot(self) -> dict[str, Any]:
        budget = self.switch_budget_per_s()
        return {"level": round(self.level(), 4), "copy_share": round(self.copy_share(), 4),
                "reload_share": round(self.reload_share(), 4), "miss_penalty": round(self.miss_penalty(), 4),
                "load_time_ms": round(self.load_time_s * 1000, 3),
                "step_time_ms": round(self.step_time_s * 1000, 3),
                "switch_budget_per_s": None if budget is None else round(budget, 3)}

    def _add(self, name: str, series: deque[tuple[float, float]], seconds: float) -> None:
        if len(series) >= self.max_events:
            self._sums[name] -= series.popleft()[1]
        series.append((self._clock(), seconds))
        self._sums[name] += seconds

    def _prune(self) -> None:
        horizon = self._clock() - self.window_s
        for name, series in (("steps", self._steps), ("copies", self._copies)):
            while series and series[0][0] <= horizon:
                self._sums[name] -= series.popleft()[1]
            if not series:
                self._sums[name] = 0.0  # no float drift once the window is empty
        while self._switches and self._switches[0] <= horizon:
            self._switches.popleft()


__all__ = ["THRASH_SHARE", "WARN_SHARE", "ThrashMeter"]

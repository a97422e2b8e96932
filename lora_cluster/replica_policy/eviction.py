"""Eviction and prefetch policy: pure functions of access history, sizes and measured costs.

Load priority of an adapter (how much we want it close to the device), in [0, 1]:

    priority = 0.7 * frequency + 0.3 * recency
    frequency = c / (c + K)            c = requests in the sliding window, K = the "hot" threshold
    recency   = exp(-age / window)     age = seconds since the last request

so an adapter requested K times within the window has frequency 0.5, and one never requested has
priority 0. Device slots all cost the same, so the device pool evicts the lowest priority first.
The host and disk tiers hold entries of different sizes and reload costs, so they keep the entries
with the highest value per byte (GreedyDual-Size-Frequency):

    retention = (priority + 0.01) * reload_cost_s / nbytes

where `reload_cost_s` is the measured time it took to fill the entry from the next tier. Ties go to
the least recently used. Entries that are protected (pinned, used by a queued or running request,
or leased by a read in progress) are never victims; when the unprotected entries cannot free
enough bytes, nothing is evicted and the newcomer is refused instead (budgets are never exceeded).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

FREQUENCY_WEIGHT, RECENCY_WEIGHT = 0.7, 0.3


def load_priority(window_count: int, age_s: float | None, *, hot_count: int, window_s: float) -> float:
    """0.7 * frequency + 0.3 * recency, both in [0, 1] (see the module docstring)."""
    k = max(1, hot_count)
    frequency = window_count / (window_count + k)
    recency = 0.0 if age_s is None else math.exp(-max(0.0, age_s) / max(window_s, 1e-9))
    return FREQUENCY_WEIGHT * frequency + RECENCY_WEIGHT * recency


class AccessTracker:
    """Request times per adapter over a sliding window, plus lifetime counts (thread-safe).

    Bounded: at most `max_adapters` adapters are tracked; recording a new one beyond that forgets
    the adapter requested least recently (whose priority is the lowest anyway). The store also
    `forget`s an id as soon as no source offers it, so ids that do not exist hold no entry."""

    def __init__(self, window_s: float, hot_count: int, clock: Callable[[], float] = time.monotonic,
                 max_adapters: int = 65_536):
        self.window_s, self.hot_count, self._clock = window_s, hot_count, clock
        self.max_adapters = max_adapters
        self._times: OrderedDict[str, deque[float]] = OrderedDict()  # least recently requested first
        self._total: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, adapter_id: str) -> int:
        """Count a request now; returns the adapter's request count within the window."""
        now = self._clock()
        with self._lock:
            times = self._times.get(adapter_id)
            if times is None:
                times = self._times[adapter_id] = deque()
                while len(self._times) > self.max_adapters:
                    oldest, _ = self._times.popitem(last=False)
                    self._total.pop(oldest, None)
            else:
                self._times.move_to_end(adapter_id)
            times.append(now)
            self._total[adapter_id] = self._total.get(adapter_id, 0) + 1
            return self._prune(times, now)

    def forget(self, adapter_id: str) -> None:
        """Drop every record of `adapter_id` (it does not exist)."""
        with self._lock:
            self._times.pop(adapter_id, None)
            self._total.pop(adapter_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._times)

    def window_count(self, adapter_id: str) -> int:
        with self._lock:
            times = self._times.get(adapter_id)
            return 0 if times is None else self._prune(times, self._clock())

    def total(self, adapter_id: str) -> int:
        with self._lock:
            return self._total.get(adapter_id, 0)

    def priority(self, adapter_id: str) -> float:
        now = self._clock()
        with self._lock:
            times = self._times.get(adapter_id)
            if not times:
                return 0.0
            age = now - times[-1]
            count = self._prune(times, now)
        return load_priority(count, age, hot_count=self.hot_count, window_s=self.window_s)

    def is_hot(self, adapter_id: str) -> bool:
        return self.hot_count > 0 and self.window_count(adapter_id) >= self.hot_count

    def _prune(self, times: deque[float], now: float) -> int:
        while len(times) > 1 and now - times[0] > self.window_s:
            times.popleft()
        if times and now - times[0] > self.window_s:  # keep the last time for recency, not counted
            return 0
        return len(times)


@dataclass
class Candidate:
    """An entry of a byte-budgeted tier, as the policy sees it."""

    key: str
    nbytes: int
    reload_cost_s: float
    priority: float
    last_access: float
    protected: bool


def retention(c: Candidate) -> float:
    """Value per byte of keeping `c` (higher is kept longer)."""
    return (c.priority + 0.01) * max(c.reload_cost_s, 1e-6) / max(c.nbytes, 1)


def choose_victims(candidates: Iterable[Candidate], need_bytes: int) -> list[str] | None:
    """Keys to evict, lowest retention first, freeing at least `need_bytes`; [] if nothing is needed;
    None when the unprotected candidates cannot free enough (then nothing should be evicted)."""
    if need_bytes <= 0:
        return []
    evictable = sorted((c for c in candidates if not c.protected),
                       key=lambda c: (retention(c), c.last_access, c.key))
    victims, freed = [], 0
    for c in evictable:
        if freed >= need_bytes:
            break
        victims.append(c.key)
        freed += c.nbytes
    return victims if freed >= need_bytes else None

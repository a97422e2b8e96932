"""Bounded Prometheus label values: the busiest values keep their own label, the rest are "other".

Labelling metrics by adapter id (or tenant) naively gives one series per id a client ever sent,
which explodes a Prometheus server with thousands of adapters (vllm#13303). `TopLabels` keeps at
most `max_labels` values as labels; every other value is reported as `OTHER` ("other").

Policy:

* Admission: while fewer than `max_labels` values are kept, a new value is kept on its first use
  (a deployment with few adapters sees every id at once, and never "other").
* Re-ranking: uses are counted per window of `window_s` seconds. When a window ends, the values kept
  for the next one are the `max_labels` most used in that window (ties: the value kept before wins,
  then the smaller value), then, while there is room, the values kept before that had no use. A
  value that loses its place is *demoted*: `take_demoted()` hands it to the metrics layer, which
  drops its series (from then on its uses count under "other").
* Bounds: `kept` holds at most `max_labels` values; the use counts of a window hold at most
  `max_tracked` values (default 4 x max_labels, at least 64). When they are full, a new value
  replaces the least used entry that is not kept and inherits its count + 1 (the Space-Saving
  heavy-hitters sketch), so a busy newcomer still ranks while memory stays bounded. The demoted
  values not yet taken are a subset of the values kept before, and the caller takes them with
  every use.
* `max_labels = 0` reports every value as "other".

A real value equal to `OTHER` is reported as "other" (it merges with the overflow). Pure: no
Prometheus, injected clock; not thread-safe (the ingress's event loop is its one caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable

OTHER = "other"


class TopLabels:
    def __init__(self, max_labels: int, window_s: float, *, clock: Callable[[], float] = time.monotonic,
                 max_tracked: int | None = None):
        if max_labels < 0 or window_s <= 0:
            raise ValueError(f"max_labels must be >= 0 and window_s > 0, got {max_labels}, {window_s}")
        self.max_labels, self.window_s, self._clock = max_labels, window_s, clock
        self.max_tracked = max(max_tracked or 4 * max_labels, max_labels, 64)
        self._kept: set[str] = set()
        self._counts: dict[str, int] = {}
        self._window_start = clock()
        self._demoted: set[str] = set()

    @property
    def kept(self) -> frozenset[str]:
        """The values that are their own label now."""
        return frozenset(self._kept)

    def is_label(self, value: str) -> bool:
        """Whether `value` is its own label now (OTHER is always one)."""
        return value == OTHER or value in self._kept

    @property
    def tracked(self) -> int:
        """Values whose uses are counted in the current window (at most `max_tracked`)."""
        return len(self._counts)

    def label(self, value: str) -> str:
        """Count one use of `value` and return its label: `value` itself, or "other"."""
        self._roll()
        if self.max_labels == 0 or value == OTHER:
            return OTHER
        self._count(value)
        if value in self._kept:
            return value
        if len(self._kept) < self.max_labels:
            self._kept.add(value)
            return value
        return OTHER

    def take_demoted(self) -> list[str]:
        """Values that lost their label since the last call (their series should be dropped)."""
        demoted, self._demoted = self._demoted, set()
        return sorted(demoted)

    def _count(self, value: str) -> None:
        counts = self._counts
        if value in counts or len(counts) < self.max_tracked:
            counts[value] = counts.get(value, 0) + 1
            return
        # Space-Saving: the least used entry that is not kept makes room (kept ones keep their counts)
        victims = [(n, v) for v, n in counts.items() if v not in self._kept]
        floor, victim = min(victims or [(n, v) for v, n in counts.items()])
        del counts[victim]
        counts[value] = floor + 1

    def _roll(self) -> None:
        now = self._clock()
        if now - self._window_start < self.window_s:
            return
        ranked = sorted(self._counts.items(), key=lambda kv: (-kv[1], kv[0] not in self._kept, kv[0]))
        kept = {v for v, _ in ranked[: self.max_labels]}
        for v in sorted(self._kept - kept):  # idle values stay while there is room: no needless churn
            if len(kept) >= self.max_labels or v in self._counts:
                continue
            kept.add(v)
        self._demoted = (self._demoted | (self._kept - kept)) - kept
        self._kept = kept
        self._counts = {}
        self._window_start = now

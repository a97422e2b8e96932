"""Per-tier counters a metrics layer can export (plain numbers; `snapshot()` gives a dict).

Counters only grow (hits, misses, evictions, ...); gauges (`bytes`, `entries`) give the current
value. `load_seconds_total / loads` is the mean time to fill the tier from the next one, and
`load_buckets` counts those fills per latency bucket (`LOAD_BUCKETS_S`, `LatencyHistogram`), which
the metrics layer exports as a Prometheus histogram.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import asdict, dataclass, field

TIERS = ("device", "host", "disk", "cluster", "source")  # cluster: another node's copy (`cluster_tier`)
# upper bounds (seconds) of the adapter-load latency buckets; a last, unbounded bucket follows
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class LatencyHistogram:
    """Observations per bucket: `counts[i]` holds values <= `bounds[i]` (and > the bound before), the
    last count the values above every bound. Not cumulative (the exporter accumulates)."""

    bounds: tuple[float, ...] = LOAD_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class TierStats:
    """Counters of one tier.

    hits: requests served from this tier; misses: requests that had to go to a slower tier;
    coalesced: requests that joined a load already in flight (single flight); loads: fills of this
    tier; load_seconds_*: time those fills took, load_buckets: those fills per latency bucket
    (`LOAD_BUCKETS_S`, not cumulative); evictions: entries dropped for room; rejected:
    entries not admitted (too large, or every byte held by protected entries); failures: loads that
    raised; retries: transient errors retried (source tier).
    """

    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    loads: int = 0
    load_seconds_total: float = 0.0
    load_seconds_max: float = 0.0
    load_bytes_total: int = 0
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS_S) + 1))
    evictions: int = 0
    rejected: int = 0
    failures: int = 0
    retries: int = 0
    bytes: int = 0
    entries: int = 0
    budget_bytes: int = 0


@dataclass
class StoreStats:
    """The counters of every tier; mutate through `add`/`set`/`record_load` (thread-safe)."""

    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, tier: str, name: str, n: int = 1) -> None:
        with self._lock:
            stats = self.tiers[tier]
            setattr(stats, name, getattr(stats, name) + n)

    def set(self, tier: str, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self.tiers[tier], name, value)

    def record_load(self, tier: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            stats = self.tiers[tier]
            stats.loads += 1
            stats.load_seconds_total += seconds
            stats.load_seconds_max = max(stats.load_seconds_max, seconds)
            stats.load_bytes_total += nbytes
            stats.load_buckets[bisect_left(LOAD_BUCKETS_S, seconds)] += 1

    def snapshot(self) -> dict[str, dict[str, int | float]]:
        """{tier: {counter: value}} — a copy, safe to export."""
        with self._lock:
            return {tier: asdict(stats) for tier, stats in self.tiers.items()}

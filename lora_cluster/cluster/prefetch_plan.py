"""Prefetch by predicted demand: which adapters to fetch ahead of requests, bounded in bandwidth and
bytes (pure: no I/O, an injected clock).

Predicted demand is the cluster's demand history: the request counts per adapter that the replicas
report (`observe`), decayed with a half-life so that a shift in popularity moves the ranking within
a few half-lives. Adapters never requested yet come after every requested one, in the order of the
catalog the caller gives (the source's listing, or the operator's `preload` list first): at start,
before any request, the plan walks the catalog.

Bounds, each stated by its caller's setting:

* bandwidth: a token bucket of `bytes_per_s` (a burst of one second's worth); a job is handed out
  while the bucket is not in debt and takes its bytes from it, so over any window the jobs handed out
  are at most `bytes_per_s` times the window plus one second's worth and one adapter;
* bytes: `plan` hands out nothing that would take the tier's bytes (`used_bytes`, the caller's)
  past `max_bytes`; a prefetch never evicts anything;
* memory: only catalog adapters are tracked (a client can request any id; those not in the catalog
  are ignored), so the demand table is bounded by the catalog; a demand set from outside
  (`set_demand`) keeps at most MAX_DEMAND adapters.

Live, a replica's planner has no catalog: its demand is the controller's hot list (`set_demand`,
the cluster's busiest adapters, already decayed there), and sizes are known only once fetched: the
caller passes a size estimate at hand-out and `settle`s the real bytes afterwards, so the bandwidth
bucket is charged what was really read.

Prefetch runs at the lowest priority: the caller runs its jobs on their own lane, never on a worker
a live load could take, and `plan` hands out nothing while `live_waiting` says a live load waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

MAX_DEMAND = 256  # adapters `set_demand` keeps at most (the busiest)


class PrefetchPlanner:
    def __init__(self, catalog: Sequence[str], sizes: Mapping[str, int], *, bytes_per_s: float,
                 max_bytes: int, clock: Callable[[], float], half_life_s: float = 60.0):
        if bytes_per_s <= 0 or max_bytes < 0 or half_life_s <= 0:
            raise ValueError("bytes_per_s and half_life_s must be > 0, max_bytes >= 0")
        self.catalog = list(catalog)
        self._position = {a: i for i, a in enumerate(self.catalog)}
        self.sizes, self.bytes_per_s, self.max_bytes = sizes, bytes_per_s, max_bytes
        self._clock, self._rate = clock, math.log(2) / half_life_s
        self._epoch = clock()
        self.demand: dict[str, float] = {}  # catalog adapter -> decayed count, in units at `_epoch`
        self._tokens, self._filled_at = bytes_per_s, clock()
        self.handed_out_bytes = 0

    def observe(self, counts: Mapping[str, int]) -> None:
        """Requests per adapter since the last report (`ReplicaReport.adapter_requests`)."""
        weight = math.exp(self._rate * (self._clock() - self._epoch))
        for adapter_id, n in counts.items():
            if adapter_id in self._position:
                self.demand[adapter_id] = self.demand.get(adapter_id, 0.0) + n * weight

    def set_demand(self, rates: Mapping[str, int]) -> None:
        """Demand as the caller measured it (the controller's hot list: adapter -> its rate), replacing
        what was observed; at most MAX_DEMAND adapters kept (the busiest), catalog or not."""
        weight = math.exp(self._rate * (self._clock() - self._epoch))
        top = sorted(rates, key=lambda a: (-rates[a], a))[:MAX_DEMAND]
        self.demand = {a: rates[a] * weight for a in top if rates[a] > 0}

    def settle(self, adapter_id: str, estimate: int, nbytes: int) -> None:
        """A job handed out with `estimate` bytes ended having read `nbytes`: the bucket and the count
        of bytes handed out are charged the difference."""
        self._tokens -= nbytes - estimate
        self.handed_out_bytes += nbytes - estimate

    def ranking(self) -> list[str]:
        """Every catalog adapter, most demanded first; never requested ones after, in catalog order."""
        last = len(self.catalog)
        seen = sorted(self.demand, key=lambda a: (-self.demand[a], self._position.get(a, last), a))
        return seen + [a for a in self.catalog if a not in self.demand]

    def plan(self, slots: int, *, skip: Callable[[str], bool], used_bytes: int,
             live_waiting: bool = False) -> list[str]:
        """Up to `slots` adapters to prefetch now, most demanded first, leaving out those `skip` names
        (held already, or being fetched), within the bandwidth and byte bounds (module docstring)."""
        now = self._clock()
        self._tokens = min(self.bytes_per_s, self._tokens + (now - self._filled_at) * self.bytes_per_s)
        self._filled_at = now
        if slots <= 0 or live_waiting:
            return []
        jobs: list[str] = []
        for adapter_id in self.ranking():
            if len(jobs) >= slots or self._tokens <= 0:
                break
            if skip(adapter_id):
                continue
            nbytes = self.sizes[adapter_id]
            if used_bytes + nbytes > self.max_bytes:
                break
            jobs.append(adapter_id)
            used_bytes += nbytes
            self._tokens -= nbytes
            self.handed_out_bytes += nbytes
        return jobs

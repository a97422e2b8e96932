"""Adapter placement: how many replicas should hold each adapter, and which.

Demand: every report carries the replica's requests per adapter since its previous report; the
`DemandTracker` turns them into a request rate per adapter (an exponentially weighted moving
average with time constant `window_s`) and keeps at most `max_adapters` adapters (the busiest).

Target: an adapter's *load* is rate x service time (requests of it in flight on average). One
replica can run `max_num_seqs` requests; an adapter is given one more holder each time its load
exceeds `hot_share` of that, up to every live replica: replicas = ceil(load / (hot_share x
max_num_seqs)). Adapters that need one replica get no entry (the router's affinity already keeps
each adapter on one holder); hot ones are spread.

Which replicas: current holders first (the adapter is resident or loading there), then replicas
that can take a new adapter without evicting a pinned or in-use one (a free adapter slot, per the
report), least loaded first. A replica whose slots are all held by running requests is never chosen
as a new holder. Pure: injected clock, no Ray.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.reports import ReplicaReport

MIN_RATE = 1e-3  # requests per second below which an adapter's demand is forgotten
MAX_HOT = 256  # adapters `DemandTracker.hot` names at most, whatever a caller asks for
HOT_TTL_S = 1.0  # `DemandTracker.hot` computes its list at most this often


class DemandTracker:
    """Request rate per adapter (EWMA over `window_s`), bounded to the `max_adapters` busiest.

    Decay is lazy, so a record costs O(adapters in it), not O(adapters tracked): values are kept
    scaled to a reference time (`rate(now) = value x exp(-(now - ref) / window_s)`), and the
    reference moves forward, with one pass over the values, only every few windows or when the
    table is read."""

    def __init__(self, *, window_s: float, clock: Callable[[], float], max_adapters: int = 1024):
        self.window_s, self.max_adapters, self._clock = window_s, max_adapters, clock
        self._value: dict[str, float] = {}
        self._ref = clock()
        self._hot: list[tuple[str, int]] = []  # the busiest adapters as of `_hot_at`, at most MAX_HOT
        self._hot_at = -math.inf

    def record(self, counts: Mapping[str, int]) -> None:
        """Requests per adapter observed since the previous call (from one replica's report)."""
        now = self._clock()
        if now - self._ref > 8 * self.window_s:
            self._rebase(now)
        scale = math.exp((now - self._ref) / self.window_s) / self.window_s
        for adapter_id, n in counts.items():
            self._value[adapter_id] = self._value.get(adapter_id, 0.0) + n * scale
        if len(self._value) > 2 * self.max_adapters:
            self._rebase(now)

    def _rebase(self, now: float) -> None:
        """Move the reference time to `now`, forget rates under MIN_RATE, keep the busiest."""
        factor = math.exp(-(now - self._ref) / self.window_s) if now > self._ref else 1.0
        self._ref = max(now, self._ref)
        rates = {a: v * factor for a, v in self._value.items() if v * factor > MIN_RATE}
        if len(rates) > self.max_adapters:
            rates = dict(sorted(rates.items(), key=lambda kv: -kv[1])[: self.max_adapters])
        self._value = rates

    def rates(self) -> dict[str, float]:
        """Requests per second per adapter, now."""
        self._rebase(self._clock())
        return dict(self._value)

    def hot(self, k: int) -> list[tuple[str, int]]:
        """The `k` busiest adapters (at most MAX_HOT), busiest first (ties by id), each with its rate in
        requests per 1,000 s (an int, at least 1). The list is computed at most once per HOT_TTL_S
        (one pass over the table, O(adapters log MAX_HOT)), however many callers ask in between."""
        now = self._clock()
        if now - self._hot_at >= HOT_TTL_S:
            rates = self.rates()
            top = heapq.nsmallest(MAX_HOT, rates, key=lambda a: (-rates[a], a))
            self._hot = [(a, max(1, round(rates[a] * 1000))) for a in top]
            self._hot_at = now
        return self._hot[:max(0, min(k, MAX_HOT))]


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class PlacementPolicy:
    service_time_s: float  # typical time a request holds a batch slot
    hot_share: float  # share of one replica's batch slots an adapter may take before it spreads

    def replicas_needed(self, rate: float, max_num_seqs: int, live: int) -> int:
        load = rate * self.service_time_s
        return max(1, min(live, math.ceil(load / max(self.hot_share * max_num_seqs, 1e-9))))

    def targets(self, rates: Mapping[str, float], replicas: Iterable[ReplicaReport],
                holders: Callable[[str], Iterable[str]] | None = None) -> dict[str, tuple[str, ...]]:
        """adapter -> the replicas that should hold it, for adapters that need more than one.
        `holders(adapter)`: the ids of the replicas whose report holds it (`ClusterView.holders`, an
        index kept with every report); None: found by a walk of `replicas`. Cost: O(replicas log
        replicas) once, plus per adapter needing more than one replica O(its holders log its holders
        + the replicas it is given); a replica out of free adapter slots is dropped from the
        candidates for good (`planned_new` only grows), so a full cluster is not walked again per
        adapter."""
        live = sorted(replicas, key=lambda r: r.replica_id)
        if len(live) < 2:
            return {}
        by_id = {r.replica_id: r for r in live}
        max_num_seqs = min(r.max_num_seqs for r in live)
        planned_new: dict[str, int] = {r.replica_id: 0 for r in live}  # new holders assigned this round
        # new holders are taken least loaded first: an order that does not depend on the adapter; only
        # those with a free adapter slot not yet planned are candidates (in that order)
        by_load = sorted(live, key=lambda r: (r.ongoing / max(r.capacity, 1), r.replica_id))
        open_ = [r for r in by_load if r.free_adapter_slots > 0]
        out: dict[str, tuple[str, ...]] = {}
        for adapter_id, rate in sorted(rates.items(), key=lambda kv: (-kv[1], kv[0])):
            need = self.replicas_needed(rate, max_num_seqs, len(live))
            if need < 2:
                continue
            if holders is None:
                held_by = [r for r in live if adapter_id in r.held]
            else:
                held_by = [by_id[rid] for rid in sorted(holders(adapter_id)) if rid in by_id]
            held = {r.replica_id for r in held_by}
            others: list[ReplicaReport] = []
            k = 0
            while k < len(open_) and len(held_by) + len(others) < need:  # the first that can take it
                r = open_[k]
                if r.replica_id not in held and r.free_adapter_slots - planned_new[r.replica_id] > 0:
                    others.append(r)
                k += 1
            chosen = [*held_by, *others][:need]
            for r in chosen:
                if r.replica_id not in held:
                    planned_new[r.replica_id] += 1
            if others:  # those it took are among the first k: drop those left without a slot
                open_[:k] = [r for r in open_[:k] if r.free_adapter_slots - planned_new[r.replica_id] > 0]
            if len(chosen) > 1:
                out[adapter_id] = tuple(sorted(r.replica_id for r in chosen))
        return out

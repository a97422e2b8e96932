"""What each LoRA replica reports to the controller every period, and the cluster view built from it.

A `ReplicaReport` is a plain picklable record (no Ray types): node, device memory split, host
cache bytes, adapters resident and loading, requests running and waiting (in all and per SLA class),
recent latency and SLO attainment per class, and the replica's recent requests per adapter (its
busiest adapters only, so a report stays small with thousands of adapters).

`ClusterView` keeps the latest report of each replica and forgets a replica that has not reported
for `stale_after_s` (it died or was scaled down). A restarted controller starts empty and is whole
again once every replica has reported, within one report period. Pure: injected clock, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_REPORTED_ADAPTERS = 64  # per report: the replica's busiest adapters by recent requests


@dataclass(frozen=True)
class MemorySplit:
    """Device memory of one replica, by use (bytes); `free` is what the device has left."""

    base_weights: int = 0
    kv_cache: int = 0
    adapter_pool: int = 0
    free: int | None = None  # None: unknown (CPU)
    host_cache: int = 0  # validated adapter weights held in host memory (the host tier)
    host_cache_budget: int = 0


@dataclass(frozen=True)
class ReplicaReport:
    replica_id: str
    node_id: str
    capacity: int  # requests it is given at once before tickets queue (admission capacity)
    max_num_seqs: int
    max_loras: int
    running: int
    waiting: int
    free_adapter_slots: int  # slots empty or holding an idle adapter (a new adapter can go there)
    resident: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()
    running_by_priority: Mapping[int, int] = field(default_factory=dict)
    classes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per class: running, ttft...
    adapter_requests: Mapping[str, int] = field(default_factory=dict)  # requests per adapter since last
    memory: MemorySplit = field(default_factory=MemorySplit)
    service_time_s: float | None = None  # mean time a request held the replica, recently
    sent_at: float = 0.0  # wall-clock time, for display

    @property
    def ongoing(self) -> int:
        return self.running + self.waiting

    def less_urgent_running(self, priority: int) -> int:
        """Running requests strictly less urgent than `priority` (what a preemption could free)."""
        return sum(n for p, n in self.running_by_priority.items() if int(p) > priority)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["resident"], d["loading"] = list(self.resident), list(self.loading)
        d["running_by_priority"] = {str(p): n for p, n in self.running_by_priority.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in fields}
        values["resident"] = tuple(values.get("resident", ()))
        values["loading"] = tuple(values.get("loading", ()))
        by_priority = values.get("running_by_priority") or {}
        values["running_by_priority"] = {int(p): int(n) for p, n in by_priority.items()}
        values["memory"] = MemorySplit(**dict(values.get("memory") or {}))
        demand = sorted(dict(values.get("adapter_requests") or {}).items(), key=lambda kv: -kv[1])
        values["adapter_requests"] = dict(demand[:MAX_REPORTED_ADAPTERS])
        return cls(**values)


@dataclass
class _Seen:
    report: ReplicaReport
    at: float  # controller clock
    granted_since: int = 0  # grants the controller issued after this report (not yet in its counts)
    preempt_grants_since: int = 0


class ClusterView:
    """The latest report of every live replica, plus grants issued since each report."""

    def __init__(self, *, stale_after_s: float, clock: Callable[[], float]):
        self.stale_after_s, self._clock = stale_after_s, clock
        self._seen: dict[str, _Seen] = {}

    def update(self, report: ReplicaReport) -> None:
        self._seen[report.replica_id] = _Seen(report, self._clock())

    def forget(self, replica_id: str) -> None:
        self._seen.pop(replica_id, None)

    def prune(self) -> list[str]:
        """Forget replicas silent for `stale_after_s`; returns their ids."""
        now = self._clock()
        gone = [rid for rid, s in self._seen.items() if now - s.at > self.stale_after_s]
        for rid in gone:
            del self._seen[rid]
        return gone

    def replicas(self) -> list[ReplicaReport]:
        return [s.report for s in self._seen.values()]

    def get(self, replica_id: str) -> ReplicaReport | None:
        seen = self._seen.get(replica_id)
        return None if seen is None else seen.report

    def free(self, replica_id: str) -> int:
        """Requests the replica can still be given: capacity - reported ongoing - grants since."""
        s = self._seen[replica_id]
        return s.report.capacity - s.report.ongoing - s.granted_since

    def preemptible(self, replica_id: str, priority: int) -> int:
        """Less urgent running requests a grant over capacity could still preempt there."""
        s = self._seen[replica_id]
        return s.report.less_urgent_running(priority) - s.preempt_grants_since

    def granted(self, replica_id: str, *, preempting: bool = False) -> None:
        s = self._seen.get(replica_id)
        if s is not None:
            s.granted_since += 1
            s.preempt_grants_since += int(preempting)

    def ids(self) -> Iterable[str]:
        return self._seen.keys()

    def __len__(self) -> int:
        return len(self._seen)

    def age_s(self, replica_id: str) -> float:
        return self._clock() - self._seen[replica_id].at

"""What each LoRA replica reports to the controller every period, and the cluster view built from it.

A `ReplicaReport` is a plain picklable record (no Ray types): node, device memory split, host
cache bytes, adapters resident and loading, requests running and waiting (in all and per SLA class),
recent latency and SLO attainment per class, and the replica's recent requests per adapter (its
busiest adapters only, so a report stays small with thousands of adapters), and the routing keys
of the prompt prefixes it ran lately (`prefix_keys.PrefixSummary`, at most `SUMMARY_KEYS`), which
the grant policy weighs (`scheduling.choose_replica`).

`ClusterView` keeps the latest report of each replica and forgets a replica that has not reported
for `stale_after_s` (it died or was scaled down). Room on a replica is its capacity minus its
requests in flight (`active`, counted by the replica itself) minus the grants sent its way that
have not arrived yet: each grant is a ticket id, and each report lists the ticket ids that arrived
since the previous one, so no grant is counted twice or lost between two reports (a grant that
never arrives, its request gone, is dropped after `grant_ttl_s`). Requests an ingress sent the
direct way (its fast path) reach a replica before the replica reports them; each ingress therefore
states, with every ticket it parks, its requests in flight per replica and those on their way to
a replica not known yet (`claim`). A claim counts for `claim_ttl_s`, after which the replicas'
reports, which include those requests, are the truth again; for one replica, a claim is
superseded sooner by that replica's first report received `claim_superseded_after_s` after it (a
report built after the claim shows the claimed requests that still run, and not those that ended:
a stale claim would hide a slot freed since, and keep a parked ticket waiting for its TTL). A
restarted controller starts empty and is whole again once every replica has reported, within one
report period. Pure: injected clock, no Ray.

Bounded in bytes: a report as the controller takes it (`from_dict`) keeps at most
`MAX_REPORTED_RESIDENT` resident and `MAX_REPORTED_LOADING` loading adapters (sorted, so that a
report and the same report rebuilt from deltas are equal), `MAX_REPORTED_ADAPTERS` adapters' demand,
`MAX_ARRIVED_TICKETS` arrived tickets, `SUMMARY_KEYS` prefix keys (the last, sorted) and
`MAX_REPORTED_CLASSES` classes,
and drops ids longer than `MAX_ID_LEN`: its JSON is at most `REPORT_MAX_BYTES`, and the view keeps one
report per replica. A replica mostly sends deltas of its report (`report_delta`); `seq` numbers its
reports so that a delta is applied only to the report it was computed from.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lora_cluster.cluster.prefix_keys import SUMMARY_KEYS

MAX_REPORTED_ADAPTERS = 64  # per report: the replica's busiest adapters by recent requests
MAX_REPORTED_RESIDENT = 512  # adapters on the device listed per report (the first, sorted)
MAX_REPORTED_LOADING = 64  # adapters loading listed per report
MAX_ARRIVED_TICKETS = 512  # arrived tickets per report (beyond: a grant counts until `grant_ttl_s`)
MAX_REPORTED_CLASSES = 16  # SLA classes' stats per report
MAX_ID_LEN = 256  # longest adapter or ticket id kept (adapter ids are validated to this length)
# the JSON of a report at every bound above, ids at MAX_ID_LEN, plus 16 KiB for the counts and stats
REPORT_MAX_BYTES = ((MAX_REPORTED_RESIDENT + MAX_REPORTED_LOADING + MAX_REPORTED_ADAPTERS
                     + MAX_ARRIVED_TICKETS) * (MAX_ID_LEN + 16) + SUMMARY_KEYS * 32 + (16 << 10))


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
    active: int | None = None  # requests in the replica's hands (None: use running + waiting)
    arrived_tickets: tuple[str, ...] = ()  # granted tickets that reached the replica since its last report
    sent_at: float = 0.0  # wall-clock time, for display
    base: str | None = None  # the API name of the base model it serves (None: not reported)
    prefixes: tuple[str, ...] = ()  # routing keys of the prompt prefixes it ran lately
    seq: int = 0  # the replica's report number (a delta names the one it applies to)

    @functools.cached_property
    def prefix_set(self) -> frozenset[str]:
        """Its reported prefix keys as a set (built once per report)."""
        return frozenset(self.prefixes)

    @property
    def ongoing(self) -> int:
        return self.running + self.waiting if self.active is None else self.active

    @functools.cached_property
    def _less_urgent(self) -> dict[int, int]:
        """`less_urgent_running` by priority, as asked (a report is immutable: computed once each)."""
        return {}

    def less_urgent_running(self, priority: int) -> int:
        """Running requests strictly less urgent than `priority` (what a preemption could free)."""
        memo = self._less_urgent
        n = memo.get(priority)
        if n is None:
            n = memo[priority] = sum(n for p, n in self.running_by_priority.items() if int(p) > priority)
        return n

    @functools.cached_property
    def held(self) -> frozenset[str]:
        """The adapters it holds: resident or loading (built once per report)."""
        return frozenset((*self.resident, *self.loading))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in WIRE_FIELDS:
            d[name] = field_to_wire(name, getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaReport:
        """A report from its dict, within the bounds of the module docstring (`normalized`)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: field_from_wire(k, v) for k, v in d.items() if k in fields}
        values.setdefault("memory", MemorySplit())
        return cls(**values)


WIRE_FIELDS = ("resident", "loading", "arrived_tickets", "prefixes", "running_by_priority", "memory",
               "adapter_requests", "classes")  # the fields whose dict form differs or is bounded


def _ids(values: Iterable[Any], limit: int, *, ordered: bool) -> tuple[str, ...]:
    ids = [str(v) for v in values if len(str(v)) <= MAX_ID_LEN]
    return tuple(ids[:limit] if ordered else sorted(set(ids))[:limit])


def field_to_wire(name: str, value: Any) -> Any:
    """A report field's JSON-able form."""
    if name in ("resident", "loading", "arrived_tickets", "prefixes"):
        return list(value)
    if name == "running_by_priority":
        return {str(p): n for p, n in value.items()}
    if name == "memory":
        return dataclasses.asdict(value)
    if name in ("adapter_requests", "classes"):
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in value.items()}
    return value


def field_from_wire(name: str, value: Any) -> Any:
    """A report field from its dict form (or its own form), within the module's bounds; idempotent."""
    if name in ("resident", "loading"):
        limit = MAX_REPORTED_RESIDENT if name == "resident" else MAX_REPORTED_LOADING
        return _ids(value or (), limit, ordered=False)
    if name == "arrived_tickets":
        return _ids(value or (), MAX_ARRIVED_TICKETS, ordered=True)
    if name == "prefixes":  # the most recently used (last) SUMMARY_KEYS, as a sorted set
        return _ids(list(value or ())[-SUMMARY_KEYS:], SUMMARY_KEYS, ordered=False)
    if name == "running_by_priority":
        return {int(p): int(n) for p, n in dict(value or {}).items()}
    if name == "memory":
        return value if isinstance(value, MemorySplit) else MemorySplit(**dict(value or {}))
    if name == "adapter_requests":
        demand = sorted(((str(a), int(n)) for a, n in dict(value or {}).items() if len(str(a)) <= MAX_ID_LEN),
                        key=lambda kv: -kv[1])
        return dict(demand[:MAX_REPORTED_ADAPTERS])
    if name == "classes":
        return {str(k): dict(v) if isinstance(v, Mapping) else v
                for k, v in list(dict(value or {}).items())[:MAX_REPORTED_CLASSES]}
    return value


def normalized(report: ReplicaReport) -> ReplicaReport:
    """`report` within the module's bounds, as `from_dict(report.to_dict())` gives it."""
    return dataclasses.replace(report, **{n: field_from_wire(n, getattr(report, n)) for n in WIRE_FIELDS})


@dataclass
class _Seen:
    report: ReplicaReport
    at: float  # controller clock
    outstanding: dict[str, float] = field(default_factory=dict)  # granted ticket -> when, not arrived yet
    preempting: set[str] = field(default_factory=set)  # those of them that preempt


class ClusterView:
    """The latest report of every live replica, plus grants on their way to each."""

    def __init__(self, *, stale_after_s: float, clock: Callable[[], float], grant_ttl_s: float = 10.0,
                 claim_ttl_s: float = 1.0, claim_superseded_after_s: float = 0.1, max_ingresses: int = 1024):
        self.stale_after_s, self.grant_ttl_s, self._clock = stale_after_s, grant_ttl_s, clock
        self.claim_ttl_s, self.max_ingresses = claim_ttl_s, max_ingresses
        self.claim_superseded_after_s = claim_superseded_after_s
        self._seen: dict[str, _Seen] = {}
        # ingress -> (when, its requests in flight per replica, its requests on their way)
        self._claims: dict[str, tuple[float, Mapping[str, int], int]] = {}
        # the room of every replica (max(0, free)) and its sum, kept up to date incrementally: a
        # replica's room changes only with its report, a grant to it, or a claim naming it
        self._room: dict[str, int] = {}
        self._room_sum = 0
        self._dirty: set[str] = set()
        self._holders: dict[str, set[str]] = {}  # adapter -> replicas whose report holds it
        # priority asked -> the replicas where `preemptible` > 0 (one entry per class priority asked)
        self._preemptible: dict[int, set[str]] = {}

    def claim(self, ingress_id: str, inflight: Mapping[str, int], unassigned: int) -> None:
        """An ingress's requests in flight per replica, and those on their way to an unknown one."""
        old = self._claims.pop(ingress_id, None)
        new = dict(inflight)
        if old is not None:
            self._dirty.update(rid for rid, _ in old[1].items() ^ new.items())  # the counts that changed
        else:
            self._dirty.update(new)
        self._claims[ingress_id] = (self._clock(), new, max(0, int(unassigned)))
        while len(self._claims) > self.max_ingresses:
            self._dirty.update(self._claims.pop(next(iter(self._claims)))[1])

    def _fresh_claims(self) -> list[tuple[float, Mapping[str, int], int]]:
        now = self._clock()
        for ingress in [i for i, (at, _, _) in self._claims.items() if now - at > self.claim_ttl_s]:
            self._dirty.update(self._claims.pop(ingress)[1])
        return list(self._claims.values())

    def unassigned(self) -> int:
        """Requests the ingresses sent the direct way that no replica has answered yet."""
        return sum(n for _, _, n in self._fresh_claims())

    def update(self, report: ReplicaReport) -> None:
        now = self._clock()
        old = self._seen.get(report.replica_id)
        seen = _Seen(report, now)
        if old is not None:
            arrived = set(report.arrived_tickets)
            seen.outstanding = {t: at for t, at in old.outstanding.items()
                                if t not in arrived and now - at < self.grant_ttl_s}
            seen.preempting = old.preempting & set(seen.outstanding)
        self._hold(report.replica_id, None if old is None else old.report, report)
        self._seen[report.replica_id] = seen
        self._dirty.add(report.replica_id)
        self._repreempt(report.replica_id)

    def _hold(self, replica_id: str, old: ReplicaReport | None, new: ReplicaReport | None) -> None:
        """The holders index follows the replica's report from `old` to `new` (None: none)."""
        before = frozenset() if old is None else old.held
        after = frozenset() if new is None else new.held
        if before is after or before == after:
            return
        for aid in before - after:
            holders = self._holders[aid]
            holders.discard(replica_id)
            if not holders:
                del self._holders[aid]
        for aid in after - before:
            self._holders.setdefault(aid, set()).add(replica_id)

    def arrived(self, replica_id: str, tickets: Iterable[str]) -> None:
        """Granted tickets that reached the replica, told by a report the view could not use (a
        delta whose base it lacks): they no longer count against its room."""
        seen = self._seen.get(replica_id)
        if seen is None:
            return
        for ticket_id in tickets:
            seen.outstanding.pop(ticket_id, None)
            seen.preempting.discard(ticket_id)
        self._dirty.add(replica_id)
        self._repreempt(replica_id)

    def forget(self, replica_id: str) -> None:
        seen = self._seen.pop(replica_id, None)
        if seen is not None:
            self._hold(replica_id, seen.report, None)
            self._repreempt(replica_id)
        self._room_sum -= self._room.pop(replica_id, 0)
        self._dirty.discard(replica_id)

    def prune(self) -> list[str]:
        """Forget replicas silent for `stale_after_s`; returns their ids."""
        now = self._clock()
        gone = [rid for rid, s in self._seen.items() if now - s.at > self.stale_after_s]
        for rid in gone:
            self.forget(rid)
        return gone

    def replicas(self) -> list[ReplicaReport]:
        return [s.report for s in self._seen.values()]

    def get(self, replica_id: str) -> ReplicaReport | None:
        seen = self._seen.get(replica_id)
        return None if seen is None else seen.report

    def free(self, replica_id: str) -> int:
        """Requests the replica can still be given: capacity - in flight - grants on their way (in
        flight: the larger of its report and what the ingresses claim there)."""
        return self._free(replica_id, self._seen[replica_id], self._fresh_claims())

    def free_ids(self) -> list[str]:
        """The replicas with `free` > 0, in `ids` order (one pass, the claims read once)."""
        claims = self._fresh_claims()
        return [rid for rid, s in self._seen.items() if self._free(rid, s, claims) > 0]

    def total_free(self) -> int:
        """The sum of `free` over the replicas with room: O(replicas changed since the last call)."""
        claims = self._fresh_claims()
        for rid in self._dirty:
            seen = self._seen.get(rid)
            if seen is not None:
                room = max(0, self._free(rid, seen, claims))
                self._room_sum += room - self._room.get(rid, 0)
                self._room[rid] = room
        self._dirty.clear()
        return self._room_sum

    def with_room(self) -> list[str]:
        """The replicas with room (`free` > 0), in id order."""
        self.total_free()
        return sorted(rid for rid, room in self._room.items() if room > 0)

    def _free(self, replica_id: str, s: _Seen, claims: list[tuple[float, Mapping[str, int], int]]) -> int:
        since = s.at - self.claim_superseded_after_s  # claims made before: superseded by the report
        claimed = sum(inflight.get(replica_id, 0) for at, inflight, _ in claims if at > since)
        return s.report.capacity - max(s.report.ongoing + len(s.outstanding), claimed)

    def preemptible(self, replica_id: str, priority: int) -> int:
        """Less urgent running requests a grant over capacity could still preempt there."""
        s = self._seen[replica_id]
        return s.report.less_urgent_running(priority) - len(s.preempting)

    def preemptible_ids(self, priority: int) -> set[str]:
        """The replicas where `preemptible(rid, priority)` > 0 (read-only): built at the first ask
        for `priority`, then kept up to date with every report, arrival, preempting grant and
        forgotten replica, so that "where could a ticket of this priority preempt?" costs O(answer)."""
        ids = self._preemptible.get(priority)
        if ids is None:
            ids = {rid for rid in self._seen if self.preemptible(rid, priority) > 0}
            self._preemptible[priority] = ids
        return ids

    def _repreempt(self, replica_id: str) -> None:
        """`preemptible_ids` follows a change of the replica's report or of its preempting grants."""
        seen = self._seen.get(replica_id)
        for priority, ids in self._preemptible.items():
            if seen is not None and seen.report.less_urgent_running(priority) - len(seen.preempting) > 0:
                ids.add(replica_id)
            else:
                ids.discard(replica_id)

    def granted(self, replica_id: str, ticket_id: str, *, preempting: bool = False) -> None:
        s = self._seen.get(replica_id)
        if s is not None:
            self._dirty.add(replica_id)
            s.outstanding[ticket_id] = self._clock()
            if preempting:
                s.preempting.add(ticket_id)
                self._repreempt(replica_id)

    def ids(self) -> Iterable[str]:
        return self._seen.keys()

    def holders(self, adapter_id: str) -> frozenset[str] | set[str]:
        """The replicas whose report holds `adapter_id` (resident or loading); read-only."""
        return self._holders.get(adapter_id, frozenset())

    def __len__(self) -> int:
        return len(self._seen)

    def age_s(self, replica_id: str) -> float:
        return self._clock() - self._seen[replica_id].at

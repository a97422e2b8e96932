"""What each LoRA replica reports to the controller every period, and how it is bounded.

A `ReplicaReport` is a plain picklable record (no Ray types): node, device memory split, host
cache bytes, adapters resident and loading, requests running and waiting (in all and per SLA class),
recent latency and SLO attainment per class, and the replica's recent requests per adapter (its
busiest adapters only, so a report stays small with thousands of adapters), and the routing keys
of the prompt prefixes it ran lately (`prefix_keys.PrefixSummary`, at most `SUMMARY_KEYS`), which
the grant policy weighs (`scheduling.choose_replica`), and the adapters its host tier holds
(`host_held`: its host cache's most recently used, at most `MAX_REPORTED_HOST`), which a miss
prefers: a copy from host memory to the device takes milliseconds, a fetch from the source seconds;
and the adapters of the cluster tier whose published copy is on its node (`cluster_held`: those its
node published or copied, the most recent `MAX_REPORTED_CLUSTER`), which a miss without a host-tier
holder prefers: a read from the node's own copy, not a copy from a peer nor a fetch from the source.

The controller's view of all the reports is `cluster_view.ClusterView`.

Bounded in bytes: a report as the controller takes it (`from_dict`) keeps at most
`MAX_REPORTED_RESIDENT` resident and `MAX_REPORTED_LOADING` loading adapters (sorted, so that a
report and the same report rebuilt from deltas are equal), `MAX_REPORTED_HOST` adapters of its host
tier and `MAX_REPORTED_CLUSTER` of the cluster tier's copies on its node (each the last of the list as
sent, least recently used first, then sorted),
`MAX_REPORTED_ADAPTERS` adapters' demand,
`MAX_ARRIVED_TICKETS` arrived tickets, `SUMMARY_KEYS` prefix keys (the last, sorted) and
`MAX_REPORTED_CLASSES` classes,
and drops ids longer than `MAX_ID_LEN`: its JSON is at most `REPORT_MAX_BYTES`, and the view keeps one
report per replica. A replica mostly sends deltas of its report (`report_delta`); `seq` numbers its
reports so that a delta is applied only to the report it was computed from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.prefix_keys import SUMMARY_KEYS

MAX_REPORTED_ADAPTERS = 64  # per report: the replica's busiest adapters by recent requests
MAX_REPORTED_RESIDENT = 512  # adapters on the device listed per report (the first, sorted)
MAX_REPORTED_LOADING = 64  # adapters loading listed per report
MAX_REPORTED_HOST = 256  # adapters in host memory listed per report (the most recently used)
MAX_REPORTED_CLUSTER = 256  # adapters with a cluster-tier copy on the node listed per report (the latest)
MAX_ARRIVED_TICKETS = 512  # arrived tickets per report (beyond: a grant counts until `grant_ttl_s`)
MAX_REPORTED_CLASSES = 16  # SLA classes' stats per report
MAX_ID_LEN = 256  # longest adapter or ticket id kept (adapter ids are validated to this length)
# the JSON of a report at every bound above, ids at MAX_ID_LEN, plus 16 KiB for the counts and stats
REPORT_MAX_BYTES = ((MAX_REPORTED_RESIDENT + MAX_REPORTED_LOADING + MAX_REPORTED_HOST
                     + MAX_REPORTED_CLUSTER + MAX_REPORTED_ADAPTERS + MAX_ARRIVED_TICKETS) * (MAX_ID_LEN + 16)
                    + SUMMARY_KEYS * 32 + (16 << 10))


# The reports stay Python classes when this module is compiled: frozen (lora_cluster.compiled), and a
# report keeps what it derives in its `__dict__` (`_derived`, `updated`; mypyc's classes have none).
@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class MemorySplit:
    """Device memory of one replica, by use (bytes); `free` is what the device has left."""

    base_weights: int = 0
    kv_cache: int = 0
    adapter_pool: int = 0
    free: int | None = None  # None: unknown (CPU)
    host_cache: int = 0  # validated adapter weights held in host memory (the host tier)
    host_cache_budget: int = 0


T = TypeVar("T")


class _derived(Generic[T]):
    """A property computed once per report and kept in its `__dict__`, as `functools.cached_property`
    keeps it, without the lock that one takes on every first read (Python 3.11): a report is built
    and read by one thread, and computing a value twice gives the same value."""

    def __init__(self, fn: Callable[[Any], T]):
        self.fn, self.name = fn, ""  # the attribute's name: `__set_name__` (a compiled fn has no __name__)
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _derived[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object, owner: type | None = None) -> T | _derived[T]:
        if obj is None:
            return self  # the class's attribute: the descriptor
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@mypyc_attr(native_class=False)
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
    # of its free room, what this controller shard may grant (None: all; `sharding.split_room`)
    room: int | None = None
    # adapters its host tier (host memory) holds: the host cache's most recently used, sorted
    host_held: tuple[str, ...] = ()
    # adapters of the cluster tier with a published copy on its node (published or copied there), sorted
    cluster_held: tuple[str, ...] = ()

    @_derived
    def prefix_set(self) -> frozenset[str]:
        """Its reported prefix keys as a set (built once per report)."""
        return frozenset(self.prefixes)

    @property
    def ongoing(self) -> int:
        return self.running + self.waiting if self.active is None else self.active

    @_derived
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

    @_derived
    def held(self) -> frozenset[str]:
        """The adapters it holds: resident or loading (built once per report)."""
        return frozenset((*self.resident, *self.loading))

    @_derived
    def host_set(self) -> frozenset[str]:
        """The adapters its host tier holds, as a set (built once per report)."""
        return frozenset(self.host_held)

    @_derived
    def cluster_set(self) -> frozenset[str]:
        """The adapters whose cluster-tier copy is on its node, as a set (built once per report)."""
        return frozenset(self.cluster_held)

    def updated(self, values: Mapping[str, Any]) -> ReplicaReport:
        """This report with `values` (field -> value) in place of its own, as `dataclasses.replace`
        would build it, keeping what it derived from the fields `values` leaves alone (`held`,
        `prefix_set`, the less-urgent counts): a report changes in a few fields at a time."""
        if not _FIELDS.issuperset(values):
            raise TypeError(f"not report fields: {sorted(set(values) - _FIELDS)}")
        new = object.__new__(type(self))
        derived = new.__dict__
        derived.update(self.__dict__)
        derived.update(values)
        for name, sources in _DERIVED.items():
            if not sources.isdisjoint(values):
                derived.pop(name, None)
        return new

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


_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaReport))
# what a report derives once (its cached properties) -> the fields it derives it from
_DERIVED = {"held": frozenset({"resident", "loading"}), "prefix_set": frozenset({"prefixes"}),
            "host_set": frozenset({"host_held"}), "cluster_set": frozenset({"cluster_held"}),
            "_less_urgent": frozenset({"running_by_priority"})}
# the fields whose dict form differs or is bounded
WIRE_FIELDS = ("resident", "loading", "arrived_tickets", "prefixes", "running_by_priority", "memory",
               "adapter_requests", "classes", "host_held", "cluster_held")


def _ids(values: Iterable[Any], limit: int, *, ordered: bool) -> tuple[str, ...]:
    ids = [str(v) for v in values if len(str(v)) <= MAX_ID_LEN]
    return tuple(ids[:limit] if ordered else sorted(set(ids))[:limit])


def field_to_wire(name: str, value: Any) -> Any:
    """A report field's JSON-able form."""
    if name in ("resident", "loading", "arrived_tickets", "prefixes", "host_held", "cluster_held"):
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
    if name in ("host_held", "cluster_held"):  # the most recently used (last) `limit`, as a sorted set
        limit = MAX_REPORTED_HOST if name == "host_held" else MAX_REPORTED_CLUSTER
        return _ids(list(value or ())[-limit:], limit, ordered=False)
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


def normalized(report: ReplicaReport, **values: Any) -> ReplicaReport:
    """`report` within the module's bounds, as `from_dict(report.to_dict())` gives it, with `values`
    (other fields' new values, such as its `seq`) in the same copy."""
    return dataclasses.replace(report, **{n: field_from_wire(n, getattr(report, n)) for n in WIRE_FIELDS},
                               **values)

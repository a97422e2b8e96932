"""Replica reports as deltas: a replica sends what changed since the report the controller last
acknowledged, and a full report now and then (pure; the live replica and the simulator use it as is).

* `ReportEncoder` (the replica's side) numbers its reports (`ReplicaReport.seq`) and sends a full
  report first, every `full_every_s`, and whenever the controller's reply says it lacks the base
  (`resync`: it restarted, or a reply was lost so the replica's base is not the controller's); else a
  `ReportDelta` against the last acknowledged report. A report without a reply (controller
  unreachable) leaves the base where it was: the controller may or may not hold the lost one, and if
  it does, the next delta's base is not its own, so it asks for a full report.
* `ReportDelta` carries the fields whose value changed (`changed`), the adapters loaded and evicted
  (`resident_added`/`resident_removed`, likewise `loading_*`, the prefix keys, `prefixes_*`, and the
  host tier's adapters, `host_held_*`, and the cluster tier's copies on its node, `cluster_held_*`), and,
  as every report, the events since the previous report (requests per adapter, arrived tickets).
  `apply_delta(base, delta)` is the report the replica built, as `ReplicaReport.from_dict` bounds it:
  applying every delta of a sequence gives the latest full report exactly (tested on random
  sequences).
* `parse_report` reads either from its dict (the controller actor's path), within the bounds of
  `reports`: a delta lists at most as many adapters as a full report.

Invariant: the controller applies a delta only to the report numbered `base_seq`; anything else is a
resync, so its view of a replica is always one the replica built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.prefix_keys import SUMMARY_KEYS
from lora_cluster.cluster.reports import (
    MAX_ARRIVED_TICKETS,
    MAX_REPORTED_CLUSTER,
    MAX_REPORTED_HOST,
    MAX_REPORTED_LOADING,
    MAX_REPORTED_RESIDENT,
    ReplicaReport,
    field_from_wire,
    field_to_wire,
    normalized,
)

FULL_REPORT_EVERY_S = 30.0  # a replica sends a full report at least this often
SET_FIELDS = {"resident": MAX_REPORTED_RESIDENT, "loading": MAX_REPORTED_LOADING, "prefixes": SUMMARY_KEYS,
              "host_held": MAX_REPORTED_HOST, "cluster_held": MAX_REPORTED_CLUSTER}
EVENT_FIELDS = ("adapter_requests", "arrived_tickets")  # since the previous report: in every report
STATE_FIELDS = tuple(f.name for f in dataclasses.fields(ReplicaReport)
                     if f.name not in {"replica_id", "seq", *SET_FIELDS, *EVENT_FIELDS})
# each set field, its bound, and the names of its delta's two fields
_SET_DELTAS = tuple((name, limit, f"{name}_added", f"{name}_removed") for name, limit in SET_FIELDS.items())


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class ReportDelta:
    """What changed in a replica's report since its report `base_seq` (see the module docstring)."""

    replica_id: str
    seq: int
    base_seq: int
    changed: Mapping[str, Any] = field(default_factory=dict)  # state field -> its new value
    resident_added: tuple[str, ...] = ()
    resident_removed: tuple[str, ...] = ()
    loading_added: tuple[str, ...] = ()
    loading_removed: tuple[str, ...] = ()
    prefixes_added: tuple[str, ...] = ()  # routing keys of prompt prefixes run since, and those dropped
    prefixes_removed: tuple[str, ...] = ()
    host_held_added: tuple[str, ...] = ()  # adapters that entered its host tier since, and those that left
    host_held_removed: tuple[str, ...] = ()
    cluster_held_added: tuple[str, ...] = ()  # cluster-tier copies on its node since, and those gone
    cluster_held_removed: tuple[str, ...] = ()
    adapter_requests: Mapping[str, int] = field(default_factory=dict)
    arrived_tickets: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"delta": True, "replica_id": self.replica_id, "seq": self.seq,
                             "base_seq": self.base_seq,
                             "changed": {k: field_to_wire(k, v) for k, v in self.changed.items()}}
        for name in SET_FIELDS:
            d[f"{name}_added"] = list(getattr(self, f"{name}_added"))
            d[f"{name}_removed"] = list(getattr(self, f"{name}_removed"))
        for name in EVENT_FIELDS:
            d[name] = field_to_wire(name, getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReportDelta:
        """A delta from its dict: unknown fields dropped, every list within a full report's bounds."""
        changed = {k: field_from_wire(k, v) for k, v in dict(d.get("changed") or {}).items()
                   if k in STATE_FIELDS}
        sets = {f"{name}_{how}": field_from_wire(name, d.get(f"{name}_{how}"))
                for name in SET_FIELDS for how in ("added", "removed")}
        return cls(replica_id=str(d["replica_id"]), seq=int(d["seq"]), base_seq=int(d["base_seq"]),
                   changed=changed, **sets,
                   **{name: field_from_wire(name, d.get(name)) for name in EVENT_FIELDS})


def parse_report(d: Mapping[str, Any]) -> ReplicaReport | ReportDelta:
    """A full report or a delta, from the dict a replica sent."""
    return ReportDelta.from_dict(d) if d.get("delta") else ReplicaReport.from_dict(d)


def diff(base: ReplicaReport, new: ReplicaReport) -> ReportDelta:
    """The delta that turns `base` into `new` (both `normalized`)."""
    changed = {name: getattr(new, name) for name in STATE_FIELDS if getattr(new, name) != getattr(base, name)}
    sets: dict[str, tuple[str, ...]] = {}
    for name in SET_FIELDS:
        before, after = getattr(base, name), getattr(new, name)
        if before == after:  # mostly: both sorted (`normalized`), so equal sets are equal tuples
            continue
        old, now = set(before), set(after)
        sets[f"{name}_added"] = tuple(sorted(now - old))
        sets[f"{name}_removed"] = tuple(sorted(old - now))
    return ReportDelta(replica_id=new.replica_id, seq=new.seq, base_seq=base.seq, changed=changed, **sets,
                       adapter_requests=new.adapter_requests,
                       arrived_tickets=new.arrived_tickets[:MAX_ARRIVED_TICKETS])


def apply_delta(base: ReplicaReport, delta: ReportDelta) -> ReplicaReport:
    """`base` (the report numbered `delta.base_seq`) with `delta` applied."""
    values: dict[str, Any] = dict(delta.changed)
    for name, limit, added_field, removed_field in _SET_DELTAS:
        added, removed = getattr(delta, added_field), getattr(delta, removed_field)
        if added or removed:
            values[name] = tuple(sorted((set(getattr(base, name)) - set(removed)) | set(added)))[:limit]
    values.update(seq=delta.seq, adapter_requests=delta.adapter_requests,
                  arrived_tickets=delta.arrived_tickets)
    return base.updated(values)


class ReportEncoder:
    """The replica's side: what to send for each report it builds (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float], full_every_s: float = FULL_REPORT_EVERY_S):
        self.full_every_s, self._clock = full_every_s, clock
        self._seq = 0
        self._acked: ReplicaReport | None = None  # the last report the controller acknowledged
        self._sent: ReplicaReport | None = None
        self._sent_full = False
        self._full_at = -float("inf")

    @property
    def needs_full(self) -> bool:
        """Whether the next report is a full one (no acknowledged base, or one is due)."""
        return self._acked is None or self._clock() - self._full_at >= self.full_every_s

    def encode(self, report: ReplicaReport) -> ReplicaReport | ReportDelta:
        """Number `report` and return what to send for it: itself (bounded) or its delta."""
        self._seq += 1
        current = normalized(report, seq=self._seq)
        self._sent, self._sent_full = current, self.needs_full
        if self._sent_full or self._acked is None:
            return current
        return diff(self._acked, current)

    def replied(self, reply: Mapping[str, Any]) -> None:
        """The controller's reply to the last report: it is the base of the next delta, unless the
        reply says the controller lacked the delta's base (`resync`: the next report is full)."""
        if reply.get("resync"):
            self._acked = None
            return
        self._acked = self._sent
        if self._sent_full:
            self._full_at = self._clock()

"""A replica's routing stats: what the request router, the ingress's admission and `/metrics` know of it.

A live replica builds one in `record_routing_stats` and sends it as a plain dict (`to_dict`: Ray
Serve carries routing stats as a dict, polled every `routing_stats_period_s`); the request router
parses each dict once (`from_dict`) when Serve broadcasts the replica list, and every reader in the
ingress process reads the typed object by attribute. The simulator builds the same object.

Invariants:
* `from_dict` never raises on a report that lacks fields (a replica that has not reported yet
  sends `{}`) and ignores unknown keys (a replica of a newer version during a rolling upgrade):
  a missing routing field reads as "unknown", and the router then assumes room.
* `prefixes` (routing keys of the prompt prefixes its cache holds, `cluster.prefix_keys`) keeps at
  most `SUMMARY_KEYS` keys of a report, and `host_held` (the adapters its host tier holds, the most
  recently used last) at most `MAX_REPORTED_HOST`, the last of the list, whatever the report holds.
* `to_dict(from_dict(d))` keeps every field this version knows; the operator payloads (`store`,
  `engine`, `memory`, `classes`, `breakers`, `adapter_thrash`) travel as reported.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.prefix_keys import SUMMARY_KEYS
from lora_cluster.cluster.reports import MAX_REPORTED_HOST

UNKNOWN_SLOTS = 1 << 30  # a capacity not reported yet: assume room


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class RoutingStats:
    """One replica's last routing report (see the module docstring)."""

    resident: tuple[str, ...] = ()  # adapters on its device
    loading: tuple[str, ...] = ()  # adapters being placed there
    empty_adapter_slots: int | None = None  # slots a new adapter takes without evicting another
    free_adapter_slots: int | None = None  # empty or holding an idle adapter
    max_loras: int | None = None  # its adapter slots
    num_running: int = 0
    num_waiting: int = 0
    free_seq_slots: int | None = None
    max_num_seqs: int | None = None  # sequences it decodes together
    miss_penalty: float = 0.0  # 0..1: in adapter thrash, a miss is better sent elsewhere
    group: str | None = None  # its replica group
    base: str | None = None  # the API name of the base model it serves
    node_id: str | None = None
    requests: int = 0  # counts since it started
    hits: int = 0
    misses: int = 0
    cancelled: int = 0
    errors: int = 0
    adapter_thrash: Mapping[str, Any] = field(default_factory=dict)  # copy_share, reload_share, ...
    breakers: Mapping[str, Any] = field(default_factory=dict)
    store: Mapping[str, Any] = field(default_factory=dict)  # tier -> counters
    classes: Mapping[str, Any] = field(default_factory=dict)  # SLA class -> stats
    engine: Mapping[str, Any] = field(default_factory=dict)  # engine counters
    memory: Mapping[str, Any] = field(default_factory=dict)  # device memory by use
    prefixes: tuple[str, ...] = ()  # routing keys of prefixes its cache holds (`prefix_keys.PrefixSummary`)
    host_held: tuple[str, ...] = ()  # adapters its host tier holds (a miss there copies from host memory)

    @property
    def ongoing(self) -> int:
        """Requests it runs or queues, as reported."""
        return self.num_running + self.num_waiting

    @functools.cached_property
    def held(self) -> frozenset[str]:
        """Its adapters on the device or being placed there (built once per report)."""
        return frozenset(self.resident) | frozenset(self.loading)

    @functools.cached_property
    def prefix_set(self) -> frozenset[str]:
        """Its reported prefix keys as a set (built once per report)."""
        return frozenset(self.prefixes)

    @functools.cached_property
    def host_set(self) -> frozenset[str]:
        """The adapters its host tier holds, as a set (built once per report)."""
        return frozenset(self.host_held)

    def holds(self, adapter_id: str) -> bool:
        """The adapter is on its device or being placed there."""
        return adapter_id in self.resident or adapter_id in self.loading

    def prefix_cache(self) -> dict[str, Any] | None:
        """Its engine's prefix cache since it started (None: the report has no engine counters):
        `queried_tokens` (tokens of admitted requests looked up, re-admissions included),
        `hit_tokens` (of those, found cached), `hit_rate` (hit / queried; None before any query),
        `cached_blocks` (KV blocks holding cached content now) and `evictions`. A replica with the
        cache off reports zeros."""
        engine = self.engine
        if "prefix_cache_queried_tokens" not in engine:
            return None
        queried = int(engine["prefix_cache_queried_tokens"])
        hit = int(engine.get("prefix_cache_hit_tokens", 0))
        return {"queried_tokens": queried, "hit_tokens": hit,
                "hit_rate": round(hit / queried, 4) if queried else None,
                "cached_blocks": int(engine.get("prefix_cache_blocks", 0)),
                "evictions": int(engine.get("prefix_cache_evictions", 0))}

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON-ready: adapter lists as lists)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["resident"], out["loading"] = list(self.resident), list(self.loading)
        out["prefixes"], out["host_held"] = list(self.prefixes), list(self.host_held)
        for name in ("adapter_thrash", "breakers", "store", "classes", "engine", "memory"):
            out[name] = dict(out[name])
        return out

    @classmethod
    def from_dict(cls, report: Mapping[str, Any] | None) -> RoutingStats:
        """Parse a replica's report (see the module docstring for what is tolerated)."""
        report = report or {}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in report or report[f.name] is None:
                continue
            raw = report[f.name]
            if f.name in ("resident", "loading"):
                values[f.name] = tuple(str(a) for a in raw)
            elif f.name == "prefixes":
                values[f.name] = tuple(str(k) for k in list(raw)[-SUMMARY_KEYS:])
            elif f.name == "host_held":
                values[f.name] = tuple(str(a) for a in list(raw)[-MAX_REPORTED_HOST:])
            elif f.name == "miss_penalty":
                values[f.name] = min(1.0, max(0.0, float(raw)))
            elif f.name in ("group", "base", "node_id"):
                values[f.name] = str(raw)
            elif f.name in ("adapter_thrash", "breakers", "store", "classes", "engine", "memory"):
                values[f.name] = dict(raw)
            else:
                values[f.name] = int(raw)
        return cls(**values)

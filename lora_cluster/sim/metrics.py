"""What a run measures, and the result it prints.

Only requests that arrive after the warm-up (`measured`) count. Per SLA class:

* `ttft_p50_s`, `ttft_p99_s`: time from arrival to the first token, over completed requests
  (nearest-rank percentiles, `class_stats.percentile`);
* `slo_attainment`: the share of the class's requests that completed and met the class's targets
  (`SlaClass.met`: TTFT and TPOT); a rejected request, or one still unfinished when the run stops,
  did not meet them.

Overall: `completed`, `rejected` (refused by the cluster queue or Serve's queue, or timed out in the
cluster queue), `hit_rate` (completed requests whose adapter was on the device of the replica that
ran them when they reached it; `details["joined_load_rate"]`: those whose adapter was not there
yet but already being fetched there for an earlier request, which cost no load of their own) and
`adapter_loads` (fetches by the tier they started from, after
the warm-up, prefetches included). With `buckets` (adapters by popularity rank),
`details["completed_by_rank"]` gives, per class and rank bucket, the requests offered and
completed: whom a policy serves and whom it refuses, by how popular their adapter is.

Per class also `offered`, `completed` and `refused`. Beside `hit_rate` (over completed requests, which
a policy can raise by refusing the tail), `hit_rate_offered` counts a refused or unfinished request
as no hit, and `psb` is the pinned-slot bound of the completed traffic (`sim.slot_bound`), from its
inputs `adapters_completed`, `slot_hold_s_mean` (first admission into a running batch to the end),
`slots_total`, `max_num_seqs` and `window_s` (the measured span of arrivals). Beside them
`static_ceiling` (the same placement without the tail's slots, `slot_bound.static_ceiling`) and
`hit_rate_ceiling` (the old ceiling: the offered traffic's share of the `slots` most popular adapters,
which ignores pinned slots and counts refused requests; kept for comparison, not a target).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lora_cluster.cluster.class_stats import percentile
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.errors import (
    ClusterOverloadedError,
    ColdAdapterShedError,
    DeadlineOutOfReachError,
    QueueFullError,
    WaitBoundError,
)
from lora_cluster.sim.slot_bound import pinned_slot_bound, static_ceiling
from lora_cluster.sim.workload import SimRequest

if TYPE_CHECKING:
    from lora_cluster.sim.census import RankBuckets

TIERS = ("host", "disk", "peer", "s3")  # "peer": another node's copy (`sim.cluster_store`)


def refusal_reason(error: ClusterOverloadedError) -> str:
    """The reason the controller (or the edge, for it) refused a request, as `rejections` counts it."""
    if isinstance(error, ColdAdapterShedError):
        return "adapter on no replica while its class sheds"
    if isinstance(error, DeadlineOutOfReachError):
        return "deadline out of reach"
    if isinstance(error, WaitBoundError):
        return "class over its wait bound"
    return "cluster queue full" if isinstance(error, QueueFullError) else "wait over the queue timeout"


MACHINE_KEYS = ("wall_s", "sim_cpu_s_per_request", "control_plane")  # `to_json` keys set by the machine


@dataclass
class SimResult:
    completed: int
    rejected: int
    hit_rate: float | None
    adapter_loads: dict[str, int]
    classes: dict[str, dict[str, float | None]]
    wall_s: float
    details: dict[str, Any] = field(default_factory=dict)  # not printed by --json: run and policy figures
    profile: str | None = None  # the replica profile the run used (`ReplicaProfile.name`, e.g. gpu-papers)
    chats: dict[str, Any] | None = None  # the chat workload's figures (`Metrics.chat_figures`), if any
    bases: dict[str, Any] | None = None  # per base model, with several (`sim.bases.BaseFigures`)
    bound: dict[str, Any] = field(default_factory=dict)  # the slot bound's inputs and PSB (`Metrics.result`)

    def to_json(self) -> dict[str, Any]:
        """The object `--json` prints (exactly these keys, `chats` when the run had chats, and
        `control_plane` with the lora-cluster policy: reports per second per replica and controller
        CPU seconds per simulated second, at steady state; `bases` with several base models), and the
        simulator's own speed: `sim_cpu_s_per_request`, its process's CPU seconds per arrival."""
        out = {"profile": self.profile, "completed": self.completed, "rejected": self.rejected,
               "hit_rate": self.hit_rate, "adapter_loads": dict(self.adapter_loads), "classes": self.classes,
               "wall_s": self.wall_s, "sim_cpu_s_per_request": self.details.get("sim_cpu_s_per_request"),
               **self.bound}
        if self.chats is not None:
            out["chats"] = self.chats
        if self.bases is not None:
            out["bases"] = self.bases
        if self.details.get("control_plane") is not None:  # the lora-cluster policy's controller figures
            out["control_plane"] = self.details["control_plane"]
        return out


class _ClassTally:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.met = self.completed = self.rejected = self.unfinished = 0


class Metrics:
    def __init__(self, classes: SlaClasses, *, measure_from: float, clock: Callable[[], float],
                 buckets: RankBuckets | None = None):
        self.measure_from, self._clock, self._buckets = measure_from, clock, buckets
        # (class, rank bucket) -> [offered, completed]: bounded by classes x buckets
        self.by_rank: dict[tuple[str, str], list[int]] = {}
        self.classes = {c.name: _ClassTally() for c in classes.classes}
        self.loads: Counter[str] = Counter({t: 0 for t in TIERS})
        self.rejections: Counter[str] = Counter()
        self.hits = self.joined = self.completed = self.preempted_requests = 0
        self.outstanding = 0  # requests arrived and not yet ended (all, measured or not)
        self.prompt_tokens = self.cached_tokens = 0  # of measured completed requests
        self.by_replica: Counter[str] = Counter()  # measured completed requests per replica
        self.by_adapter: Counter[str] = Counter()  # measured completed requests per adapter
        self.hold_s = 0.0  # their total slot hold time (first admission to the end)
        self.on_end: Callable[[SimRequest, bool], None] | None = None  # hears every end (completed or not)

    def arrived(self) -> None:
        self.outstanding += 1

    def finished(self, req: SimRequest) -> None:
        self.outstanding -= 1
        if self.on_end is not None:
            self.on_end(req, True)
        if not req.measured:
            return
        self.prompt_tokens += req.prompt
        self.cached_tokens += req.cached
        self.by_replica[str(req.replica)] += 1
        self.by_adapter[req.adapter] += 1
        if req.admitted_at is not None:
            self.hold_s += req.finish_at - req.admitted_at  # type: ignore[operator]
        tally = self.classes[req.sla.name]
        tally.completed += 1
        self._count(req, completed=True)
        self.completed += 1
        self.hits += req.hit
        self.joined += req.joined
        self.preempted_requests += req.preemptions > 0
        ttft = req.first_token_at - req.arrival  # type: ignore[operator]
        tally.ttfts.append(ttft)
        tally.met += req.sla.met(ttft, req.tpot_s())

    def rejected(self, req: SimRequest, reason: str) -> None:
        self.outstanding -= 1
        if self.on_end is not None:
            self.on_end(req, False)
        if req.measured:
            self.classes[req.sla.name].rejected += 1
            self.rejections[reason] += 1
            self._count(req, completed=False)

    def _count(self, req: SimRequest, *, completed: bool) -> None:
        if self._buckets is not None:
            cell = self.by_rank.setdefault((req.sla.name, self._buckets(req.adapter)), [0, 0])
            cell[0] += 1
            cell[1] += completed

    def load(self, tier: str) -> None:
        if self._clock() >= self.measure_from:
            self.loads[tier] += 1

    def _completed_by_rank(self) -> dict[str, dict[str, dict[str, int]]]:
        if self._buckets is None:
            return {}
        return {name: {label: dict(zip(("offered", "completed"), self.by_rank.get((name, label), (0, 0)),
                                       strict=True))
                       for label in self._buckets.labels}
                for name in self.classes}

    def chat_figures(self, replica_ids: Iterable[str]) -> dict[str, Any]:
        """Of the measured completed requests: the share of prompt tokens found in their replica's
        prefix cache; requests completed per replica (`replica_load`: min, mean, max, and max over
        mean: 1.0 is a perfect balance); TTFT p50 and p99 over every class."""
        per = [self.by_replica.get(rid, 0) for rid in replica_ids]
        mean = sum(per) / len(per) if per else 0.0
        ttfts = [t for tally in self.classes.values() for t in tally.ttfts]
        return {"cached_token_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "replica_load": {"min": min(per, default=0), "mean": mean, "max": max(per, default=0),
                                 "max_over_mean": max(per) / mean if mean else None},
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}

    def result(self, unfinished: Iterable[SimRequest], wall_s: float, details: dict[str, Any], *,
               slots: int, max_num_seqs: int, window_s: float) -> SimResult:
        """The run's result; `slots` (the cluster's adapter slots), `max_num_seqs` and `window_s` (the
        measured span of arrivals) are the slot bound's inputs (`sim.slot_bound`)."""
        for req in unfinished:
            if req.measured:
                self.classes[req.sla.name].unfinished += 1
                self._count(req, completed=False)
        out: dict[str, dict[str, float | None]] = {}
        for name, t in self.classes.items():
            offered = t.completed + t.rejected + t.unfinished
            out[name] = {"ttft_p50_s": percentile(t.ttfts, 50), "ttft_p99_s": percentile(t.ttfts, 99),
                         "slo_attainment": t.met / offered if offered else None,
                         "offered": offered, "completed": t.completed, "refused": t.rejected}
        rejected = sum(self.rejections.values())
        details = {**details, "rejections": dict(self.rejections),
                   "unfinished": sum(t.unfinished for t in self.classes.values()),
                   "preempted_requests": self.preempted_requests,
                   "joined_load_rate": self.joined / self.completed if self.completed else None,
                   "by_class": {n: {"offered": t.completed + t.rejected + t.unfinished,
                                    "completed": t.completed, "rejected": t.rejected, "met": t.met}
                                for n, t in self.classes.items()},
                   "completed_by_rank": self._completed_by_rank()}
        offered = sum(c["offered"] for c in out.values())  # type: ignore[misc]
        hold = self.hold_s / self.completed if self.completed else None
        inputs = (self.by_adapter, slots, max_num_seqs, hold or 0.0, window_s)
        bound = {"hit_rate_offered": self.hits / offered if offered else None,
                 "psb": pinned_slot_bound(*inputs), "static_ceiling": static_ceiling(*inputs),
                 "hit_rate_ceiling": details.get("hit_rate_ceiling"),
                 "slot_hold_s_mean": hold, "adapters_completed": dict(sorted(self.by_adapter.items())),
                 "slots_total": slots, "max_num_seqs": max_num_seqs, "window_s": window_s}
        return SimResult(completed=self.completed, rejected=rejected, bound=bound,
                         hit_rate=self.hits / self.completed if self.completed else None,
                         adapter_loads={t: self.loads[t] for t in TIERS}, classes=out, wall_s=wall_s,
                         details=details, profile=details.get("profile"))

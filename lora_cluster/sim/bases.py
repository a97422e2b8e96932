"""Several base models in one simulated cluster: replica groups, one base each, as `replica_groups` runs them.

In the live system each replica group may name its own base (`ReplicaGroupConfig.model`); a request's
`model` (a base, or an adapter listed under one base) selects the group; each group is its own
deployment with its own cluster controller (`serve.app`), and the ingress keeps one dispatcher per
group, with the group's own request router and cluster admission (`serve.routing.group_dispatch`),
so neither a routing decision nor a cluster-queue grant can send a request to another base's replica.

`BaseSplit` models that: the nodes split into `K` groups (equal shares, the first groups one more
when they do not divide, or explicit sizes), group `b` serving base `b`; the adapters split among the
bases, adapter `a{i}` (Zipf rank `i`) under base `i % K`, so each base has its own Zipf-ranked
population (ranks `b`, `b + K`, ...) and its share of the traffic is its adapters' share of the
popularity. `GroupedPolicy` builds one policy per group (`LoraClusterPolicy`: one `Controller`, one
router, one admission check over that group's replicas only; the baselines likewise) and hands each
request to its adapter's base's policy, and each replica's events to its own group's policy. One base
(`K = 1`) is not wrapped at all: the run is the one-base simulation, unchanged.

`BaseFigures` tallies each base's measured requests (hearing every end through `Metrics.on_end`):
per base its replicas, the requests offered, completed and rejected, the hit rate and its ceiling
(its slots caching its most popular adapters), and per class the SLO attainment, computed as
`Metrics` computes the cluster's, so the bases' counts add up to the cluster's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.sim.context import Policy, SimContext
from lora_cluster.sim.popularity import zipf_weights
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest


def base_name(index: int) -> str:
    """The name of base `index` in the run's figures (`base0`, `base1`, ...)."""
    return f"base{index}"


def node_shares(nodes: int, bases: int, sizes: Sequence[int] = ()) -> tuple[int, ...]:
    """Each group's node count: `sizes` when given (checked: one per base, each >= 1, adding up to
    `nodes`), otherwise `nodes` split as equally as possible, the first groups one node more."""
    if sizes:
        if len(sizes) != bases or any(n < 1 for n in sizes) or sum(sizes) != nodes:
            raise ValueError(f"base node counts {','.join(map(str, sizes))}: need {bases} counts, each >= 1, "
                             f"adding up to {nodes} nodes")
        return tuple(sizes)
    if not 1 <= bases <= nodes:
        raise ValueError(f"{bases} bases need between 1 and {nodes} (the nodes) groups")
    q, r = divmod(nodes, bases)
    return tuple(q + (b < r) for b in range(bases))


@dataclass(frozen=True)
class BaseSplit:
    """Which base each replica serves and each adapter is listed under (see the module docstring)."""

    bases: int
    replica_base: dict[str, int]  # replica id -> its group's base
    adapter_base: dict[str, int]  # adapter id -> its base

    @classmethod
    def build(cls, replica_ids: Sequence[str], adapter_names: Sequence[str],
              sizes: Sequence[int]) -> BaseSplit:
        """`replica_ids` in order, the first `sizes[0]` to base 0 and so on; adapter rank `i` to
        base `i % K`."""
        k = len(sizes)
        if k > len(adapter_names):
            raise ValueError(f"{k} bases need at least {k} adapters, got {len(adapter_names)}")
        owners = [b for b, n in enumerate(sizes) for _ in range(n)]
        return cls(bases=k, replica_base=dict(zip(replica_ids, owners, strict=True)),
                   adapter_base={name: i % k for i, name in enumerate(adapter_names)})

    def replicas_of(self, base: int) -> list[str]:
        return [rid for rid, b in self.replica_base.items() if b == base]

    def popularity_share(self, zipf: float) -> list[float]:
        """Each base's share of the traffic: its adapters' share of the Zipf weights."""
        weights = zipf_weights(len(self.adapter_base), zipf)
        shares = [0.0] * self.bases
        for i, w in enumerate(weights):
            shares[i % self.bases] += w
        total = sum(weights)
        return [s / total for s in shares]

    def hit_rate_ceiling(self, zipf: float, max_loras: int) -> list[float]:
        """Per base, the share of its traffic its `replicas x max_loras` slots hold if they always
        cache its most popular adapters."""
        weights = zipf_weights(len(self.adapter_base), zipf)
        out = []
        for b in range(self.bases):
            own = weights[b::self.bases]
            out.append(sum(own[:len(self.replicas_of(b)) * max_loras]) / sum(own))
        return out

    def cluster_ceiling(self, zipf: float, max_loras: int) -> float:
        """The cluster's hit-rate ceiling: each base's, weighted by its share of the traffic."""
        return sum(s * c for s, c in zip(self.popularity_share(zipf), self.hit_rate_ceiling(zipf, max_loras),
                                         strict=True))


def _numeric_tables(tables: Sequence[object]) -> list[dict[str, int | float]] | None:
    """The groups' tables of one key when every one maps names to numbers, else None."""
    found: list[dict[str, int | float]] = []
    for table in tables:
        if not isinstance(table, dict) or not all(isinstance(v, int | float) for v in table.values()):
            return None
        found.append(table)
    return found


def _number(value: object) -> int | float:
    """One group's figure of a key whose first group's figure is a number (kept an int when it is one)."""
    if not isinstance(value, int | float):
        raise TypeError(f"the groups disagree on a figure's type: {value!r} is not a number")
    return value


class GroupedPolicy:
    """One policy per replica group, each over its group's replicas only; a request goes to its
    adapter's base's policy, a replica's events to its own group's policy."""

    def __init__(self, ctx: SimContext, split: BaseSplit, make: Callable[[SimContext], Policy]):
        self.split = split
        self.groups: list[Policy] = []
        for b in range(split.bases):
            replicas = {rid: ctx.replicas[rid] for rid in split.replicas_of(b)}
            adapters = [a for a, base in split.adapter_base.items() if base == b]
            self.groups.append(make(SimContext(loop=ctx.loop, replicas=replicas, metrics=ctx.metrics,
                                               classes=ctx.classes, serve=ctx.serve, rng=ctx.rng,
                                               demand=ctx.demand.only(adapters),
                                               control_cost=ctx.control_cost)))
        self.name = self.groups[0].name

    def start(self) -> None:
        for policy in self.groups:
            policy.start()

    def arrive(self, req: SimRequest) -> None:
        self.groups[self.split.adapter_base[req.adapter]].arrive(req)

    def _of(self, replica: SimReplica) -> Policy:
        return self.groups[self.split.replica_base[replica.replica_id]]

    def first_token(self, replica: SimReplica, req: SimRequest) -> None:
        self._of(replica).first_token(replica, req)

    def finished(self, replica: SimReplica, req: SimRequest) -> None:
        self._of(replica).finished(replica, req)

    def planned(self, replica: SimReplica) -> None:
        self._of(replica).planned(replica)

    def pending(self) -> list[SimRequest]:
        return [req for policy in self.groups for req in policy.pending()]

    def details(self) -> dict[str, object]:
        """Every group's policy details, by base (`by_base`); the numbers (calls, counts, CPU seconds,
        queue depths: `queue_depth_max` is then the sum of the groups' maxima, a bound of the
        cluster's) also summed over the groups at the top level, as a one-base run reports them."""
        per = [policy.details() for policy in self.groups]
        out: dict[str, object] = {"by_base": {base_name(b): d for b, d in enumerate(per)}}
        for key, value in per[0].items():
            if key == "control_plane":
                out[key] = self._control_plane(per)
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | dict):
                continue
            if isinstance(value, dict):
                tables = _numeric_tables([d.get(key, {}) for d in per])
                if tables is not None:
                    summed: dict[str, int | float] = {}
                    for table in tables:
                        for k, v in table.items():
                            summed[k] = summed.get(k, 0) + v
                    out[key] = summed
            else:  # queue_depth_mean: the groups' queues are sampled at the same ticks, so means add
                out[key] = sum(_number(d[key]) for d in per)  # up; queue_depth_max: the sum of their maxima
        return out

    def _control_plane(self, per: list[dict[str, object]]) -> dict[str, float | None]:
        """The groups' steady-state control-plane figures: reports per second per replica over every
        replica, controller CPU seconds per simulated second summed over the controllers."""
        figures = [d["control_plane"] for d in per]
        if any(not isinstance(f, dict) or f.get("reports_per_s_per_replica") is None for f in figures):
            return {"reports_per_s_per_replica": None, "controller_cpu_s_per_sim_s": None}
        sizes = [len(self.split.replicas_of(b)) for b in range(self.split.bases)]
        rates = [f["reports_per_s_per_replica"] * n for f, n in zip(figures, sizes, strict=True)]  # type: ignore[index]
        return {"reports_per_s_per_replica": sum(rates) / sum(sizes),
                "controller_cpu_s_per_sim_s": sum(f["controller_cpu_s_per_sim_s"] for f in figures)}  # type: ignore[index]


class _Tally:
    def __init__(self, classes: SlaClasses) -> None:
        self.offered = self.completed = self.rejected = self.hits = 0
        self.by_class = {c.name: [0, 0] for c in classes.classes}  # class -> [offered, met]


class BaseFigures:
    """Each base's measured requests (see the module docstring); `ended` is a `Metrics.on_end`."""

    def __init__(self, split: BaseSplit, classes: SlaClasses, *,
                 then: Callable[[SimRequest, bool], None] | None):
        self.split, self.then = split, then
        self.tallies = [_Tally(classes) for _ in range(split.bases)]

    def ended(self, req: SimRequest, completed: bool) -> None:
        """A request ended (completed, or rejected); the next hook (chats) hears it after."""
        if req.measured:
            t = self._count(req)
            if completed:
                t.completed += 1
                t.hits += req.hit
                ttft = req.first_token_at - req.arrival  # type: ignore[operator]
                t.by_class[req.sla.name][1] += req.sla.met(ttft, req.tpot_s())
            else:
                t.rejected += 1
        if self.then is not None:
            self.then(req, completed)

    def _count(self, req: SimRequest) -> _Tally:
        t = self.tallies[self.split.adapter_base[req.adapter]]
        t.offered += 1
        t.by_class[req.sla.name][0] += 1
        return t

    def result(self, unfinished: Sequence[SimRequest], *, zipf: float, max_loras: int) -> dict[str, object]:
        """Per base: replicas, traffic share, offered / completed / rejected / unfinished, hit rate
        and its ceiling, per-class SLO attainment and its counts (`by_class`: offered, met)."""
        left = [0] * self.split.bases
        for req in unfinished:
            if req.measured:
                self._count(req)
                left[self.split.adapter_base[req.adapter]] += 1
        shares = self.split.popularity_share(zipf)
        ceilings = self.split.hit_rate_ceiling(zipf, max_loras)
        adapters = [0] * self.split.bases
        for b in self.split.adapter_base.values():
            adapters[b] += 1
        out: dict[str, object] = {}
        for b, t in enumerate(self.tallies):
            out[base_name(b)] = {
                "replicas": self.split.replicas_of(b), "adapters": adapters[b], "traffic_share": shares[b],
                "offered": t.offered, "completed": t.completed, "rejected": t.rejected, "unfinished": left[b],
                "hit_rate": t.hits / t.completed if t.completed else None, "hit_rate_ceiling": ceilings[b],
                "slo_attainment": {name: met / offered if offered else None
                                   for name, (offered, met) in t.by_class.items()},
                "by_class": {name: {"offered": offered, "met": met}
                             for name, (offered, met) in t.by_class.items()},
            }
        return out

"""Where the cluster's adapter slots go: a periodic census of every replica's device slots (and, for
benchmarks, why requests miss: `MissCensus`).

The hit-rate ceiling of docs/scale.md (`popularity.zipf_share` of `nodes x max_loras` slots) assumes
every slot caches one of the most popular adapters. A slot whose adapter has running requests cannot be
given to another adapter, however unpopular its own adapter is: each running request pins its
adapter's slot until it ends. The census shows how the slots split, by the popularity rank of the
adapter in them (rank 1 is the hottest; a run's buckets end at 1/32, 1/4 and all of its slots) and
by state: `running` (requests of it run there) or `cached` (held without references, so
evictable). Averaged over samples taken every `period_s` of the measured period; it reads the
replicas' slots and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

DEFAULT_EDGES = (16, 128, 512)  # rank buckets: 1-16, 17-128, 129-512, 513+ (a run passes its own)


class RankBuckets:
    """Adapters by popularity rank: `labels` ("1-16", ..., "513+"), and the label of an adapter."""

    def __init__(self, rank: Callable[[str], int], edges: Sequence[int] = DEFAULT_EDGES):
        self.rank, self.edges = rank, tuple(edges)
        bounds = (0, *self.edges)
        self.labels = [f"{lo + 1}-{hi}" for lo, hi in zip(bounds, self.edges, strict=False)]
        self.labels.append(f"{self.edges[-1] + 1}+")
        self._label: dict[str, str] = {}  # adapter -> its label, as asked (bounded by the run's adapters)

    def __call__(self, adapter_id: str) -> str:
        label = self._label.get(adapter_id)
        if label is None:
            r = self.rank(adapter_id)
            label = next((label for label, edge in zip(self.labels, self.edges, strict=False) if r <= edge),
                         self.labels[-1])
            self._label[adapter_id] = label
        return label


class SlotCensus:
    def __init__(self, replicas: Mapping[str, SimReplica], buckets: RankBuckets, *, loop: EventLoop,
                 start: float, end: float, period_s: float = 1.0):
        self.replicas, self.buckets, self.loop = replicas, buckets, loop
        self.end, self.period_s = end, period_s
        self.totals = {label: {"running": 0, "cached": 0} for label in buckets.labels}
        self.samples = 0
        loop.at(start, self._sample)

    def _sample(self) -> None:
        self.samples += 1
        for replica in self.replicas.values():
            for adapter_id, refs in replica.adapters.refs.items():
                self.totals[self.buckets(adapter_id)]["running" if refs else "cached"] += 1
        if self.loop.now + self.period_s < self.end:
            self.loop.after(self.period_s, self._sample)

    def result(self) -> dict[str, object]:
        """Mean slots per sample by rank bucket and state, and the total of slots."""
        n = max(self.samples, 1)
        slots = sum(r.adapters.max_loras for r in self.replicas.values())
        return {"slots": slots, "samples": self.samples,
                "by_rank": {label: {state: round(v / n, 1) for state, v in counts.items()}
                            for label, counts in self.totals.items()}}


MISS_KINDS = ("cold", "copy", "joined")


class MissCensus:
    """Why requests missed their adapter, by the popularity rank of the adapter: for each request that
    reached a replica without its adapter in a device slot there (`SimReplica`'s miss hook,
    `Simulation.on_miss`), in the measured period, whether the adapter was

    * `cold`: in no device slot of the cluster, and loading nowhere for a request (a host prefetch
      does not count): every copy was evicted since its last request, or it never had one;
    * `copy`: in a slot at another replica, or being loaded there for a request (routing sent it
      away from a copy);
    * `joined`: being fetched at that replica already (another request's load, or a prefetch).

    A routing policy can turn copies into hits; a cold miss only a policy that keeps the adapter
    resident somewhere can. O(replicas) per miss: an observer for benchmarks
    (benchmarks/bench_miss_kinds.py), which the simulation does not wire by itself."""

    def __init__(self, replicas: Mapping[str, SimReplica], buckets: RankBuckets, *,
                 clock: Callable[[], float], start: float, end: float):
        self.replicas, self.buckets, self.clock = replicas, buckets, clock
        self.start, self.end = start, end
        self.counts = {label: dict.fromkeys(MISS_KINDS, 0) for label in buckets.labels}

    def missed(self, replica: SimReplica, req: SimRequest) -> None:
        """`req` reached `replica` and missed its adapter there (`req.joined`: its load was under way)."""
        if not self.start <= self.clock() < self.end or req.adapter is None:
            return
        aid = req.adapter
        if req.joined:
            kind = "joined"
        elif any(aid in r.adapters.refs or r.adapters.loading.get(aid) is False  # True: a host prefetch
                 for r in self.replicas.values() if r is not replica):
            kind = "copy"
        else:
            kind = "cold"
        self.counts[self.buckets(aid)][kind] += 1

    def result(self) -> dict[str, dict[str, int]]:
        """Misses in the measured period by rank bucket and kind."""
        return {label: dict(kinds) for label, kinds in self.counts.items()}

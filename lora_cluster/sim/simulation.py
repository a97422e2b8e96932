"""One simulation run: a cluster of simulated replicas, a workload, a routing policy.

A run starts with every adapter only in S3, or, with `preload` N, with the N most popular in every
node's store, as after the engine's `preload` setting listed them. A run lasts `warmup + duration`
simulated seconds of arrivals, then drains (no new arrivals) until
every request has ended or `drain_limit_s` passed. Requests that arrive during the warm-up load the
cluster but are not measured. Each node runs one replica (one GPU, or one CPU engine for the
measured profile), with its own host and disk tiers. With `bases` K > 1 the nodes form K replica
groups, one base model each, and a request runs only in its adapter's base's group (`sim.bases`).

Offered load: `load` times the cluster's *rated capacity*, the rate at which every replica keeps a
full batch of `max_num_seqs` requests with no adapter loads: a request holds its batch slot for
about `mean output` steps, and a full batch's step carries `max_num_seqs` decode tokens plus
`max_num_seqs * mean prompt / mean output` prefill tokens over `min(max_num_seqs, max_loras)`
adapters, so one replica serves `max_num_seqs / (mean output * step_s)` requests per second.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from lora_cluster.cluster.process_gc import young_threshold
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import EngineConfig
from lora_cluster.sim.baselines import RoundRobinPolicy, ServeMultiplexPolicy
from lora_cluster.sim.bases import BaseFigures, BaseSplit, GroupedPolicy, base_name, node_shares
from lora_cluster.sim.census import RankBuckets, SlotCensus
from lora_cluster.sim.chats import ChatSettings, ChatWorkload
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.cluster_store import ClusterTierSettings, SimClusterTier
from lora_cluster.sim.context import Policy, ServeSections, SimContext, TrueDemand
from lora_cluster.sim.control_loop import ControlCost
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import Metrics, SimResult
from lora_cluster.sim.oracle import OraclePolicy
from lora_cluster.sim.oracle_pinned import OraclePinnedPolicy
from lora_cluster.sim.popularity import zipf_share, zipf_weights
from lora_cluster.sim.prefix_cache import SimPrefixCache
from lora_cluster.sim.profile import ReplicaProfile, load_profile
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import DEFAULT_MIX, SimRequest, Workload, mean_lengths

BLOCK_SIZE: int = EngineConfig.model_fields["kv_block_size"].default  # the engine's KV block (tokens)
POLICIES: dict[str, type] = {"lora-cluster": LoraClusterPolicy, "round-robin": RoundRobinPolicy,
                             "serve-multiplex": ServeMultiplexPolicy,
                             # yardsticks, not shipped policies (`sim.oracle`, `sim.oracle_pinned`)
                             "oracle": OraclePolicy, "oracle-pinned": OraclePinnedPolicy}


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 32
    adapters: int = 1000
    zipf: float = 1.0
    load: float = 1.0
    duration: float = 120.0
    seed: int = 0
    max_loras: int = 16
    policy: str = "lora-cluster"
    profile: str = "gpu"  # gpu (from papers: the GPU clusters users plan), cpu (measured here) or a path
    warmup: float = 30.0
    preload: int = 0  # the most popular adapters every node's store holds at start (see `NodeStore.preload`)
    mix: tuple[tuple[str, float], ...] = DEFAULT_MIX
    drain_limit_s: float = 600.0
    serve: ServeSections = field(default_factory=ServeSections)
    chats: ChatSettings | None = None  # multi-turn chats instead of Poisson arrivals (`sim.chats`)
    bases: int = 1  # replica groups, one base model each (`sim.bases`); 1: one base, as before
    base_nodes: tuple[int, ...] = ()  # each group's nodes (empty: equal shares of `nodes`)
    control_cost: str = "measured"  # the controller actor's loop: `ControlCost.named` (measured, none, path)
    cluster_tier: bool = True  # lora-cluster's cluster tier and prefetch (`sim.cluster_store`), where the
    # profile gives a node-to-node cost; the baselines load from S3 on every node, as their systems do
    cluster_tier_settings: ClusterTierSettings = field(default_factory=ClusterTierSettings)


def replica_rate(profile: ReplicaProfile, max_loras: int) -> float:
    """Rated requests per second of one replica (see the module docstring)."""
    prompt, output = mean_lengths()
    n = profile.max_num_seqs
    prefill = min(n * prompt / output, profile.max_num_batched_tokens - n)
    step = profile.step_s(round(prefill), n, min(n, max_loras))
    return n / (output * step)


class Simulation:
    """One run, built and driven step by step (`advance`), or all at once (`finish`)."""

    def __init__(self, config: SimConfig, profile: ReplicaProfile | None = None,
                 control_cost: ControlCost | None = None):
        """`profile` and `control_cost`, when given, override `config.profile` and `config.control_cost`."""
        self.started, self.started_cpu = time.perf_counter(), time.process_time()
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
        self.config = config
        self.profile = profile = profile or load_profile(config.profile)
        classes = SlaClasses()
        self.loop = loop = EventLoop()
        self.rated_rps = config.nodes * replica_rate(profile, config.max_loras)
        mix = [(classes.get(name), share) for name, share in config.mix]
        self.workload = Workload(adapters=config.adapters, zipf=config.zipf,
                                 rate=config.load * self.rated_rps, classes=mix,
                                 adapter_sizes=profile.adapter_sizes, seed=config.seed,
                                 measure_from=config.warmup)
        ranks = {name: k + 1 for k, name in enumerate(self.workload.names)}
        slots = config.nodes * config.max_loras
        buckets = RankBuckets(ranks.__getitem__, (max(1, slots // 32), max(2, slots // 4), slots))
        self.metrics = Metrics(classes, measure_from=config.warmup, clock=loop.clock, buckets=buckets)
        self.cluster: SimClusterTier | None = None
        if config.cluster_tier and config.policy == "lora-cluster" and profile.node_to_node is not None:
            self.cluster = SimClusterTier(profile, loop, self.workload.sizes, list(self.workload.names),
                                          [f"node-r{i:04d}" for i in range(config.nodes)],
                                          config.cluster_tier_settings, config.seed)
        self.replicas = {
            f"r{i:04d}": SimReplica(f"r{i:04d}", profile=profile, max_num_seqs=profile.max_num_seqs,
                                    max_loras=config.max_loras, loop=loop, sizes=self.workload.sizes,
                                    on_finish=self._finished, on_load=self.metrics.load,
                                    on_first_token=self._first_token, on_plan=self._planned,
                                    prefix_cache=self._prefix_cache(), cluster=self.cluster,
                                    on_miss=self._missed)
            for i in range(config.nodes)
        }
        self.split: BaseSplit | None = None
        if config.bases > 1 or len(config.base_nodes) > 1:
            if config.base_nodes and config.bases not in (1, len(config.base_nodes)):
                raise ValueError(f"{config.bases} bases but {len(config.base_nodes)} base node counts")
            sizes = node_shares(config.nodes, len(config.base_nodes) or config.bases, config.base_nodes)
            self.split = BaseSplit.build(list(self.replicas), self.workload.names, sizes)
        for rid, replica in self.replicas.items():
            replica.preload(self._preloaded(rid))
        weights = zipf_weights(config.adapters, config.zipf)  # the workload's own (`Workload`)
        total = sum(weights)
        shares = tuple((a, w / total) for a, w in zip(self.workload.names, weights, strict=True))
        demand = TrueDemand(shares=shares, rate_rps=self.workload.rate,
                            hold_s=profile.max_num_seqs / replica_rate(profile, config.max_loras))
        self.ctx = SimContext(loop=loop, replicas=self.replicas, metrics=self.metrics, classes=classes,
                              serve=config.serve, rng=random.Random(config.seed + 2), demand=demand,
                              control_cost=control_cost or ControlCost.named(config.control_cost))
        self.policy: Policy = (POLICIES[config.policy](self.ctx) if self.split is None
                               else GroupedPolicy(self.ctx, self.split, POLICIES[config.policy]))
        self.base_figures: BaseFigures | None = None
        # hears every replica's step once its admission is done (after the policy): an observer's hook,
        # e.g. `tests/sim/test_priority_order.py`, which checks who entered a running batch before whom
        self.on_plan: Callable[[SimReplica], None] | None = None
        # hears every request that reaches a replica without its adapter in a slot there (a miss):
        # an observer's hook, e.g. `census.MissCensus` in benchmarks/bench_miss_kinds.py
        self.on_miss: Callable[[SimReplica, SimRequest], None] | None = None
        self.end = config.warmup + config.duration
        self.arrivals = 0
        self.census = SlotCensus(self.replicas, buckets, loop=loop, start=config.warmup,
                                 end=self.end, period_s=max(1.0, config.duration / 120))
        self.policy.start()
        self.chats: ChatWorkload | None = None
        if config.chats is not None:
            self.chats = ChatWorkload(config.chats, self.workload, mix, zipf=config.zipf,
                                      seed=config.seed, block_size=BLOCK_SIZE, loop=loop, end=self.end,
                                      submit=self._submit)
            self.metrics.on_end = self.chats.ended
            self.chats.start()
        else:
            loop.at(self.workload.next_at, self._arrive)
        if self.split is not None:
            self.base_figures = BaseFigures(self.split, classes, then=self.metrics.on_end)
            self.metrics.on_end = self.base_figures.ended

    def _preloaded(self, replica_id: str) -> list[str]:
        """The adapters the node's store holds at start: the `preload` most popular of those its
        replica can serve (every adapter; with bases, its base's)."""
        names = self.workload.names
        if self.split is not None:
            base = self.split.replica_base[replica_id]
            names = [a for a in names if self.split.adapter_base[a] == base]
        return names[:self.config.preload]

    def _prefix_cache(self) -> SimPrefixCache:
        """A replica's prefix cache model (`enable_prefix_caching` is on by default): the engine's pool
        of `ReplicaProfile.kv_tokens` in blocks. Chats share their prefixes; a Poisson request shares
        none, but a preempted one finds its own computed blocks again on re-admission."""
        return SimPrefixCache(max(1, self.profile.kv_tokens // BLOCK_SIZE), BLOCK_SIZE)

    def _submit(self, req: SimRequest) -> None:
        """A chat's turn arrives."""
        self.arrivals += 1
        self.metrics.arrived()
        self.policy.arrive(req)

    def _finished(self, replica: SimReplica, req: SimRequest) -> None:
        self.policy.finished(replica, req)

    def _first_token(self, replica: SimReplica, req: SimRequest) -> None:
        self.policy.first_token(replica, req)

    def _planned(self, replica: SimReplica) -> None:
        self.policy.planned(replica)
        if self.on_plan is not None:
            self.on_plan(replica)

    def _missed(self, replica: SimReplica, req: SimRequest) -> None:
        if self.on_miss is not None:
            self.on_miss(replica, req)

    def _arrive(self) -> None:
        self.arrivals += 1
        self.metrics.arrived()
        self.policy.arrive(self.workload.pop())
        if self.workload.next_at < self.end:
            self.loop.at(self.workload.next_at, self._arrive)

    def advance(self, until: float) -> None:
        """Run the simulation up to simulated time `until`."""
        with self._controller_gc():
            self.loop.run(until=until)

    def _controller_gc(self) -> AbstractContextManager[None]:
        """The controller actor's collector threshold while the simulation runs: its calls are timed
        in this process (`cluster.process_gc`)."""
        return young_threshold(self.config.serve.controller.controller_gc_threshold)

    def finish(self) -> SimResult:
        """Run to the end of the arrivals, drain, and measure."""
        with self._controller_gc():
            self.loop.run(until=self.end)
            drained = self.end + self.config.drain_limit_s
            self.loop.run(until=drained, stop=lambda: self.metrics.outstanding == 0)
        unfinished = [*self.policy.pending()]
        for replica in self.replicas.values():
            unfinished.extend(replica.waiting)
            unfinished.extend(replica.running.values())
        c = self.config
        details = {
            "policy": c.policy, "profile": self.profile.name, "profile_measured": self.profile.measured,
            "rated_rps": self.rated_rps, "offered_rps": self.workload.rate, "arrivals": self.arrivals,
            "events": self.loop.events, "simulated_s": self.loop.now,
            "engine_preemptions": sum(r.preemptions for r in self.replicas.values()),
            "hit_rate_ceiling": zipf_share(c.adapters, c.zipf, c.nodes * c.max_loras),
            "slot_census": self.census.result(),
            **self.policy.details(),
        }
        if self.cluster is not None:
            details["cluster_tier"] = self.cluster.details()
        bases: dict[str, object] | None = None
        if self.split is not None and self.base_figures is not None:
            details["hit_rate_ceiling"] = self.split.cluster_ceiling(c.zipf, c.max_loras)
            details["replica_bases"] = {rid: base_name(b) for rid, b in self.split.replica_base.items()}
            bases = self.base_figures.result(unfinished, zipf=c.zipf, max_loras=c.max_loras)
            details["bases"] = bases
        if self.chats is not None:
            caches = [r.prefix_cache for r in self.replicas.values() if r.prefix_cache is not None]
            details["chats"] = {
                "chats_started": self.chats.chats_started, "turns_sent": self.chats.turns_sent,
                "prefix_cache_evictions": sum(c.evictions for c in caches),
                "prefix_cache_overcommitted": sum(c.overcommitted for c in caches),
                "prefix_cache_hit_tokens": sum(c.hit_tokens for c in caches),
                "prefix_cache_queried_tokens": sum(c.queried_tokens for c in caches),
                "completed_by_replica": dict(sorted(self.metrics.by_replica.items())),
            }
        details["sim_cpu_s_per_request"] = (time.process_time() - self.started_cpu) / max(1, self.arrivals)
        result = self.metrics.result(unfinished, round(time.perf_counter() - self.started, 3), details,
                                     slots=c.nodes * c.max_loras, max_num_seqs=self.profile.max_num_seqs,
                                     window_s=c.duration)
        if bases is not None:
            result.bases = bases
        if self.chats is not None and c.chats is not None:  # the one is built from the other
            s = c.serve.router
            result.chats = {**dataclasses.asdict(c.chats), "prefix_aware_routing": s.prefix_aware_routing,
                            "prefix_routing_share": s.prefix_routing_share,
                            **self.metrics.chat_figures(self.replicas)}
        return result


def run(config: SimConfig, profile: ReplicaProfile | None = None) -> SimResult:
    """Simulate `config` (`profile`, a loaded profile, overrides `config.profile`)."""
    return Simulation(config, profile).finish()

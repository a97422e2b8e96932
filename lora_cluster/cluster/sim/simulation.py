"""One simulation run: a cluster of simulated replicas, a workload, a routing policy.

A run lasts `warmup + duration` simulated seconds of arrivals, then drains (no new arrivals) until
every request has ended or `drain_limit_s` passed. Requests that arrive during the warm-up load the
cluster but are not measured. Each node runs one replica (one GPU, or one CPU engine for the
measured profile), with its own host and disk tiers.

Offered load: `load` times the cluster's *rated capacity*, the rate at which every replica keeps a
full batch of `max_num_seqs` requests with no adapter loads: a request holds its batch slot for
about `mean output` steps, and a full batch's step carries `max_num_seqs` decode tokens plus
`max_num_seqs * mean prompt / mean output` prefill tokens over `min(max_num_seqs, max_loras)`
adapters, so one replica serves `max_num_seqs / (mean output * step_s)` requests per second.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from lora_cluster.cluster.sim.baselines import RoundRobinPolicy, ServeMultiplexPolicy
from lora_cluster.cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.cluster.sim.context import Policy, ServeSettings, SimContext
from lora_cluster.cluster.sim.events import EventLoop
from lora_cluster.cluster.sim.metrics import Metrics, SimResult
from lora_cluster.cluster.sim.profile import ReplicaProfile, load_profile
from lora_cluster.cluster.sim.replica import SimReplica
from lora_cluster.cluster.sim.workload import DEFAULT_MIX, SimRequest, Workload, mean_lengths, zipf_share
from lora_cluster.cluster.sla import SlaClasses

POLICIES: dict[str, type] = {"lora-cluster": LoraClusterPolicy, "round-robin": RoundRobinPolicy,
                             "serve-multiplex": ServeMultiplexPolicy}


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
    profile: str = "cpu"
    warmup: float = 30.0
    mix: tuple[tuple[str, float], ...] = DEFAULT_MIX
    drain_limit_s: float = 600.0
    serve: ServeSettings = field(default_factory=ServeSettings)


def replica_rate(profile: ReplicaProfile, max_loras: int) -> float:
    """Rated requests per second of one replica (see the module docstring)."""
    prompt, output = mean_lengths()
    n = profile.max_num_seqs
    prefill = min(n * prompt / output, profile.max_num_batched_tokens - n)
    step = profile.step_s(round(prefill), n, min(n, max_loras))
    return n / (output * step)


def run(config: SimConfig, profile: ReplicaProfile | None = None) -> SimResult:
    """Simulate `config`; `profile` overrides `config.profile` (a loaded profile)."""
    started = time.perf_counter()
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
    profile = profile or load_profile(config.profile)
    classes = SlaClasses()
    loop = EventLoop()
    rated = config.nodes * replica_rate(profile, config.max_loras)
    rate = config.load * rated
    workload = Workload(adapters=config.adapters, zipf=config.zipf, rate=rate,
                        classes=[(classes.get(name), share) for name, share in config.mix],
                        adapter_sizes=profile.adapter_sizes, seed=config.seed, measure_from=config.warmup)
    metrics = Metrics(classes, measure_from=config.warmup, clock=loop.clock)
    policies: list[Policy] = []  # the one policy, made once the replicas exist

    def finished(replica: SimReplica, req: SimRequest) -> None:
        policies[0].finished(replica, req)

    replicas = {
        f"r{i:04d}": SimReplica(f"r{i:04d}", profile=profile, max_num_seqs=profile.max_num_seqs,
                                max_loras=config.max_loras, loop=loop, sizes=workload.sizes,
                                on_finish=finished, on_load=metrics.load)
        for i in range(config.nodes)
    }
    ctx = SimContext(loop=loop, replicas=replicas, metrics=metrics, classes=classes, serve=config.serve,
                     rng=random.Random(config.seed + 2))
    policy: Policy = POLICIES[config.policy](ctx)
    policies.append(policy)
    policy.start()
    end = config.warmup + config.duration
    arrivals = 0

    def arrive() -> None:
        nonlocal arrivals
        arrivals += 1
        metrics.arrived()
        policy.arrive(workload.pop())
        if workload.next_at < end:
            loop.at(workload.next_at, arrive)

    loop.at(workload.next_at, arrive)
    loop.run(until=end)
    loop.run(until=end + config.drain_limit_s, stop=lambda: metrics.outstanding == 0)
    unfinished = [*policy.pending()]
    for replica in replicas.values():
        unfinished.extend(replica.waiting)
        unfinished.extend(replica.running.values())
    details = {
        "policy": config.policy, "profile": profile.name, "profile_measured": profile.measured,
        "rated_rps": rated, "offered_rps": rate, "arrivals": arrivals, "events": loop.events,
        "simulated_s": loop.now, "engine_preemptions": sum(r.preemptions for r in replicas.values()),
        "hit_rate_ceiling": zipf_share(config.adapters, config.zipf, config.nodes * config.max_loras),
        **policy.details(),
    }
    return metrics.result(unfinished, round(time.perf_counter() - started, 3), details)

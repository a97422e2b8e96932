"""What every routing policy of the simulator is given: the clock, the replicas, the metrics, and the
serving settings, read from `ServeConfig`'s defaults so that the simulator runs what a user gets."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from lora_cluster.cluster.controller import ControllerSettings
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import serve_defaults
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import Metrics
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

_DEFAULTS = serve_defaults()


@dataclass(frozen=True)
class ServeSettings:
    """The serving knobs the policies read (defaults: those of `ServeConfig`)."""

    max_ongoing_requests: int = _DEFAULTS.max_ongoing_requests
    max_queued_requests: int = _DEFAULTS.max_queued_requests
    routing_stats_period_s: float = _DEFAULTS.routing_stats_period_s
    router_miss_cost: float = _DEFAULTS.router_miss_cost
    router_placement_ttl_s: float = _DEFAULTS.router_placement_ttl_s
    prefix_aware_routing: bool = _DEFAULTS.prefix_aware_routing
    prefix_routing_share: float = _DEFAULTS.prefix_routing_share
    admission_capacity: int | None = _DEFAULTS.admission_capacity
    admission_window_max: int | None = _DEFAULTS.admission_window_max
    cluster_queue_size: int = _DEFAULTS.cluster_queue_size
    cluster_queue_aging_s: float = _DEFAULTS.cluster_queue_aging_s
    cluster_queue_timeout_s: float = _DEFAULTS.cluster_queue_timeout_s
    cluster_queue_max_wait_s: float = _DEFAULTS.cluster_queue_max_wait_s
    cold_shed_window_s: float = _DEFAULTS.cold_shed_window_s
    cold_shed_pressure: float = _DEFAULTS.cold_shed_pressure
    preempt_after_fraction: float = _DEFAULTS.preempt_after_fraction
    top_class_preempt_after_fraction: float | None = _DEFAULTS.top_class_preempt_after_fraction
    controller_report_period_s: float = _DEFAULTS.controller_report_period_s
    controller_report_coalesce_s: float = _DEFAULTS.controller_report_coalesce_s
    controller_batch_window_s: float = _DEFAULTS.controller_batch_window_s
    placement_hot_share: float = _DEFAULTS.placement_hot_share
    controller_shards: int = _DEFAULTS.controller_shards

    def controller_settings(self) -> ControllerSettings:
        """As `serve.controller_actor` maps a ServeConfig."""
        return ControllerSettings.from_config(self)


@dataclass
class SimContext:
    loop: EventLoop
    replicas: dict[str, SimReplica]
    metrics: Metrics
    classes: SlaClasses
    serve: ServeSettings
    rng: random.Random  # the policies' own randomness (power of two choices), seeded


class Policy(Protocol):
    """How requests get to replicas. `arrive` takes each new request; `first_token` and `finished`
    hear of each request's first token and end, `planned` of each step a replica plans (its admission
    done); `pending` lists the requests the policy holds."""

    name: str

    def start(self) -> None: ...

    def arrive(self, req: SimRequest) -> None: ...

    def first_token(self, replica: SimReplica, req: SimRequest) -> None: ...

    def finished(self, replica: SimReplica, req: SimRequest) -> None: ...

    def planned(self, replica: SimReplica) -> None: ...

    def pending(self) -> list[SimRequest]: ...

    def details(self) -> dict[str, object]: ...

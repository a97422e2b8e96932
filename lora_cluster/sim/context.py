"""What every routing policy of the simulator is given: the clock, the replicas, the metrics, and the
serving settings, read from `ServeConfig`'s defaults so that the simulator runs what a user gets."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from lora_cluster.cluster.controller import ControllerSettings
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import Metrics
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import ServeConfig


def _default(name: str) -> object:
    return ServeConfig.model_fields[name].default


@dataclass(frozen=True)
class ServeSettings:
    """The serving knobs the policies read (defaults: those of `ServeConfig`)."""

    max_ongoing_requests: int = _default("max_ongoing_requests")  # type: ignore[assignment]
    max_queued_requests: int = _default("max_queued_requests")  # type: ignore[assignment]
    routing_stats_period_s: float = _default("routing_stats_period_s")  # type: ignore[assignment]
    router_miss_cost: float = _default("router_miss_cost")  # type: ignore[assignment]
    router_placement_ttl_s: float = _default("router_placement_ttl_s")  # type: ignore[assignment]
    admission_capacity: int | None = _default("admission_capacity")  # type: ignore[assignment]
    cluster_queue_size: int = _default("cluster_queue_size")  # type: ignore[assignment]
    cluster_queue_aging_s: float = _default("cluster_queue_aging_s")  # type: ignore[assignment]
    cluster_queue_timeout_s: float = _default("cluster_queue_timeout_s")  # type: ignore[assignment]
    cluster_queue_max_wait_s: float = _default("cluster_queue_max_wait_s")  # type: ignore[assignment]
    cold_shed_window_s: float = _default("cold_shed_window_s")  # type: ignore[assignment]
    preempt_after_fraction: float = _default("preempt_after_fraction")  # type: ignore[assignment]
    top_class_preempt_after_fraction: float | None = _default(  # type: ignore[assignment]
        "top_class_preempt_after_fraction")
    controller_report_period_s: float = _default("controller_report_period_s")  # type: ignore[assignment]
    placement_hot_share: float = _default("placement_hot_share")  # type: ignore[assignment]

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
    hear of each request's first token and end; `pending` lists the requests the policy holds."""

    name: str

    def start(self) -> None: ...

    def arrive(self, req: SimRequest) -> None: ...

    def first_token(self, replica: SimReplica, req: SimRequest) -> None: ...

    def finished(self, replica: SimReplica, req: SimRequest) -> None: ...

    def pending(self) -> list[SimRequest]: ...

    def details(self) -> dict[str, object]: ...

"""What every routing policy of the simulator is given: the clock, the replicas, the metrics, and the
control plane's config sections whole (`ServeSections`: the router's, admission's and the cluster
controller's, at their defaults unless given), so that the simulator runs what a user gets."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from lora_cluster.cluster.controller import ControllerSettings
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import AdmissionConfig, ControllerConfig, RouterConfig
from lora_cluster.config.serve import FLAT
from lora_cluster.sim.control_loop import ControlCost
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import Metrics
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest


@dataclass(frozen=True)
class ServeSections:
    """The config sections the simulated control plane runs, whole: the router's, admission's and the
    cluster controller's (`ServeConfig.router`, `.admission`, `.controller`), at their defaults unless
    given, exactly what `serve.app` hands the live owners."""

    router: RouterConfig = field(default_factory=RouterConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def with_fields(self, **flat: object) -> ServeSections:
        """These sections with fields set by their flat names (`prefix_aware_routing=False`,
        `controller_shards=2`; see config.flat_aliases); raises ValueError naming an unknown one."""
        nested = FLAT.nest(flat)
        unknown = sorted(set(nested) - {"router", "admission", "controller"})
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}: not a router, admission or controller field")
        sections = {name: getattr(self, name) for name in ("router", "admission", "controller")}
        return ServeSections(**{name: type(s).model_validate({**s.model_dump(), **nested.get(name, {})})
                                for name, s in sections.items()})

    def controller_settings(self) -> ControllerSettings:
        """As `serve.controller_actor` maps its config's controller section."""
        return ControllerSettings.from_config(self.controller)

    def to_json(self) -> dict[str, dict[str, object]]:
        return {"router": self.router.model_dump(), "admission": self.admission.model_dump(),
                "controller": self.controller.model_dump()}


@dataclass(frozen=True)
class TrueDemand:
    """The offered demand as the workload draws it, known in advance: for a reference policy with
    perfect knowledge (`sim.oracle`); the policies that route without foresight never read it.
    `shares` lists each adapter's share of all offered requests, most popular first; `rate_rps` is
    the offered request rate and `hold_s` a request's expected slot hold (at a full batch)."""

    shares: tuple[tuple[str, float], ...] = ()
    rate_rps: float = 0.0
    hold_s: float = 0.0

    def in_flight(self) -> list[tuple[str, float]]:
        """Each adapter's expected requests in flight, `rate * share * hold` (Little's law), most
        popular first."""
        return [(a, self.rate_rps * share * self.hold_s) for a, share in self.shares]

    def only(self, adapters: Collection[str]) -> TrueDemand:
        """The demand of `adapters` alone (a replica group's), their shares still of all requests."""
        keep = set(adapters)
        return dataclasses.replace(self, shares=tuple((a, s) for a, s in self.shares if a in keep))


@dataclass
class SimContext:
    loop: EventLoop
    replicas: dict[str, SimReplica]
    metrics: Metrics
    classes: SlaClasses
    serve: ServeSections
    rng: random.Random  # the policies' own randomness (power of two choices), seeded
    demand: TrueDemand = field(default_factory=TrueDemand)  # for reference policies only (`TrueDemand`)
    control_cost: ControlCost | None = None  # the controller actor's loop (`sim.control_loop`); None: none


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

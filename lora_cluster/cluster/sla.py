"""SLA classes: how urgent a request is and which latency it is promised.

A class has a name, a priority (lower is more urgent, vLLM's convention; the engine orders and
preempts by it), a time-to-first-token target and a time-per-output-token target (None: no
target, e.g. batch work). A request picks its class by name (header `x-lora-priority: <class>`),
or by vLLM's integer `priority` field (the class with that priority, else the most urgent class
that is not more urgent than the number asked for, else the least urgent class), or gets the
default class. The classes are configured in `ServeConfig.sla_classes` (lora_cluster.config, which
also holds the defaults); this module is the policy over them. Pure: no Ray, no HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from lora_cluster.config import DEFAULT_CLASS, MAX_CLASSES, ServeConfig, SlaClassConfig, serve_defaults
from lora_cluster.errors import ConfigError, RequestError


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class SlaClass:
    name: str
    priority: int  # lower is more urgent
    ttft_s: float | None = None  # time-to-first-token target (None: none)
    tpot_s: float | None = None  # time-per-output-token target (None: none)

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a finished request with these latencies met this class's targets."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return not (self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s)

    def preempt_after_s(self, patience: float) -> float:
        """How long a request of this class waits in the engine for a slot before it may preempt less
        urgent running work: `patience` (`EngineConfig.preempt_patience`) times its TTFT target; at
        once (0.0) for a class without one."""
        return patience * self.ttft_s if self.ttft_s is not None else 0.0

    @classmethod
    def from_config(cls, config: SlaClassConfig) -> SlaClass:
        return cls(config.name, config.priority, ttft_s=config.ttft_s, tpot_s=config.tpot_s)


DEFAULT_SLA_CLASSES = tuple(SlaClass.from_config(c) for c in serve_defaults().sla_classes)


class SlaClasses:
    """The configured classes, looked up by name or by vLLM's integer priority."""

    def __init__(self, classes: Iterable[SlaClass] = DEFAULT_SLA_CLASSES, default: str = DEFAULT_CLASS):
        self.classes = tuple(sorted(classes, key=lambda c: (c.priority, c.name)))
        if not self.classes or len(self.classes) > MAX_CLASSES:
            raise ConfigError(f"between 1 and {MAX_CLASSES} SLA classes are needed, got {len(self.classes)}")
        self.by_name = {c.name: c for c in self.classes}
        if len(self.by_name) != len(self.classes):
            raise ConfigError("SLA class names must be unique")
        if default not in self.by_name:
            raise ConfigError(f"the default SLA class {default!r} is not one of {', '.join(self.by_name)}")
        self.default = self.by_name[default]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def get(self, name: str) -> SlaClass:
        """The class called `name`; RequestError naming the known classes otherwise."""
        found = self.by_name.get(name)
        if found is None:
            raise RequestError(f"unknown priority class {name[:64]!r}; known: {', '.join(self.by_name)}")
        return found

    def for_priority(self, priority: int) -> SlaClass:
        """The class of vLLM's integer priority (see the module docstring)."""
        for c in self.classes:
            if c.priority >= priority:
                return c
        return self.classes[-1]

    def resolve(self, name: str | None = None, priority: int | None = None) -> SlaClass:
        """A request's class: by name, else by integer priority, else the default."""
        if name is not None:
            return self.get(name)
        if priority is not None:
            return self.for_priority(priority)
        return self.default


def build_sla_classes(config: ServeConfig) -> SlaClasses:
    """The `SlaClasses` of a ServeConfig: its `sla_classes`, defaulting to `default_priority_class`."""
    return SlaClasses((SlaClass.from_config(c) for c in config.sla_classes),
                      default=config.default_priority_class)

"""Capacity at SLO: the largest offered load at which every class still meets its target. Pure.

A run meets the targets (`SloTargets`) when

* `interactive` attains its SLO (TTFT and TPOT targets, `SlaClass.met`) for at least 99% of its
  offered requests, and `standard` for at least 95% (a refused or unfinished request is a miss);
* `batch` (no latency target) completes at least 99% of its offered requests, and the p99 of their
  wait (arrival to first token) is at most 60 s.

`find_capacity` searches for the largest load at which a run meets them, by bisection: it probes
`start` (1x, the rated load), doubles while runs pass (up to `ceiling`), then halves the bracket
between the last load that passed and the first that failed until it is no wider than `resolution`
(0.05x). The answer is the largest passing load probed (0.0 when none did). It assumes that
meeting the targets is monotone in the load (more load never helps); the result keeps every probe,
so that a run above the answer that would have met them can be looked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

RESOLUTION = 0.05  # the bracket the search narrows to (x rated load)
START = 1.0
CEILING = 8.0


@dataclass(frozen=True)
class SloTargets:
    """What a run must meet to count as within SLO (see the module docstring)."""

    attainment: tuple[tuple[str, float], ...] = (("interactive", 0.99), ("standard", 0.95))
    completion_class: str = "batch"
    completion: float = 0.99
    wait_p99_s: float = 60.0

    def misses(self, classes: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """The targets that a run's per-class figures (the `--json` object's `classes`) miss, as
        readable phrases; empty when every target holds. A class with no offered request misses
        nothing."""
        out = []
        for name, target in self.attainment:
            got = classes[name]["slo_attainment"]
            if classes[name]["offered"] and (got is None or got < target):
                out.append(f"{name} {100 * (got or 0.0):.1f}% < {100 * target:g}%")
        batch = classes[self.completion_class]
        if batch["offered"]:
            done = batch["completed"] / batch["offered"]
            if done < self.completion:
                out.append(f"{self.completion_class} completed {100 * done:.1f}% "
                           f"< {100 * self.completion:g}%")
            wait = batch["ttft_p99_s"]
            if wait is None or wait > self.wait_p99_s:
                shown = "-" if wait is None else f"{wait:.1f}"
                out.append(f"{self.completion_class} p99 wait {shown} s > {self.wait_p99_s:g} s")
        return out

    def describe(self) -> str:
        parts = [f"{name} >= {100 * t:g}%" for name, t in self.attainment]
        parts.append(f"{self.completion_class} >= {100 * self.completion:g}% completed with p99 wait <= "
                     f"{self.wait_p99_s:g} s")
        return ", ".join(parts)


@dataclass(frozen=True)
class Probe:
    load: float
    misses: tuple[str, ...]  # the targets missed (empty: met)
    figures: dict[str, Any] = field(default_factory=dict)  # what the caller keeps of the run

    @property
    def met(self) -> bool:
        return not self.misses


@dataclass(frozen=True)
class Capacity:
    load: float  # the largest load probed that met the targets (0.0: none did)
    probes: tuple[Probe, ...]  # in the order run
    capped: bool  # the ceiling itself met the targets: the capacity is at least `load`


def find_capacity(probe: Callable[[float], Probe], *, start: float = START, resolution: float = RESOLUTION,
                  ceiling: float = CEILING) -> Capacity:
    """The largest load at which `probe(load)` meets the targets, to `resolution` (see the module
    docstring). Raises ValueError for a start, resolution or ceiling that is not positive."""
    if start <= 0 or resolution <= 0 or ceiling < start:
        raise ValueError(f"start={start} and resolution={resolution} must be > 0 "
                         f"and ceiling={ceiling} >= start")
    probes: list[Probe] = []

    def check(load: float) -> bool:
        p = probe(round(load, 6))
        probes.append(p)
        return p.met

    low, high = 0.0, None
    load = start
    while high is None:
        if check(load):
            low = load
            if load >= ceiling:
                return Capacity(low, tuple(probes), capped=True)
            load = min(2 * load, ceiling)
        else:
            high = load
    while high - low > resolution:
        mid = (low + high) / 2
        if check(mid):
            low = mid
        else:
            high = mid
    return Capacity(round(low, 6), tuple(probes), capped=False)

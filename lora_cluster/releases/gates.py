"""The gates of a canary step: what a candidate version must hold for its step to advance, and the
evidence each judgement records.

A step's outcomes are counted per version (`StepStats`, three counters: bounded whatever the
traffic): requests, errors, and requests that missed their SLA class's TTFT or TPOT target. The
judgement (`judge`) is one of three:
* `fail`: the candidate has at least `gate_min_requests` requests and its error rate exceeds the
  stable version's by more than `error_rate_margin`, or its share of requests on target is below
  `latency_attainment`: the release rolls back;
* `pass`: the step has lasted `step_dwell_s` and the candidate served `step_min_requests`, and no
  gate fails: the step may advance;
* `hold`: neither yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lora_cluster.config.releases import ReleasesConfig

Outcome = Literal["pass", "hold", "fail"]


@dataclass(frozen=True)
class ReleaseSettings:
    """The release policy's knobs (the `releases:` config section, `ReleasesConfig`)."""

    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    step_min_requests: int = 20
    step_dwell_s: float = 30.0
    error_rate_margin: float = 0.02
    gate_min_requests: int = 10
    latency_attainment: float = 0.9
    eval_margin: float = 0.05
    max_events: int = 1000

    @classmethod
    def from_config(cls, config: ReleasesConfig) -> ReleaseSettings:
        return cls(tuple(config.release_canary_steps), config.release_step_min_requests,
                   config.release_step_dwell_s, config.release_error_rate_margin,
                   config.release_gate_min_requests, config.release_latency_attainment,
                   config.release_eval_margin, config.release_max_events)


@dataclass
class StepStats:
    """One version's outcomes in the current step."""

    requests: int = 0
    errors: int = 0
    missed_target: int = 0  # answered, but later than the class's TTFT or TPOT target

    def record(self, ok: bool, on_target: bool = True) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        elif not on_target:
            self.missed_target += 1

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def attainment(self) -> float:
        """The share of requests answered without error and on target (1.0 with no request)."""
        return (self.requests - self.errors - self.missed_target) / self.requests if self.requests else 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepStats:
        return cls(int(d["requests"]), int(d["errors"]), int(d["missed_target"]))


@dataclass(frozen=True)
class Verdict:
    """A judgement of one step and its evidence (what the audit log records)."""

    outcome: Outcome
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def judge(settings: ReleaseSettings, candidate: StepStats, stable: StepStats, step_age_s: float) -> Verdict:
    """The step's verdict (module docstring)."""
    evidence = {"candidate": candidate.to_dict(), "stable": stable.to_dict(),
                "candidate_error_rate": round(candidate.error_rate, 4),
                "stable_error_rate": round(stable.error_rate, 4),
                "candidate_attainment": round(candidate.attainment, 4), "step_age_s": round(step_age_s, 3)}
    if candidate.requests >= settings.gate_min_requests:
        excess = candidate.error_rate - stable.error_rate
        if excess > settings.error_rate_margin:
            return Verdict("fail", f"error rate {candidate.error_rate:.3f} exceeds the stable version's "
                           f"{stable.error_rate:.3f} by more than {settings.error_rate_margin}", evidence)
        answered = candidate.requests - candidate.errors
        on_target = (answered - candidate.missed_target) / answered if answered else 1.0
        if on_target < settings.latency_attainment:
            return Verdict("fail", f"{on_target:.3f} of requests met their TTFT/TPOT targets, below "
                           f"{settings.latency_attainment}", evidence)
    if candidate.requests >= settings.step_min_requests and step_age_s >= settings.step_dwell_s:
        return Verdict("pass", "every gate holds", evidence)
    return Verdict("hold", f"{candidate.requests}/{settings.step_min_requests} requests, "
                   f"{step_age_s:.0f}/{settings.step_dwell_s:.0f} s", evidence)

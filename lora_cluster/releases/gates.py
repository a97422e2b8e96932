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

Shadow (`ShadowStats`): copies of the stable version's greedy requests run on the candidate, never
answered to a client. Their token agreement (positions where the candidate's tokens equal the stable
version's answer, over the longer of the two) is a gate of its own: with at least
`gate_min_requests` copies compared, an agreement below `shadow_min_agreement` fails the step. The
copies' time to first token beside the live answers' is evidence only (they run at the least urgent
class, so their latency says little of the candidate's). A copy of a request constrained by a JSON
schema (or to a JSON object) counts whether each answer is valid under it (`ShadowCheck`): with
`gate_min_requests` such copies, a candidate whose schema-valid rate is below the stable version's
by more than `eval_margin` fails the step. Where both answers carry their tokens' logprobs, the mean
absolute difference of those logprobs over the prefix both versions generated alike
(`logprob_divergence`) is evidence only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
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
    shadow_percent: float = 0.0
    shadow_min_agreement: float = 0.5

    @classmethod
    def from_config(cls, config: ReleasesConfig) -> ReleaseSettings:
        return cls(tuple(config.release_canary_steps), config.release_step_min_requests,
                   config.release_step_dwell_s, config.release_error_rate_margin,
                   config.release_gate_min_requests, config.release_latency_attainment,
                   config.release_eval_margin, config.release_max_events, config.release_shadow_percent,
                   config.release_shadow_min_agreement)


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

    def add(self, other: StepStats) -> None:
        """Add another count of the same step (another ingress's evidence)."""
        self.requests += other.requests
        self.errors += other.errors
        self.missed_target += other.missed_target

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepStats:
        return cls(int(d["requests"]), int(d["errors"]), int(d["missed_target"]))


@dataclass(frozen=True)
class ShadowCheck:
    """What one copy tells beyond tokens and TTFT: whether each answer is valid under the request's
    JSON constraint (None: it had none), and the absolute differences of the two versions' logprobs
    over the prefix both generated alike (empty: not both answers carry logprobs)."""

    stable_valid: bool | None = None
    candidate_valid: bool | None = None
    logprob_gaps: tuple[float, ...] = ()


@dataclass
class ShadowStats:
    """The shadow copies compared in the current step (sums: bounded whatever the traffic)."""

    requests: int = 0
    agreed_tokens: int = 0
    compared_tokens: int = 0  # the longer answer's length, summed
    candidate_ttft_s: float = 0.0
    stable_ttft_s: float = 0.0
    schema_checked: int = 0  # copies of requests with a JSON constraint
    stable_schema_valid: int = 0
    candidate_schema_valid: int = 0
    logprob_tokens: int = 0  # tokens whose logprobs both versions gave (the alike prefix)
    logprob_gap_sum: float = 0.0  # their absolute differences, summed

    def record(self, stable_tokens: list[int], candidate_tokens: list[int], stable_ttft_s: float,
               candidate_ttft_s: float, check: ShadowCheck | None = None) -> None:
        """One copy: the live (stable) answer's tokens and the candidate's, their TTFTs, and what
        else it tells (`ShadowCheck`)."""
        self.requests += 1
        self.agreed_tokens += sum(a == b for a, b in zip(stable_tokens, candidate_tokens, strict=False))
        self.compared_tokens += max(len(stable_tokens), len(candidate_tokens))
        self.stable_ttft_s += stable_ttft_s
        self.candidate_ttft_s += candidate_ttft_s
        check = check or ShadowCheck()
        if check.stable_valid is not None and check.candidate_valid is not None:
            self.schema_checked += 1
            self.stable_schema_valid += check.stable_valid
            self.candidate_schema_valid += check.candidate_valid
        self.logprob_tokens += len(check.logprob_gaps)
        self.logprob_gap_sum += sum(check.logprob_gaps)

    def add(self, other: ShadowStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def agreement(self) -> float:
        """Agreed tokens over compared ones (1.0 with nothing compared)."""
        return self.agreed_tokens / self.compared_tokens if self.compared_tokens else 1.0

    def schema_valid_rate(self, version: Literal["stable", "candidate"]) -> float:
        """A version's answers valid under their JSON constraint over those checked (1.0: none)."""
        valid = self.stable_schema_valid if version == "stable" else self.candidate_schema_valid
        return valid / self.schema_checked if self.schema_checked else 1.0

    @property
    def logprob_divergence(self) -> float | None:
        """The mean absolute logprob difference over the tokens both gave (None: no such token)."""
        return self.logprob_gap_sum / self.logprob_tokens if self.logprob_tokens else None

    def to_dict(self) -> dict[str, Any]:
        divergence = self.logprob_divergence
        return {**asdict(self), "agreement": round(self.agreement, 4),
                "stable_schema_valid_rate": round(self.schema_valid_rate("stable"), 4),
                "candidate_schema_valid_rate": round(self.schema_valid_rate("candidate"), 4),
                "logprob_divergence": None if divergence is None else round(divergence, 6)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ShadowStats:
        d = d or {}
        return cls(**{f.name: type(f.default)(d.get(f.name, f.default)) for f in fields(cls)})


@dataclass(frozen=True)
class Verdict:
    """A judgement of one step and its evidence (what the audit log records)."""

    outcome: Outcome
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def judge(settings: ReleaseSettings, candidate: StepStats, stable: StepStats, step_age_s: float,
          shadow: ShadowStats | None = None) -> Verdict:
    """The step's verdict (module docstring)."""
    shadow = shadow or ShadowStats()
    evidence = {"candidate": candidate.to_dict(), "stable": stable.to_dict(),
                "candidate_error_rate": round(candidate.error_rate, 4),
                "stable_error_rate": round(stable.error_rate, 4),
                "candidate_attainment": round(candidate.attainment, 4), "step_age_s": round(step_age_s, 3),
                "shadow": shadow.to_dict()}
    if shadow.requests >= settings.gate_min_requests and shadow.agreement < settings.shadow_min_agreement:
        return Verdict("fail", f"shadow token agreement {shadow.agreement:.3f} is below "
                       f"{settings.shadow_min_agreement} over {shadow.requests} copies", evidence)
    stable_valid, candidate_valid = shadow.schema_valid_rate("stable"), shadow.schema_valid_rate("candidate")
    if shadow.schema_checked >= settings.gate_min_requests and \
            stable_valid - candidate_valid > settings.eval_margin:
        return Verdict("fail", f"shadow schema-valid rate {candidate_valid:.3f} is below the stable "
                       f"version's {stable_valid:.3f} by more than {settings.eval_margin} over "
                       f"{shadow.schema_checked} copies with a JSON constraint", evidence)
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

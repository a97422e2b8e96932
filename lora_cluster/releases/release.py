"""One release of an adapter name: a candidate version staged against the stable one, as a state
machine with every decision in an audit log.

States (`ReleaseState`) and the only allowed transitions (`TRANSITIONS`):

    evaluating --eval passes--> canary --last step passes--> promoted
    evaluating --eval fails---> rolled_back
    canary <--pause / resume--> paused
    canary, paused --gate fails or manual rollback--> rolled_back
    evaluating, canary, paused --manual promote--> promoted

While evaluating, the candidate gets no traffic. In `canary` the candidate answers `steps[step]`%
of the bare name's traffic (sticky per user, `releases.split`); a step advances when its verdict is
`pass` (`releases.gates`), and its counters start again. `paused` keeps the current share and never
advances, but a failing gate still rolls back (a pause hands the pace to an operator, not the
safety). `promoted`: the candidate is the stable version; `rolled_back`: the stable version keeps
every request. Both are final.

While evaluating, the release also holds what its eval gate needs to run again (`gate`: the
candidate's location and the evaluation set given, if any) and the lease of the ingress that runs
it (`lease`, `releases.lease`); both are dropped when it leaves `evaluating`. A takeover of an
expired lease is a `gate_taken_over` event.

The audit log keeps the last `max_events` events, each with its evidence (`events`). The clock is
injected and is a wall clock: a release outlives its process (`to_dict`/`from_dict`), and its step's
dwell is measured across a restart.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from lora_cluster.errors import ReleaseConflictError
from lora_cluster.releases.gates import ReleaseSettings, ShadowCheck, ShadowStats, StepStats, judge
from lora_cluster.releases.lease import Lease
from lora_cluster.releases.split import Alias


class ReleaseState(enum.Enum):
    EVALUATING = "evaluating"
    CANARY = "canary"
    PAUSED = "paused"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


S = ReleaseState
TRANSITIONS: dict[ReleaseState, frozenset[ReleaseState]] = {
    S.EVALUATING: frozenset({S.CANARY, S.ROLLED_BACK, S.PROMOTED}),
    S.CANARY: frozenset({S.PAUSED, S.ROLLED_BACK, S.PROMOTED}),
    S.PAUSED: frozenset({S.CANARY, S.ROLLED_BACK, S.PROMOTED}),
    S.PROMOTED: frozenset(),
    S.ROLLED_BACK: frozenset(),
}
FINAL = frozenset({S.PROMOTED, S.ROLLED_BACK})


@dataclass(frozen=True)
class ReleaseEvent:
    """One decision of a release: what happened, at which step and at which candidate share (the
    share in force when it was decided), why, with its evidence."""

    seq: int
    at: float
    kind: str  # created, gate_taken_over, eval_passed, eval_failed, step_advanced, promoted, paused,
    # resumed, rolled_back
    state: str
    step: int
    percent: float
    reason: str
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Release:
    """One release (module docstring). `record` counts an answered request of either version;
    `tick` judges the current step; the other commands are the admin API's."""

    def __init__(self, release_id: str, name: str, stable: int, candidate: int, settings: ReleaseSettings,
                 clock: Callable[[], float], tenant: str | None = None):
        self.id, self.name, self.stable, self.candidate = release_id, name, stable, candidate
        self.settings, self._clock, self.tenant = settings, clock, tenant
        self.state = S.EVALUATING
        self.step = 0
        self.step_started_at = self.created_at = clock()
        self.stats = {"candidate": StepStats(), "stable": StepStats()}
        self.shadow = ShadowStats()  # the current step's shadow copies (releases.gates)
        self.candidate_answered = 0  # every request the candidate answered, all steps together
        self.gate: dict[str, Any] | None = None  # {"lora_path", "eval_set"} while evaluating
        self.lease: Lease | None = None  # the ingress running the eval gate (releases.lease)
        self._events: deque[ReleaseEvent] = deque(maxlen=settings.max_events)
        self._seq = 0
        self._log("created", f"candidate {name}@{candidate} against stable {name}@{stable}", {})

    @property
    def percent(self) -> float:
        """The candidate's share of the bare name's traffic now (0 unless canary or paused)."""
        return self.settings.steps[self.step] if self.state in (S.CANARY, S.PAUSED) else 0.0

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def alias(self) -> Alias:
        """What the bare name resolves to now."""
        if self.state is S.PROMOTED:
            return Alias(self.candidate)
        return Alias(self.stable, self.candidate, self.percent, self.id)

    def events(self) -> list[ReleaseEvent]:
        return list(self._events)

    # --- the eval gate's outcome ---

    def eval_passed(self, evidence: dict[str, Any]) -> None:
        self._move(S.CANARY, "eval_passed", "the candidate is within the eval margin", evidence)
        self._start_step(0)

    def eval_failed(self, reason: str, evidence: dict[str, Any]) -> None:
        self._move(S.ROLLED_BACK, "eval_failed", reason, evidence)

    def stage(self, gate: dict[str, Any], lease: Lease | None) -> None:
        """What the eval gate needs to run again, and the lease of the ingress that runs it first."""
        self.gate, self.lease = gate, lease

    def take_over(self, owner: str, expires_at: float) -> None:
        """Ingress `owner` takes the expired lease of the eval gate (it runs the gate again)."""
        previous = self.lease
        self.lease = Lease(owner, expires_at)
        self._log("gate_taken_over", "the eval gate's lease expired; another ingress runs the gate again",
                  {"previous_owner": None if previous is None else previous.owner,
                   "expired_at": None if previous is None else previous.expires_at, "owner": owner})

    # --- live traffic ---

    def record(self, version: int, ok: bool, on_target: bool = True) -> None:
        """Count one answered request of `version` in the current step (ignored when final, or
        before the canary: those requests are no evidence about this step)."""
        if self.state not in (S.CANARY, S.PAUSED) or version not in (self.stable, self.candidate):
            return
        self.stats["candidate" if version == self.candidate else "stable"].record(ok, on_target)
        if version == self.candidate:
            self.candidate_answered += 1

    def record_shadow(self, stable_tokens: list[int], candidate_tokens: list[int], stable_ttft_s: float,
                      candidate_ttft_s: float, check: ShadowCheck | None = None) -> None:
        """Count one shadow copy compared in the current step (ignored unless canary or paused)."""
        if self.state in (S.CANARY, S.PAUSED):
            self.shadow.record(stable_tokens, candidate_tokens, stable_ttft_s, candidate_ttft_s, check)

    def absorb(self, stats: dict[str, StepStats], candidate_answered: int,
               shadow: ShadowStats | None = None) -> None:
        """Add evidence counted elsewhere for the current step (an ingress's, not yet in the shared
        state; `releases.book.adopt`)."""
        for key, counted in stats.items():
            self.stats[key].add(counted)
        self.candidate_answered += candidate_answered
        if shadow is not None:
            self.shadow.add(shadow)

    def tick(self) -> None:
        """Judge the current step: roll back on a failing gate, advance (or promote after the last
        step) on a pass, else hold."""
        if self.state not in (S.CANARY, S.PAUSED):
            return
        verdict = judge(self.settings, self.stats["candidate"], self.stats["stable"],
                        self._clock() - self.step_started_at, self.shadow)
        if verdict.outcome == "fail":
            self._move(S.ROLLED_BACK, "rolled_back", f"automatic: {verdict.reason}", verdict.evidence)
        elif verdict.outcome == "pass" and self.state is S.CANARY:
            if self.step + 1 < len(self.settings.steps):
                self._start_step(self.step + 1)
                self._log("step_advanced", verdict.reason, verdict.evidence)
            else:
                self._move(S.PROMOTED, "promoted", f"automatic after the last step: {verdict.reason}",
                           verdict.evidence)

    # --- the admin API's commands ---

    def promote(self, reason: str = "manual") -> None:
        self._move(S.PROMOTED, "promoted", reason, self._evidence())

    def rollback(self, reason: str = "manual") -> None:
        self._move(S.ROLLED_BACK, "rolled_back", reason, self._evidence())

    def pause(self, reason: str = "manual") -> None:
        self._move(S.PAUSED, "paused", reason, self._evidence())

    def resume(self, reason: str = "manual") -> None:
        if self.state is not S.PAUSED:
            raise ReleaseConflictError(self.name, self.id,
                                       f"only a paused release resumes; it is {self.state.value}")
        self._move(S.CANARY, "resumed", reason, self._evidence())

    def _evidence(self) -> dict[str, Any]:
        return {**{k: s.to_dict() for k, s in self.stats.items()}, "shadow": self.shadow.to_dict()}

    def _start_step(self, step: int) -> None:
        self.step, self.step_started_at = step, self._clock()
        self.stats = {"candidate": StepStats(), "stable": StepStats()}
        self.shadow = ShadowStats()

    def _move(self, to: ReleaseState, kind: str, reason: str, evidence: dict[str, Any]) -> None:
        if to not in TRANSITIONS[self.state]:
            raise ReleaseConflictError(self.name, self.id, f"cannot go from {self.state.value} to {to.value}")
        percent = self.percent  # the share the decision was taken at
        self.state = to
        if to is not S.EVALUATING:
            self.gate = self.lease = None
        self._log(kind, reason, evidence, percent)

    def _log(self, kind: str, reason: str, evidence: dict[str, Any], percent: float | None = None) -> None:
        self._seq += 1
        self._events.append(ReleaseEvent(self._seq, self._clock(), kind, self.state.value, self.step,
                                         self.percent if percent is None else percent, reason, evidence))

    def status(self) -> dict[str, Any]:
        """The release as the admin API shows it (`lease`: the ingress running its eval gate, and
        until when, while it evaluates)."""
        return {"id": self.id, "adapter": self.name, "tenant": self.tenant, "state": self.state.value,
                "stable_version": self.stable, "candidate_version": self.candidate, "step": self.step,
                "steps": list(self.settings.steps), "percent": self.percent,
                "step_started_at": self.step_started_at, "created_at": self.created_at,
                "candidate_answered": self.candidate_answered, "stats": self._evidence(),
                "lease": None if self.lease is None else self.lease.to_dict()}

    def to_dict(self) -> dict[str, Any]:
        """Everything a restart needs (`from_dict`), its own settings included."""
        return {**self.status(), "seq": self._seq, "events": [e.to_dict() for e in self._events],
                "settings": {**asdict(self.settings), "steps": list(self.settings.steps)}, "gate": self.gate}

    @classmethod
    def from_dict(cls, d: dict[str, Any], settings: ReleaseSettings, clock: Callable[[], float]) -> Release:
        """A release from `to_dict`; `settings`: for a state written without its own."""
        if "settings" in d:
            settings = ReleaseSettings(**{**d["settings"], "steps": tuple(d["settings"]["steps"])})
        release = cls.__new__(cls)
        release.id, release.name, release.tenant = str(d["id"]), str(d["adapter"]), d.get("tenant")
        release.stable, release.candidate = int(d["stable_version"]), int(d["candidate_version"])
        release.settings, release._clock = settings, clock
        release.state = ReleaseState(d["state"])
        release.step = min(int(d["step"]), len(settings.steps) - 1)
        release.step_started_at, release.created_at = float(d["step_started_at"]), float(d["created_at"])
        release.stats = {k: StepStats.from_dict(d["stats"][k]) for k in ("candidate", "stable")}
        release.shadow = ShadowStats.from_dict(d["stats"].get("shadow"))
        release.candidate_answered = int(d["candidate_answered"])
        release._events = deque((ReleaseEvent(**e) for e in d["events"]), maxlen=settings.max_events)
        release._seq = int(d["seq"])
        release.gate, release.lease = d.get("gate"), Lease.from_dict(d.get("lease"))
        return release

"""The releases of every adapter name in one place, and what each bare name resolves to.

The versions themselves are kept by whoever loads them (at the ingress, the registrations:
`serve.http.adapter_versions`); the book is told which are kept when it resolves.

Policy (`alias`):
* a running release decides: its stable version, or its candidate for the users in the current
  step's share (`releases.split`; none while it is evaluated);
* after a rolled-back release the bare name stays on that release's stable version, until a version
  newer than its candidate is loaded (a load in place without a release replaces at once, as vLLM);
* otherwise (no release, or after a promotion) the latest kept version.

Shared state (`adopt`): with `release_state_uri` the releases live in one document every ingress
reads and writes (`releases.state_store`). Each ingress counts its live evidence twice: into its own
copy (its split and an early rollback act at once) and as `pending` evidence, keyed by release and
step, that its next write adds to the document's counts. `adopt` rebuilds the book from the document
and replays the pending evidence step by step (judging after each), so the book is always the
document plus what this ingress has not written yet; evidence of a step the document has left is
dropped (it judged a step that is over).

Eval gates (`hold`, `settle_eval`): the ingress running a release's eval gate holds its lease in
the shared document and renews it with every sync; an expired lease is taken by the next ingress
that syncs, which runs the gate again, and only the current holder's verdict is written
(`releases.lease`).

Bounds: one running release per name; at most `finished_kept` releases kept per name before the
latest one (the oldest dropped when a release starts); names are those of loaded adapters (bounded
by the registrations; `forget` on an unload). Pure and synchronous: the ingress calls it between
two awaits. The clock is injected and is a wall clock (the state is written out and read back after
a restart, `to_dict`/`restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from lora_cluster.errors import AdapterNotFoundError, ReleaseConflictError
from lora_cluster.releases.gates import ReleaseSettings, ShadowCheck, ShadowStats, StepStats
from lora_cluster.releases.lease import Lease
from lora_cluster.releases.release import Release, ReleaseState

FINISHED_KEPT = 10
ACTIONS = ("promote", "pause", "resume", "rollback")
PendingKey = tuple[str, str, int]  # (name, release id, step)


class Pending:
    """Live evidence of one release's step not yet written to the shared state."""

    def __init__(self) -> None:
        self.stats = {"candidate": StepStats(), "stable": StepStats()}
        self.shadow = ShadowStats()
        self.candidate_answered = 0

    def add(self, other: Pending) -> None:
        for key, counted in other.stats.items():
            self.stats[key].add(counted)
        self.shadow.add(other.shadow)
        self.candidate_answered += other.candidate_answered


class ReleaseBook:
    """Releases of every adapter name and the alias policy (module docstring)."""

    def __init__(self, settings: ReleaseSettings, clock: Callable[[], float],
                 finished_kept: int = FINISHED_KEPT):
        self.settings, self._clock, self.finished_kept = settings, clock, finished_kept
        self._releases: dict[str, list[Release]] = {}  # name -> its releases, oldest first
        self._pending: dict[PendingKey, Pending] = {}  # at most one running release per name, 16 steps
        self.known: dict[str, list[int]] | None = None  # name -> versions in the shared state (None: none)

    def start(self, name: str, release_id: str, stable: int, candidate: int, tenant: str | None = None,
              settings: ReleaseSettings | None = None) -> Release:
        """A new release of `name` (evaluating: no traffic yet), under `settings` (None: the book's);
        ReleaseConflictError when one runs."""
        running = self.running(name)
        if running is not None:
            raise ReleaseConflictError(name, running.id, f"it is {running.state.value}; promote or roll it "
                                       "back before starting another release")
        release = Release(release_id, name, stable, candidate, settings or self.settings, self._clock, tenant)
        kept = self._releases.setdefault(name, [])
        kept.append(release)
        finished = [r for r in kept if r.final]
        for old in finished[:max(0, len(finished) - self.finished_kept)]:
            kept.remove(old)
        return release

    def forget(self, name: str) -> None:
        """The name is unloaded: its releases go."""
        self._releases.pop(name, None)

    def alias(self, name: str, kept: list[int], user: str) -> int | None:
        """The version the bare `name` means for `user` (module docstring), given its kept versions
        (oldest first); None when none is kept. With a shared state, only the versions the book has
        read in it count (`known`): a version registered through another ingress is a candidate of
        a release this book may not have read yet, so the bare name never moves to it before then."""
        if self.known is not None:
            kept = [n for n in kept if n in self.known.get(name, ())] or kept[:1]
        if not kept:
            return None
        releases = self._releases.get(name)
        if not releases:
            return kept[-1]
        last = releases[-1]
        if not last.final:
            return last.alias().resolve(user)
        rolled_back = last.state is ReleaseState.ROLLED_BACK
        if rolled_back and kept[-1] <= last.candidate and last.stable in kept:
            return last.stable
        return kept[-1]

    def protected(self, name: str) -> list[int]:
        """Versions a running release of `name` uses (never retired)."""
        running = self.running(name)
        return [] if running is None else [running.stable, running.candidate]

    def running(self, name: str) -> Release | None:
        """The release of `name` that is not final yet (at most one)."""
        releases = self._releases.get(name)
        return releases[-1] if releases and not releases[-1].final else None

    def releases(self, name: str) -> list[Release]:
        return list(self._releases.get(name, []))

    def latest(self) -> list[Release]:
        """The latest release of every name that has one (running or final)."""
        return [kept[-1] for kept in self._releases.values() if kept]

    def release(self, name: str, release_id: str) -> Release:
        """The release `release_id` of `name`; AdapterNotFoundError when there is none."""
        for release in self._releases.get(name, []):
            if release.id == release_id:
                return release
        raise AdapterNotFoundError(name, f"no release {release_id!r}")

    def record(self, name: str, number: int, ok: bool, on_target: bool = True) -> None:
        """One answered request of `name@number`, as evidence for its running release, then judge
        the step (a failing gate rolls back at once)."""
        running = self.running(name)
        if running is None or running.state not in (ReleaseState.CANARY, ReleaseState.PAUSED):
            return
        if number in (running.stable, running.candidate):
            pending = self._pending.setdefault((name, running.id, running.step), Pending())
            pending.stats["candidate" if number == running.candidate else "stable"].record(ok, on_target)
            pending.candidate_answered += number == running.candidate
        running.record(number, ok, on_target)
        running.tick()

    def record_shadow(self, name: str, release_id: str, stable_tokens: list[int], candidate_tokens: list[int],
                      stable_ttft_s: float, candidate_ttft_s: float,
                      check: ShadowCheck | None = None) -> None:
        """One shadow copy of release `release_id` compared (`releases.gates`), then judge the step;
        ignored when that release is no longer running or not in its canary."""
        running = self.running(name)
        if running is None or running.id != release_id or running.state not in (ReleaseState.CANARY,
                                                                                  ReleaseState.PAUSED):
            return
        pending = self._pending.setdefault((name, running.id, running.step), Pending())
        pending.shadow.record(stable_tokens, candidate_tokens, stable_ttft_s, candidate_ttft_s, check)
        running.record_shadow(stable_tokens, candidate_tokens, stable_ttft_s, candidate_ttft_s, check)
        running.tick()

    def tick(self) -> list[Release]:
        """Judge every running release's step; returns those that became final now."""
        settled = []
        for name in list(self._releases):
            running = self.running(name)
            if running is not None:
                running.tick()
                if running.final:
                    settled.append(running)
        return settled

    def hold(self, owner: str, gates: Collection[str], lease_s: float) -> list[tuple[str, str]]:
        """The eval gates' leases at ingress `owner`'s sync (`releases.lease`): renew those of the
        releases in `gates` (whose gate runs at `owner`, and whose lease no other ingress took), take
        every expired one; returns the (name, release id) of the releases taken now, whose gate
        `owner` must run again."""
        now, taken = self._clock(), []
        for name in list(self._releases):
            release = self.running(name)
            if release is None or release.state is not ReleaseState.EVALUATING:
                continue
            lease = release.lease
            if release.id in gates and (lease is None or lease.owner == owner):
                release.lease = Lease(owner, now + lease_s)
            elif lease is None or lease.expired(now):
                release.take_over(owner, now + lease_s)
                taken.append((name, release.id))
        return taken

    def lease(self, owner: str, lease_s: float) -> Lease:
        """A new lease of an eval gate for ingress `owner`, from now."""
        return Lease(owner, self._clock() + lease_s)

    def settle_eval(self, name: str, release_id: str, owner: str, passed: bool, reason: str,
                    evidence: dict[str, Any]) -> Release:
        """The eval gate's verdict from the ingress `owner`: written when the release still
        evaluates and `owner` holds its lease (a former holder's late verdict is dropped)."""
        release = self.release(name, release_id)
        lease = release.lease
        if release.state is ReleaseState.EVALUATING and (lease is None or lease.owner == owner):
            if passed:
                release.eval_passed(evidence)
            else:
                release.eval_failed(reason, evidence)
        return release

    def command(self, name: str, release_id: str, action: str, reason: str = "manual") -> Release:
        """The admin API's `promote`, `pause`, `resume` or `rollback` of one release;
        ReleaseConflictError when its state refuses the command."""
        release = self.release(name, release_id)
        commands = {"promote": release.promote, "pause": release.pause, "resume": release.resume,
                    "rollback": release.rollback}
        commands[action](reason)
        return release

    def to_dict(self) -> dict[str, Any]:
        return {"releases": {n: [r.to_dict() for r in kept] for n, kept in self._releases.items()}}

    def take_pending(self) -> dict[PendingKey, Pending]:
        """The evidence not yet written, handed to a write (`give_back` it if the write fails)."""
        taken, self._pending = self._pending, {}
        return taken

    def give_back(self, taken: dict[PendingKey, Pending]) -> None:
        """Evidence a failed write took: it goes into the next one."""
        for key, pending in taken.items():
            self._pending.setdefault(key, Pending()).add(pending)

    def adopt(self, state: dict[str, Any], taken: dict[PendingKey, Pending]) -> None:
        """The shared document's releases plus this ingress's evidence `taken` (module docstring)."""
        self.restore(state)
        for (name, release_id, step), pending in sorted(taken.items(), key=lambda item: item[0][2]):
            running = self.running(name)
            if running is not None and running.id == release_id and running.step == step:
                running.absorb(pending.stats, pending.candidate_answered, pending.shadow)
                running.tick()

    def restore(self, state: dict[str, Any]) -> None:
        """Take what `to_dict` wrote (a restart): running releases resume at their step."""
        self._releases = {str(n): [Release.from_dict(r, self.settings, self._clock) for r in kept]
                          for n, kept in state.get("releases", {}).items()}

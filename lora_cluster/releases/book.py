"""The releases of every adapter name in one place, and what each bare name resolves to.

The versions themselves are kept by whoever loads them (at the ingress, the registrations:
`serve.http.adapter_versions`); the book is told which are kept when it resolves.

Policy (`alias`):
* a running release decides: its stable version, or its candidate for the users in the current
  step's share (`releases.split`; none while it is evaluated);
* after a rolled-back release the bare name stays on that release's stable version, until a version
  newer than its candidate is loaded (a load in place without a release replaces at once, as vLLM);
* otherwise (no release, or after a promotion) the latest kept version.

Bounds: one running release per name; at most `finished_kept` releases kept per name before the
latest one (the oldest dropped when a release starts); names are those of loaded adapters (bounded
by the registrations; `forget` on an unload). Pure and synchronous: the ingress calls it between
two awaits. The clock is injected and is a wall clock (the state is written out and read back after
a restart, `to_dict`/`restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lora_cluster.errors import AdapterNotFoundError, ReleaseConflictError
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.release import Release, ReleaseState

FINISHED_KEPT = 10
ACTIONS = ("promote", "pause", "resume", "rollback")


class ReleaseBook:
    """Releases of every adapter name and the alias policy (module docstring)."""

    def __init__(self, settings: ReleaseSettings, clock: Callable[[], float],
                 finished_kept: int = FINISHED_KEPT):
        self.settings, self._clock, self.finished_kept = settings, clock, finished_kept
        self._releases: dict[str, list[Release]] = {}  # name -> its releases, oldest first

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
        (oldest first); None when none is kept."""
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
        if running is not None:
            running.record(number, ok, on_target)
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

    def restore(self, state: dict[str, Any]) -> None:
        """Take what `to_dict` wrote (a restart): running releases resume at their step."""
        self._releases = {str(n): [Release.from_dict(r, self.settings, self._clock) for r in kept]
                          for n, kept in state.get("releases", {}).items()}

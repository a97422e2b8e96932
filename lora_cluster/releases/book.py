"""The releases of every adapter name in one place: the version catalog, what each bare name
resolves to, and the releases running or finished.

Policy:
* a registration without a release moves the bare name to the new version at once (vLLM's replace);
* a registration *with* a release (`register(..., release_id=...)`) keeps the bare name on its
  stable version and stages the new one as the candidate: the release decides from then on;
* a promoted release moves the bare name to its candidate; a rolled-back one leaves it on its stable
  version (the candidate stays addressable as `name@N` until retired);
* one running release per name at a time, and no other registration of the name while it runs
  (409: promote or roll it back first); at most `finished_kept` finished releases per name are
  kept (the oldest dropped); a running release's two versions are never retired.

Pure and synchronous: the ingress calls it between two awaits. The clock is injected (a wall clock:
the state is written out and read back after a restart, `to_dict`/`restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lora_cluster.errors import AdapterNotFoundError, ReleaseConflictError
from lora_cluster.releases.catalog import AdapterVersion, VersionCatalog, parse_ref
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.release import Release, ReleaseState

FINISHED_KEPT = 10


class ReleaseBook:
    """Versions, aliases and releases of every adapter name (module docstring)."""

    def __init__(self, settings: ReleaseSettings, clock: Callable[[], float], versions_kept: int = 5,
                 finished_kept: int = FINISHED_KEPT):
        self.settings, self._clock, self.finished_kept = settings, clock, finished_kept
        self.catalog = VersionCatalog(clock, versions_kept, protected=self._protected)
        self._stable: dict[str, int] = {}  # name -> what the bare name means with no running release
        self._releases: dict[str, list[Release]] = {}  # name -> its releases, oldest first

    def _protected(self, name: str) -> list[int]:
        running = self.running(name)
        return [self._stable.get(name, 0)] + ([] if running is None else [running.stable, running.candidate])

    # --- versions ---

    def register(self, name: str, source: str, content_hash: str, release_id: str | None = None,
                 tenant: str | None = None) -> tuple[AdapterVersion, Release | None, list[AdapterVersion]]:
        """A new version of `name` (module docstring); with `release_id`, staged as the candidate of a
        new release against the bare name's version. Returns the version, the release (or None) and
        the versions retired. ReleaseConflictError: a release of the name is running, or a release
        has no version to release against."""
        stable, running = self._stable.get(name), self.running(name)
        if running is not None:
            raise ReleaseConflictError(name, running.id, f"it is {running.state.value}; promote or roll "
                                       "it back before registering another version")
        if release_id is not None and stable is None:
            raise ReleaseConflictError(name, release_id, "a release needs a version to release against; "
                                       "register the first version without a release")
        version, retired = self.catalog.register(name, source, content_hash)
        if release_id is None or stable is None:
            self._stable[name] = version.number
            return version, None, retired
        release = Release(release_id, name, stable, version.number, self.settings, self._clock, tenant)
        kept = self._releases.setdefault(name, [])
        kept.append(release)
        finished = [r for r in kept if r.final]
        for old in finished[:max(0, len(finished) - self.finished_kept)]:
            kept.remove(old)
        return version, release, retired

    def forget(self, name: str) -> None:
        """The name is unloaded: its versions, alias and releases go."""
        self.catalog.forget(name)
        self._stable.pop(name, None)
        self._releases.pop(name, None)

    def resolve(self, ref: str, user: str) -> tuple[str, int] | None:
        """(name, version number) a model reference means for `user`: `name@N` that version (404
        when it is not kept), a bare name its alias; None when the name has no version here (an
        adapter of a source, not registered through the API)."""
        name, number = parse_ref(ref)
        if number is not None:
            return name, self.catalog.get(name, number).number
        stable = self._stable.get(name)
        if stable is None:
            return None
        running = self.running(name)
        return name, stable if running is None else running.alias().resolve(user)

    def version_of(self, name: str, number: int) -> AdapterVersion:
        return self.catalog.get(name, number)

    # --- releases ---

    def running(self, name: str) -> Release | None:
        """The release of `name` that is not final yet (at most one)."""
        for release in reversed(self._releases.get(name, [])):
            if not release.final:
                return release
        return None

    def releases(self, name: str) -> list[Release]:
        return list(self._releases.get(name, []))

    def release(self, name: str, release_id: str) -> Release:
        """The release `release_id` of `name`; AdapterNotFoundError when there is none."""
        for release in self._releases.get(name, []):
            if release.id == release_id:
                return release
        raise AdapterNotFoundError(name, f"no release {release_id!r}")

    def record(self, name: str, number: int, ok: bool, on_target: bool = True) -> None:
        """One answered request of `name@number`, as evidence for its running release."""
        running = self.running(name)
        if running is not None:
            running.record(number, ok, on_target)

    def tick(self) -> list[Release]:
        """Judge every running release's step; returns those that became final now (their alias
        settles: a promotion moves the bare name to the candidate)."""
        settled = []
        for name in list(self._releases):
            running = self.running(name)
            if running is None:
                continue
            running.tick()
            if running.final:
                self.settle(running)
                settled.append(running)
        return settled

    def settle(self, release: Release) -> None:
        """A final release's outcome for its bare name: a promotion moves it to the candidate."""
        if release.state is ReleaseState.PROMOTED:
            self._stable[release.name] = release.candidate

    def command(self, name: str, release_id: str, action: str, reason: str = "manual") -> Release:
        """The admin API's `promote`, `pause`, `resume` or `rollback` of one release (its outcome
        settled at once); ReleaseConflictError when its state refuses the command."""
        release = self.release(name, release_id)
        commands = {"promote": release.promote, "pause": release.pause, "resume": release.resume,
                    "rollback": release.rollback}
        commands[action](reason)
        self.settle(release)
        return release

    # --- durability ---

    def to_dict(self) -> dict[str, Any]:
        return {"catalog": self.catalog.to_dict(), "stable": dict(self._stable),
                "releases": {n: [r.to_dict() for r in kept] for n, kept in self._releases.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Take what `to_dict` wrote (a restart): running releases resume at their step."""
        self.catalog.restore(state.get("catalog", {}))
        self._stable = {str(n): int(v) for n, v in state.get("stable", {}).items()}
        self._releases = {str(n): [Release.from_dict(r, self.settings, self._clock) for r in kept]
                          for n, kept in state.get("releases", {}).items()}

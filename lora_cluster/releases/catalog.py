"""The versions of adapter names: every registration of a name creates an immutable version.

A version is (name, number, content hash, source, time). Numbers start at 1 and only grow, per
name; a number is never reused while the name is registered, even after its version is retired.
`name@N` addresses one version (`parse_ref`); the bare name is an alias that `releases.book`
resolves (no release: the latest).

Bounded by design: at most `versions_kept` versions per name and `max_names` names (names are
chosen by clients through the load API). Registering a version beyond `versions_kept` retires the
oldest version that is not *protected* (a running release's stable or candidate version); when every
kept version is protected the registration is refused. Pure: the clock is injected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from lora_cluster.errors import AdapterVersionNotFoundError, RequestError

MAX_NAMES = 4096
VERSION_SEP = "@"
_REF = re.compile(r"^(?P<name>.+)@(?P<number>[1-9][0-9]{0,8})$")


def parse_ref(ref: str) -> tuple[str, int | None]:
    """`"fin@2"` -> `("fin", 2)`; a bare `"fin"` -> `("fin", None)` (the alias). A `@` not followed by
    a positive version number is left in the name (the adapter-id check refuses it later)."""
    match = _REF.fullmatch(ref)
    if match is None:
        return ref, None
    return match["name"], int(match["number"])


def version_ref(name: str, number: int) -> str:
    """The `name@N` that addresses one version."""
    return f"{name}{VERSION_SEP}{number}"


@dataclass(frozen=True)
class AdapterVersion:
    """One immutable version of an adapter name."""

    name: str
    number: int
    content_hash: str  # sha256 of the adapter's files, as the source gave them
    source: str  # where its weights come from (a path or URI given at registration)
    created_at: float  # wall-clock seconds, for people (the catalog's injected clock)

    @property
    def ref(self) -> str:
        return version_ref(self.name, self.number)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterVersion:
        return cls(str(d["name"]), int(d["number"]), str(d["content_hash"]), str(d["source"]),
                   float(d["created_at"]))


class VersionCatalog:
    """Versions per adapter name (module docstring). `protected(name)` names the version numbers a
    running release of `name` uses, which retirement must keep."""

    def __init__(self, clock: Callable[[], float], versions_kept: int = 5, max_names: int = MAX_NAMES,
                 protected: Callable[[str], Iterable[int]] = lambda name: ()):
        if versions_kept < 1 or max_names < 1:
            raise ValueError("versions_kept and max_names must be at least 1")
        self._clock, self.versions_kept, self.max_names = clock, versions_kept, max_names
        self._protected = protected
        self._versions: dict[str, list[AdapterVersion]] = {}  # name -> kept versions, oldest first
        self._last: dict[str, int] = {}  # name -> the highest number ever given (never reused)

    def register(self, name: str, source: str,
                 content_hash: str) -> tuple[AdapterVersion, list[AdapterVersion]]:
        """Create the next version of `name`; returns it and the versions it retired. Raises
        RequestError when `max_names` names are known, or every kept version of `name` is protected."""
        if name not in self._last and len(self._last) >= self.max_names:
            raise RequestError(f"adapter {name!r}: at most {self.max_names} adapter names can have "
                               "versions; unload one first")
        kept = self._versions.get(name, [])
        retired = self._retire(name, kept, len(kept) + 1 - self.versions_kept)
        version = AdapterVersion(name, self._last.get(name, 0) + 1, content_hash, source, self._clock())
        self._versions[name] = [v for v in kept if v not in retired] + [version]
        self._last[name] = version.number
        return version, retired

    def _retire(self, name: str, kept: list[AdapterVersion], count: int) -> list[AdapterVersion]:
        if count <= 0:
            return []
        protected = set(self._protected(name))
        candidates = [v for v in kept if v.number not in protected]
        if len(candidates) < count:
            raise RequestError(f"adapter {name!r}: its {len(kept)} kept versions (release_versions_kept="
                               f"{self.versions_kept}) are all in use by a release; finish it first")
        return candidates[:count]

    def forget(self, name: str) -> list[AdapterVersion]:
        """Drop every version of `name` (its unload: the name is gone, and a later registration starts
        again at version 1, as a new adapter). Returns the versions dropped."""
        self._last.pop(name, None)
        return self._versions.pop(name, [])

    def get(self, name: str, number: int) -> AdapterVersion:
        """The version `name@number`; AdapterVersionNotFoundError when it was never registered or
        was retired."""
        for version in self._versions.get(name, []):
            if version.number == number:
                return version
        reason = "retired" if 0 < number <= self._last.get(name, 0) else "no such version"
        raise AdapterVersionNotFoundError(name, number, reason)

    def latest(self, name: str) -> AdapterVersion | None:
        kept = self._versions.get(name)
        return kept[-1] if kept else None

    def versions(self, name: str) -> list[AdapterVersion]:
        """The kept versions of `name`, oldest first (a copy)."""
        return list(self._versions.get(name, []))

    def names(self) -> list[str]:
        return [name for name, kept in self._versions.items() if kept]

    def to_dict(self) -> dict[str, Any]:
        return {"last": dict(self._last),
                "versions": {n: [v.to_dict() for v in kept] for n, kept in self._versions.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Take the state `to_dict` wrote (a restart); replaces what this catalog holds."""
        self._last = {str(n): int(k) for n, k in state.get("last", {}).items()}
        self._versions = {str(n): [AdapterVersion.from_dict(v) for v in kept]
                          for n, kept in state.get("versions", {}).items()}

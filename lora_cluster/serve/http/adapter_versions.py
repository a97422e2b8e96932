"""The versions of adapters registered through the vLLM API, and what a request's `model` means.

Every load of a name creates a version (`releases.refs`'s numbering): the first load of `fin` is
version 1, registered on the replicas as `fin`; a load of `fin` again with `load_inplace: true` is
version 2, registered as `fin@2`, and so on. The registrations (name -> path, shared by every
ingress replica, `registry`) hold one entry per kept version, so this index is rebuilt from their
entries whenever they change (`changes`), never per request.

Resolution (`replica_id`): `fin@N` is the version N (a 404 naming the version when it is not kept:
never registered, retired or unloaded); the bare `fin` is its alias, the latest kept version. A name
with no registered version (an adapter of the configured source) has exactly one version, 1, the
adapter itself: `a3@1` is `a3`, `a3@2` a 404. The response header `x-lora-adapter-version` names the
version that answered (`number_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lora_cluster.errors import AdapterVersionNotFoundError
from lora_cluster.releases.refs import parse_ref, version_ref
from lora_cluster.releases.split import VERSION_HEADER

__all__ = ["VERSION_HEADER", "RegisteredEntries", "VersionIndex", "number_of", "replica_id_of",
           "version_header"]


class RegisteredEntries(Protocol):
    """What the index reads of the registrations: their entries and a counter of their changes."""

    @property
    def changes(self) -> int: ...

    def snapshot(self) -> dict[str, str]: ...


def replica_id_of(name: str, number: int) -> str:
    """The adapter id version `number` of `name` is registered as on the replicas."""
    return name if number == 1 else version_ref(name, number)


def number_of(replica_id: str) -> int:
    """The version a replica's adapter id serves (`fin` -> 1, `fin@3` -> 3)."""
    return parse_ref(replica_id)[1] or 1


def version_header(job: Any) -> dict[str, str]:
    """`x-lora-adapter-version` for a response whose first job is `job` (a `GenerateJob`): the version
    of its adapter; none for the base model or a merge of adapters (no one version answered)."""
    if job.adapter_id is None or job.merge is not None:
        return {}
    return {VERSION_HEADER: str(number_of(job.adapter_id))}


def model_ids(entries: Mapping[str, str]) -> dict[str, str]:
    """The model ids `/v1/models` lists for registered adapters -> the replica adapter id each runs
    on: per name, the bare name (its latest version) and then every kept version as `name@N`."""
    listed: dict[str, str] = {}
    for name, numbers in index_entries(entries).items():
        listed[name] = replica_id_of(name, numbers[-1])
        for number in numbers:
            listed[version_ref(name, number)] = replica_id_of(name, number)
    return listed


class VersionIndex:
    """name -> its kept version numbers, from the registrations' entries (module docstring)."""

    def __init__(self, registrations: RegisteredEntries):
        self._registrations = registrations
        self._seen = -1
        self._versions: dict[str, list[int]] = {}

    def versions(self, name: str) -> list[int]:
        """The kept versions of a registered `name`, oldest first ([] when it has none)."""
        self._refresh()
        return list(self._versions.get(name, []))

    def names(self) -> dict[str, list[int]]:
        self._refresh()
        return {name: list(numbers) for name, numbers in self._versions.items()}

    def replica_id(self, model: str, alias: int | None = None) -> str:
        """The replica adapter id a request's `model` (an adapter: `fin` or `fin@N`) runs on;
        `alias`: the version the bare name means (a release's choice; None: the latest)."""
        name, number = parse_ref(model)
        number = alias if number is None else number
        kept = self.versions(name)
        if not kept:
            if number is None or number == 1:
                return name
            raise AdapterVersionNotFoundError(name, number, "an adapter that was not loaded through the "
                                              "API has version 1 only")
        if number is None:
            return replica_id_of(name, kept[-1])
        if number not in kept:
            reason = "retired" if number < kept[-1] else "no such version"
            raise AdapterVersionNotFoundError(name, number, reason)
        return replica_id_of(name, number)

    def _refresh(self) -> None:
        changes = self._registrations.changes
        if changes == self._seen:
            return
        self._versions = index_entries(self._registrations.snapshot())
        self._seen = changes


def index_entries(entries: Mapping[str, str]) -> dict[str, list[int]]:
    """name -> sorted version numbers, from registration entries keyed by replica adapter id."""
    versions: dict[str, list[int]] = {}
    for key in entries:
        name, number = parse_ref(key)
        versions.setdefault(name, []).append(number or 1)
    return {name: sorted(numbers) for name, numbers in versions.items()}

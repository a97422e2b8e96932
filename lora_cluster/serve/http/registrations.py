"""Adapters registered at the ingress through vLLM's `load_lora_adapter` (name -> path).

A load or unload broadcasts to every replica, which awaits; a name is therefore *reserved* before
the first await and settled after the last one. The event loop runs one coroutine at a time and no
method here awaits, so a check and its reservation are atomic: two concurrent loads of one name
cannot both pass the check, and a load cannot race an unload of the same name.

Invariants:
* a name is either registered (with its path), or busy (a load or an unload in flight), or unknown;
* `reserve_load` is the only way in, and it refuses a registered or busy name;
* registered plus busy names never exceed `limit` (the names are chosen by clients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from lora_cluster.errors import ConfigError, RequestError

MAX_REGISTERED_ADAPTERS = 1024

Operation = Literal["loaded", "unloaded"]


class RegistrationConflict(RequestError):
    """A load was refused: the name is registered, busy, or there is no room for another name.
    `code` is the API error code that says which."""

    def __init__(self, message: str, code: str):
        self.code = code
        super().__init__(message)


class AdapterRegistrations:
    """The ingress's registrations; see the module docstring for the protocol."""

    def __init__(self, limit: int = MAX_REGISTERED_ADAPTERS):
        if limit < 1:
            raise ConfigError(f"the registration limit must be at least 1, got {limit}")
        self.limit = limit
        self._paths: dict[str, str] = {}
        self._busy: dict[str, Operation] = {}  # name -> what is being done to it
        self.changes = 0  # grows with every change of the registered names (readers rebuild on it)

    def path(self, name: str) -> str | None:
        """The path a registered adapter was loaded from (None: not registered, or still loading)."""
        return self._paths.get(name)

    def snapshot(self) -> dict[str, str]:
        """Every registered adapter: name -> path (a copy)."""
        return dict(self._paths)

    def reserve_load(self, name: str) -> None:
        """Mark `name` as being loaded; raises RegistrationConflict when it is registered or busy,
        or when `limit` names are registered or busy already."""
        if name in self._paths:
            raise RegistrationConflict(f"the LoRA adapter {name!r} has already been loaded", "already_loaded")
        busy = self._busy.get(name)
        if busy is not None:
            raise RegistrationConflict(f"the LoRA adapter {name!r} is being {busy}; retry when that is done",
                                       f"being_{busy}")
        if len(self._paths) + len(self._busy) >= self.limit:
            raise RegistrationConflict(f"at most {self.limit} LoRA adapters can be loaded through this API; "
                                       "unload one first", "too_many_adapters")
        self._busy[name] = "loaded"

    def complete_load(self, name: str, path: str) -> None:
        """The load of a reserved `name` succeeded: it is registered from now on."""
        if self._busy.get(name) != "loaded":
            raise RuntimeError(f"complete_load({name!r}) without reserve_load")
        del self._busy[name]
        self._paths[name] = path
        self.changes += 1

    def reserve_unload(self, name: str) -> bool:
        """Unregister `name` and mark it as being unloaded; False when it is not registered."""
        if name not in self._paths:
            return False
        del self._paths[name]
        self._busy[name] = "unloaded"
        self.changes += 1
        return True

    def release(self, name: str) -> None:
        """End the reservation of `name` (an unload that finished, or a load that failed)."""
        self._busy.pop(name, None)


BUSY_TTL_S = 600.0  # a load or unload not settled within this long (its ingress died) frees its name
SUBSCRIBER_TTL_S = 30.0  # an ingress not heard from for this long (3 long polls) is no longer waited for


class RegistryBook:
    """The registrations of every ingress replica in one place (the `AdapterRegistry` deployment).

    It holds an `AdapterRegistrations` (same protocol, same bound) plus, per registered name, the base
    model it joined, and a `version` that grows with every change of the registered set. Ingresses
    subscribe: each says which version it has applied (`heard`); `lagging(version)` names the live
    subscribers that have not applied `version` yet, so that a load or unload answers only once every
    ingress serves it. A subscriber not heard from for `subscriber_ttl_s` is dropped (bounded by the
    ingress replicas that lived within it). A name busy is released when the ingress that reserved it
    died before settling it: when that holder has not been heard from for `subscriber_ttl_s` (its
    long poll stopped; a live holder is heard at least every poll), and in any case after
    `busy_ttl_s` (a settling call that was lost). Pure: the clock is injected."""

    def __init__(self, clock: Callable[[], float], limit: int = MAX_REGISTERED_ADAPTERS,
                 busy_ttl_s: float = BUSY_TTL_S, subscriber_ttl_s: float = SUBSCRIBER_TTL_S):
        self.registrations = AdapterRegistrations(limit)
        self._clock, self.busy_ttl_s, self.subscriber_ttl_s = clock, busy_ttl_s, subscriber_ttl_s
        self.version = 0
        self._bases: dict[str, str | None] = {}
        self._reserved: dict[str, tuple[float, str | None]] = {}  # name -> (since, holder)
        self._heard: dict[str, tuple[int, float]] = {}  # subscriber -> (version applied, when heard)

    def entries(self) -> dict[str, tuple[str, str | None]]:
        """Every registered adapter: name -> (path, base it joined; None: every group)."""
        return {name: (path, self._bases.get(name)) for name, path in self.registrations.snapshot().items()}

    def reserve_load(self, name: str, holder: str | None = None) -> None:
        """`AdapterRegistrations.reserve_load` for subscriber `holder` (raises RegistrationConflict),
        after releasing the names whose holder died (class docstring)."""
        now = self._clock()
        for stale in [n for n, (since, by) in self._reserved.items() if self._gone(by, since, now)]:
            self.release(stale)
        self.registrations.reserve_load(name)
        self._reserved[name] = (now, holder)

    def _gone(self, holder: str | None, since: float, now: float) -> bool:
        """Whether the reservation made at `since` by `holder` outlived its ingress (or its settling
        call was lost: `busy_ttl_s` bounds every reservation)."""
        if now - since > self.busy_ttl_s:
            return True
        if holder is None:
            return False
        heard = self._heard.get(holder)
        last = since if heard is None else max(since, heard[1])
        return now - last > self.subscriber_ttl_s

    def complete_load(self, name: str, path: str, base: str | None) -> int:
        """The reserved load of `name` succeeded; returns the new version."""
        self.registrations.complete_load(name, path)
        self._reserved.pop(name, None)
        self._bases[name] = base
        self.version += 1
        return self.version

    def reserve_unload(self, name: str, holder: str | None = None) -> int | None:
        """Unregister `name` (busy until `release`, or until its `holder` is gone); the new version,
        or None when it is not registered."""
        if not self.registrations.reserve_unload(name):
            return None
        self._bases.pop(name, None)
        self._reserved[name] = (self._clock(), holder)
        self.version += 1
        return self.version

    def release(self, name: str) -> None:
        self.registrations.release(name)
        self._reserved.pop(name, None)

    def restore(self, entries: dict[str, tuple[str, str | None]]) -> bool:
        """Take the registrations an ingress kept from a registry that is gone (this one restarted):
        only while nothing was loaded or unloaded here yet (version 0), those whose name is not busy
        (a load of it is under way here), as many as the bound allows. True when they were taken."""
        if self.version:
            return False
        for name, (path, base) in entries.items():
            try:
                self.registrations.reserve_load(name)
            except RegistrationConflict:
                continue
            self.registrations.complete_load(name, path)
            self._bases[name] = base
        self.version = 1
        return True

    def heard(self, subscriber: str, version: int) -> None:
        """`subscriber` has applied `version` (and is alive now)."""
        now = self._clock()
        self._heard[subscriber] = (version, now)
        for gone in [s for s, (_, at) in self._heard.items() if now - at > self.subscriber_ttl_s]:
            del self._heard[gone]

    def lagging(self, version: int) -> list[str]:
        """Live subscribers that have not applied `version` yet."""
        now = self._clock()
        return [s for s, (v, at) in self._heard.items() if v < version and now - at <= self.subscriber_ttl_s]

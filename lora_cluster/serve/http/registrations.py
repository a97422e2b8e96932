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

    def reserve_unload(self, name: str) -> bool:
        """Unregister `name` and mark it as being unloaded; False when it is not registered."""
        if name not in self._paths:
            return False
        del self._paths[name]
        self._busy[name] = "unloaded"
        return True

    def release(self, name: str) -> None:
        """End the reservation of `name` (an unload that finished, or a load that failed)."""
        self._busy.pop(name, None)

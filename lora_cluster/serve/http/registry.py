"""Where the ingress keeps the adapters registered through vLLM's load_lora_adapter API.

One ingress replica (the default) keeps them in its own process (`LocalRegistrations`). Several
ingress replicas (`ingress_num_replicas` > 1, or `ingress_autoscaling_config`) share the
`AdapterRegistry` deployment (one replica, like the cluster controller and the quota ledger), so that
a load or unload made through any ingress holds for all: a name loaded through one is a 409 through
another, an unload through any ingress removes it, `/v1/models` lists it everywhere.

Each ingress keeps a copy (`SharedRegistrations`): the request path reads it without a call. The copy
follows the registry by a long poll (`AdapterRegistry.changes`, answered as soon as the registry
changes), and each poll tells the registry which version the ingress has applied. A load or unload
is answered only once every live ingress has applied it (bounded by `APPLY_WAIT_S`; an ingress that
does not poll within `SUBSCRIBER_TTL_S` is not waited for): after a 200, every ingress sends the
adapter's path with its requests (a replica started later registers it on first use), and after an
unload's 200 none does. If the registry's actor restarts, the first ingress that polls it gives it
the registrations it kept (`RegistryBook.restore`). A registry that cannot be reached makes loads
and unloads a 503 (`RegistryUnavailableError`); requests keep being served from each ingress's copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Protocol

from ray import serve

from lora_cluster.errors import RegistryUnavailableError
from lora_cluster.serve.http.registrations import (
    MAX_REGISTERED_ADAPTERS,
    AdapterRegistrations,
    RegistrationConflict,
    RegistryBook,
)
from lora_cluster.serve.ops.background import keep_running, within

log = logging.getLogger(__name__)

POLL_S = 10.0  # a long poll answers at the latest after this long (then the ingress polls again)
APPLY_WAIT_S = 5.0  # a load or unload waits at most this long for every ingress to apply it
CALL_TIMEOUT_S = 10.0  # a registry call not answered within this long is a 503
RETRY_S = 1.0  # pause before polling again after a failed poll


class CatalogSink(Protocol):
    """What learns of registrations made through other ingresses (`group_bases.AdapterCatalog`)."""

    def register(self, base: str, adapter_id: str) -> None: ...

    def unregister(self, adapter_id: str) -> None: ...


class Registrations(Protocol):
    """The ingress's registrations (see `registrations` for the reserve/settle protocol)."""

    @property
    def changes(self) -> int:
        """Grows with every change of the registered names (`adapter_versions` rebuilds on it)."""
        ...

    def path(self, name: str) -> str | None: ...

    def snapshot(self) -> dict[str, str]: ...

    async def reserve_load(self, name: str) -> None: ...

    async def complete_load(self, name: str, path: str, base: str | None = None) -> None: ...

    async def reserve_unload(self, name: str) -> bool: ...

    async def release(self, name: str) -> None: ...


class LocalRegistrations:
    """The registrations in this process (one ingress replica). No method awaits, so each check and
    its reservation stay atomic on the event loop."""

    def __init__(self, registrations: AdapterRegistrations | None = None):
        self.registrations = registrations or AdapterRegistrations()

    @property
    def changes(self) -> int:
        return self.registrations.changes

    def path(self, name: str) -> str | None:
        return self.registrations.path(name)

    def snapshot(self) -> dict[str, str]:
        return self.registrations.snapshot()

    async def reserve_load(self, name: str) -> None:
        self.registrations.reserve_load(name)

    async def complete_load(self, name: str, path: str, base: str | None = None) -> None:
        self.registrations.complete_load(name, path)

    async def reserve_unload(self, name: str) -> bool:
        return self.registrations.reserve_unload(name)

    async def release(self, name: str) -> None:
        self.registrations.release(name)


class SharedRegistrations:
    """The `AdapterRegistry` deployment through its handle, with this ingress's copy (module docstring).
    `catalog`: told of every name registered or unregistered (several base models), whichever
    ingress did it."""

    def __init__(self, handle: Any, catalog: CatalogSink | None = None, timeout_s: float = CALL_TIMEOUT_S):
        self._handle, self._catalog, self.timeout_s = handle, catalog, timeout_s
        self.subscriber = f"ingress-{uuid.uuid4().hex[:12]}"
        self._entries: dict[str, tuple[str, str | None]] = {}
        self.version, self.epoch = -1, None
        self.changes = 0  # entries taken from the registry so far
        self._poller: asyncio.Task[None] | None = None

    def path(self, name: str) -> str | None:
        self.start()
        entry = self._entries.get(name)
        return None if entry is None else entry[0]

    def snapshot(self) -> dict[str, str]:
        self.start()
        return {name: path for name, (path, _) in self._entries.items()}

    def start(self) -> None:
        """Follow the registry from now on (again if the poll task ended). Called off an event loop,
        it does nothing: the first call on one starts it."""
        self._poller = keep_running(self._poller, self._follow)

    async def reserve_load(self, name: str) -> None:
        self.start()
        reply = await self._call("reserve_load", self.subscriber, name)
        if "conflict" in reply:
            raise RegistrationConflict(reply["conflict"], reply["code"])

    async def complete_load(self, name: str, path: str, base: str | None = None) -> None:
        self._apply(await self._call("complete_load", self.subscriber, name, path, base))

    async def reserve_unload(self, name: str) -> bool:
        self.start()
        reply = await self._call("reserve_unload", self.subscriber, name)
        self._apply(reply)
        return bool(reply["unloaded"])

    async def release(self, name: str) -> None:
        """Runs to its end even when the request that settles goes away. A release that fails is
        logged: the name stays busy until the registry's `busy_ttl_s` frees it."""
        try:
            await asyncio.shield(self._call("release", name))
        except RegistryUnavailableError as exc:
            log.warning("adapter registry: releasing %r failed (%s)", name, exc)

    async def _call(self, method: str, *args: Any) -> Any:
        response = getattr(self._handle, method).remote(*args)
        try:
            return await within(response, self.timeout_s)
        except Exception as exc:
            cancel = getattr(response, "cancel", None)
            if cancel is not None:
                cancel()
            raise RegistryUnavailableError(
                f"the adapter registry cannot be reached ({type(exc).__name__}); retry the load or unload"
            ) from exc

    async def _follow(self) -> None:
        """Long-poll the registry for ever; a failed poll is retried after RETRY_S."""
        while True:
            try:
                reply = await self._handle.changes.remote(self.subscriber, self.version, self.epoch, POLL_S)
                restarted = reply["epoch"] != self.epoch and self._entries and reply["version"] == 0
                # a restarted registry: give it what this ingress kept (refused when another ingress
                # did so first: then take the registry's state)
                if restarted and await self._handle.restore.remote(self._entries):
                    continue
                self._apply(reply)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("adapter registry: poll failed (%s); retrying in %.0f s",
                            type(exc).__name__, RETRY_S)
                await asyncio.sleep(RETRY_S)

    def _apply(self, reply: dict[str, Any]) -> None:
        """Take the registry's entries when they are newer than this copy (or from a new registry)."""
        if reply["epoch"] == self.epoch and reply["version"] <= self.version:
            return
        entries = {name: (path, base) for name, (path, base) in reply["entries"].items()}
        if self._catalog is not None:
            for name in self._entries.keys() - entries.keys():
                self._catalog.unregister(name)
            for name, (_, base) in entries.items():
                if base is not None:
                    self._catalog.register(base, name)
        self._entries, self.version, self.epoch = entries, reply["version"], reply["epoch"]
        self.changes += 1


@serve.deployment(name="AdapterRegistry", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=10_000, health_check_period_s=2.0)
class AdapterRegistry:
    """Every ingress's registrations (one replica; every call runs on its event loop, and each
    check and its change happen between two awaits)."""

    def __init__(self, limit: int = MAX_REGISTERED_ADAPTERS):
        self.book = RegistryBook(time.monotonic, limit)
        self.epoch = uuid.uuid4().hex
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._condition():
            self._condition().notify_all()

    def _reply(self, **extra: Any) -> dict[str, Any]:
        return {"epoch": self.epoch, "version": self.book.version, "entries": self.book.entries(), **extra}

    async def reserve_load(self, subscriber: str, name: str) -> dict[str, Any]:
        try:
            self.book.reserve_load(name, subscriber)
        except RegistrationConflict as exc:
            return {"conflict": str(exc), "code": exc.code}
        return {}

    async def complete_load(self, subscriber: str, name: str, path: str, base: str | None) -> dict[str, Any]:
        version = self.book.complete_load(name, path, base)
        self.book.heard(subscriber, version)  # the caller applies the reply itself
        await self._notify()
        await self._applied(version)
        return self._reply()

    async def reserve_unload(self, subscriber: str, name: str) -> dict[str, Any]:
        version = self.book.reserve_unload(name, subscriber)
        if version is None:
            return self._reply(unloaded=False)
        self.book.heard(subscriber, version)
        await self._notify()
        await self._applied(version)
        return self._reply(unloaded=True)

    async def release(self, name: str) -> None:
        self.book.release(name)

    async def restore(self, entries: dict[str, tuple[str, str | None]]) -> bool:
        restored = self.book.restore(entries)
        if restored:
            await self._notify()
        return restored

    async def changes(self, subscriber: str, version: int, epoch: str | None,
                      timeout_s: float) -> dict[str, Any]:
        """The entries once they differ from `version` of `epoch` (at once when they do already), or
        after `timeout_s`; records that `subscriber` has applied `version`."""
        if epoch == self.epoch:
            self.book.heard(subscriber, version)
            await self._notify()  # a load or unload may be waiting for this subscriber
        condition = self._condition()
        async with condition:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(condition.wait_for(
                    lambda: epoch != self.epoch or self.book.version != version), timeout_s)
        return self._reply()

    async def _applied(self, version: int) -> None:
        """Wait until every live subscriber has applied `version`, at most APPLY_WAIT_S."""
        condition = self._condition()
        async with condition:
            try:
                await asyncio.wait_for(condition.wait_for(lambda: not self.book.lagging(version)),
                                       APPLY_WAIT_S)
            except TimeoutError:
                log.warning("adapter registry: ingresses %s did not apply version %d within %.0f s",
                            self.book.lagging(version), version, APPLY_WAIT_S)

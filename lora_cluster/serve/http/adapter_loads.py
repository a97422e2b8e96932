"""Loading and unloading adapters by name on every replica: vLLM's load/unload calls and the
releases' candidates share it.

A load validates the name, reserves it (`registrations`: a concurrent load or unload of it is a
409), broadcasts `register_adapter` to every replica of its base and, if any refuses, unregisters it
from the others and raises the first refusal (naming the base with several bases). Versions
(`adapter_versions`): the first load of a name is version 1, registered as the name; a load in place
of a loaded name is its next version `name@N`, and the oldest versions beyond
`release_versions_kept` are retired (unloaded), except those a running release uses. An
unload of `name` unloads every version of it (and forgets its releases), of `name@N` that version
(a 409 while a running release uses it).

With a durable release state (`release_state`), the versions kept after each load and unload are
written beside the releases, so that a restarted ingress serves them again; a write that fails is
logged and does not undo the load (the next load, unload or release writes every kept version).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from lora_cluster.errors import AdapterError, ReleaseStateUnavailableError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.refs import parse_ref
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.serve.http.adapter_versions import replica_id_of
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registrations import RegistrationConflict
from lora_cluster.serve.http_errors import ApiError, ApiException, bad_request, conflict, not_found
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher

log = logging.getLogger(__name__)


class AdapterLoads:
    """Loads and unloads through one ingress's context (module docstring); the versions a running
    release uses are never retired, and an unload of a name forgets its releases."""

    def __init__(self, ctx: ApiContext):
        self.ctx, self.dispatcher, self.releases = ctx, ctx.dispatcher, ctx.releases

    def next_version(self, name: str, inplace: bool) -> int:
        """The version a load of `name` would create: 400 for a `name@N` (the load gives numbers),
        409 for a loaded name without `inplace`."""
        try:
            check_adapter_id(name)
        except AdapterError as exc:
            raise bad_request(str(exc)) from exc
        if parse_ref(name)[1] is not None:
            raise bad_request(f"{name!r}: a load gives the version number; load the bare name with "
                              "load_inplace to create the next version")
        kept = self.ctx.models.versions.versions(name)
        if kept and not inplace:
            raise conflict(f"the LoRA adapter {name!r} has already been loaded; load it with "
                           "load_inplace to create its next version", code="already_loaded")
        return kept[-1] + 1 if kept else 1

    async def load(self, name: str, path: str, inplace: bool) -> int:
        """Load `path` as the next version of `name` on every replica; returns its number."""
        number = self.next_version(name, inplace)
        kept = self.ctx.models.versions.versions(name)
        await self._register(replica_id_of(name, number), path)
        await self._retire(name, [*kept, number])
        await self._save(lambda book: None)
        return number

    async def unload(self, ref: str) -> None:
        """Unload `name` (every version) or `name@N` (that one); 404 when nothing of it is loaded."""
        name, number = parse_ref(ref)
        if number is not None and number in self.releases.protected(name):
            raise conflict(f"{ref!r} is in a running release of {name!r}; roll it back or promote it first",
                           code="release_conflict")
        kept = self.ctx.models.versions.versions(name)
        ids = [replica_id_of(name, n) for n in kept] if number is None else [replica_id_of(name, number)]
        unloaded = [await self._unregister(replica_id) for replica_id in ids]
        if not any(unloaded):
            raise not_found(f"the LoRA adapter {ref!r} cannot be found", code="adapter_not_found")
        await self._save(lambda book: book.forget(name) if number is None else None)

    async def _save(self, change: Callable[[ReleaseBook], object]) -> None:
        """Apply `change` to the releases and write the versions kept now (module docstring)."""
        state = self.ctx.release_state
        try:
            await state.transact(change, versions=self.ctx.registrations.snapshot())
        except ReleaseStateUnavailableError as exc:
            log.warning("adapter versions not written to the release state: %s", exc)

    async def _retire(self, name: str, kept: list[int]) -> None:
        """Unload the oldest versions of `name` beyond `release_versions_kept` (not those kept)."""
        keep = set(self.releases.protected(name))
        retirable = [n for n in kept if n not in keep]
        excess = len(kept) - self.ctx.config.releases.release_versions_kept
        for number in retirable[:max(0, excess)]:
            await self._unregister(replica_id_of(name, number))

    async def _register(self, name: str, path: str) -> None:
        """Register `name` (a replica adapter id) with `path` on every replica of its base."""
        try:
            await self.ctx.registrations.reserve_load(name)
        except RegistrationConflict as exc:
            raise conflict(str(exc), code=exc.code) from exc
        loaded = False
        dispatcher = self.dispatcher
        grouped = dispatcher if isinstance(dispatcher, GroupedDispatcher) else None
        try:
            base = None if grouped is None else await grouped.registration_base(name)
            if base is None:
                results = await dispatcher.broadcast("register_adapter", name, path)
            else:  # several base models: the groups of the adapter's base only
                results = await grouped.broadcast_base(base, "register_adapter", name, path)
            await self._undo_if_refused(name, results, base)
            await self.ctx.registrations.complete_load(name, path, base)
            if base is not None:
                grouped.catalog.register(base, name)
            loaded = True
        finally:
            if not loaded:
                await self.ctx.registrations.release(name)

    async def _unregister(self, name: str) -> bool:
        """Unregister one replica adapter id from every replica; False when it was not registered."""
        if not await self.ctx.registrations.reserve_unload(name):
            return False
        try:
            await self.dispatcher.broadcast("unregister_adapter", name)
            if isinstance(self.dispatcher, GroupedDispatcher):
                self.dispatcher.catalog.unregister(name)
        finally:
            await self.ctx.registrations.release(name)
        return True

    async def _undo_if_refused(self, name: str, results: dict[str, Any], base: str | None) -> None:
        """When a replica refused the adapter: unregister it from those that took it and raise the
        first refusal (naming the base that refused it, with several bases)."""
        failed = [r["error"] for r in results.values() if "error" in r]
        if not failed:
            return
        for rid, r in results.items():
            if "error" not in r:
                await self.dispatcher.call(rid, "unregister_adapter", name)
        error = ApiError.from_dict(failed[0])
        if base is not None:  # which base refused it, by its API name
            error = dataclasses.replace(error, message=f"{error.message} (registering on base model "
                                        f"{base!r})")
        raise ApiException(error)

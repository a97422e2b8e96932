"""The releases every ingress follows: the ingress's `ReleaseBook` kept in step with the durable
release state (`releases.state_store`, the `release_state_uri` config field), and the versions of
the adapters loaded through the API written beside it.

Reads and writes (`transact`): read the document, rebuild the book from it plus this ingress's live
evidence not written yet (`ReleaseBook.adopt`), apply the change (a release API call, or nothing but
judging the steps), and write the document over the version read (compare-and-swap). When another
ingress wrote first, the whole round is done again, at most `TRIES` times (then a 503,
`ReleaseStateUnavailableError`); a domain error of the change (a 409, a 404) writes nothing.

Freshness: every release API call reads the document first, so it sees every decision made
through any ingress. The traffic split between two calls is this ingress's copy, refreshed (and its
evidence written) every `release_sync_s` by a background task: an ingress follows a step decided
elsewhere at most `release_sync_s` (plus one read) late. Locally counted evidence acts at once on
this ingress's copy (a failing candidate stops getting this ingress's traffic before the next write).

Versions: a version registered through another ingress (the shared registrations follow it at
once) may be the candidate of a release this ingress has not read yet; so the bare name moves only
to versions this ingress has read in the document (`ReleaseBook.known`), and the document holds a
release before its candidate's version (`releases_api`). A load in place without a release moves
the bare name on every ingress within `release_sync_s`.

Eval gates: a release's eval gate runs at one ingress, which holds its lease in the document
(`releases.lease`; `gate` marks the gates running here) and renews it with every sync. Each sync
also takes the expired leases of gates whose ingress died (`ReleaseBook.hold`) and runs those gates
again through the `GateRunner` the routes wire in (`on_takeover`), so no release is left
evaluating: at most `release_lease_s` plus one sync after its ingress died, another ingress runs it.

Restart: the ingress reads the document when it starts (`load`): running releases resume at their
step, with their events, and the versions kept there are registered again (a replica registers one
on its first request, as after any load). Without `release_state_uri` the book is this ingress's
memory only (`durable` is False) and nothing is read or written. The store's calls block: they run
on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

from lora_cluster.errors import ReleaseStateUnavailableError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.state_store import StateConflict, StateStore
from lora_cluster.serve.http.adapter_versions import index_entries
from lora_cluster.serve.http.registrations import RegistrationConflict
from lora_cluster.serve.http.registry import LocalRegistrations, Registrations
from lora_cluster.serve.ops.background import keep_running
from lora_cluster.serve.ops.logs import detached

log = logging.getLogger(__name__)
T = TypeVar("T")
TRIES = 8  # rounds of read, change and conditional write before a 503


class GateRunner(Protocol):
    """Runs the eval gate of a release this ingress took over (`releases_api.ReleaseRoutes`)."""

    def __call__(self, name: str, release_id: str) -> Awaitable[object]: ...


class SharedReleases:
    """One ingress's view of the shared release state (module docstring); `owner`: this ingress's
    name in the eval gates' leases (default: a random one per process)."""

    def __init__(self, book: ReleaseBook, store: StateStore | None, registrations: Registrations,
                 sync_s: float, lease_s: float = 30.0, owner: str | None = None):
        self.book, self.store, self.registrations, self.sync_s = book, store, registrations, sync_s
        self.lease_s, self.owner = lease_s, owner or f"ingress-{uuid.uuid4().hex[:12]}"
        self._versions: dict[str, str] = {}  # the document's, as last read
        self._restored = False
        self._task: asyncio.Task[None] | None = None
        self._gates: set[str] = set()  # release ids whose eval gate runs here (at most one per name)
        self._takeovers: dict[str, asyncio.Task[object]] = {}  # the gates run again here, by release id
        self._runner: GateRunner | None = None

    def on_takeover(self, runner: GateRunner) -> None:
        """Who runs the eval gate of a release this ingress takes over (the release routes)."""
        self._runner = runner

    @contextlib.contextmanager
    def gate(self, release_id: str) -> Iterator[None]:
        """The block runs the eval gate of `release_id` here: its lease is renewed meanwhile."""
        self._gates.add(release_id)
        try:
            yield
        finally:
            self._gates.discard(release_id)

    @property
    def durable(self) -> bool:
        return self.store is not None

    @property
    def kind(self) -> str:
        """Where the state is kept, as the releases API names it: folder, s3 or memory."""
        return "memory" if self.store is None else self.store.kind

    def load(self) -> None:
        """At the ingress's start (blocking; off the event loop): the document's releases, and the
        versions it keeps registered here when the registrations are this process's."""
        if self.store is None:
            return
        document, _ = self.store.read()
        document = document or {}
        self.book.restore(document)
        self._know(dict(document.get("versions", {})))
        if isinstance(self.registrations, LocalRegistrations):
            local = self.registrations.registrations
            for adapter_id, path in self._versions.items():
                if local.path(adapter_id) is None:
                    local.reserve_load(adapter_id)
                    local.complete_load(adapter_id, path)
            self._restored = True

    def start(self) -> None:
        """Keep the background sync running (from the first call on the event loop; a no-op
        without a store)."""
        if self.store is not None:
            self._task = keep_running(self._task, self._follow)

    def stop(self) -> None:
        """Stop the background sync and the gates taken over (the ingress goes away; their leases
        lapse and another ingress takes them)."""
        if self._task is not None:
            self._task.cancel()
        for task in self._takeovers.values():
            task.cancel()

    async def transact(self, change: Callable[[ReleaseBook], T], versions: dict[str, str] | None = None) -> T:
        """`change(book)` on the freshest state, written back (module docstring); `versions`: the
        adapter versions to keep from now on (None: those the document has)."""
        if self.store is None:
            return change(self.book)
        self.start()
        for _ in range(TRIES):
            document, tag = await asyncio.to_thread(self.store.read)
            document = document or {}
            taken = self.book.take_pending()
            self.book.adopt(document, taken)
            kept = dict(document.get("versions", {}))
            self._know(kept)
            try:
                result = change(self.book)
            except BaseException:
                self.book.give_back(taken)
                raise
            new = {"releases": self.book.to_dict()["releases"],
                   "versions": kept if versions is None else versions}
            if new["releases"] == document.get("releases", {}) and new["versions"] == kept:
                return result  # nothing to write
            try:
                await asyncio.to_thread(self.store.write, new, tag)
            except StateConflict:
                self.book.give_back(taken)
                continue
            except BaseException:
                self.book.give_back(taken)
                raise
            self._know(new["versions"])
            return result
        raise ReleaseStateUnavailableError(self.store.where,
                                           f"other ingresses changed it {TRIES} times in a row")

    def _know(self, versions: dict[str, str]) -> None:
        """The versions the document keeps, as the book's alias policy reads them (`ReleaseBook.alias`)."""
        self._versions = versions
        self.book.known = index_entries(versions)

    async def sync(self) -> None:
        """One round: the document's decisions in, this ingress's evidence out, every step judged,
        the eval gates' leases renewed and the expired ones taken (their gates run again here)."""
        await self._restore_versions()

        def judge(book: ReleaseBook) -> list[tuple[str, str]]:
            book.tick()
            return book.hold(self.owner, set(self._gates), self.lease_s)

        for name, release_id in await self.transact(judge):
            self._take_over(name, release_id)

    def _take_over(self, name: str, release_id: str) -> None:
        """Run the eval gate of a release taken over, once at a time per release; without a runner
        (no release routes) the lease lapses again and another ingress takes it."""
        running = self._takeovers.get(release_id)
        if self._runner is None or (running is not None and not running.done()):
            return
        for done in [k for k, task in self._takeovers.items() if task.done()]:
            del self._takeovers[done]
        runner = self._runner

        async def run() -> object:
            try:
                return await runner(name, release_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the gate wrote its failure; a lost write lapses the lease again
                log.warning("releases: the eval gate of %s taken over failed (%s)", release_id,
                            type(exc).__name__)
                return None

        self._takeovers[release_id] = asyncio.get_running_loop().create_task(run(), context=detached())

    async def _restore_versions(self) -> None:
        """Registrations shared through the `AdapterRegistry`: after a restart of every ingress and
        the registry, the document's versions are registered again (once; a name another ingress
        restored first is left as it is)."""
        if self._restored:
            return
        current = self.registrations.snapshot()
        for adapter_id, path in self._versions.items():
            if adapter_id in current:
                continue
            try:
                await self.registrations.reserve_load(adapter_id)
            except RegistrationConflict:
                continue
            done = False
            try:
                await self.registrations.complete_load(adapter_id, path)
                done = True
            finally:
                if not done:
                    await self.registrations.release(adapter_id)
        self._restored = True

    async def _follow(self) -> None:
        """Sync every `sync_s` for ever; a failed round is logged and tried again at the next."""
        while True:
            await asyncio.sleep(self.sync_s)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("releases: syncing with %s failed (%s)", getattr(self.store, "where", "?"),
                            type(exc).__name__)

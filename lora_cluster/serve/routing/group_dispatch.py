"""The ingress's dispatcher over replica groups: each request goes to its group's replicas only.

`GroupedDispatcher` offers the routes the same calls as `dispatch.Dispatcher` (start, start_all,
call, any_replica, broadcast, replica_stats, cluster_view) over one `Dispatcher` per replica group
(see `replica_groups`). A generation is sent through the dispatcher of the group that
`select_group` picks for its adapter and tenant: that dispatcher holds the handle of the group's own
deployment (whose request router only knows the group's replicas) and the group's own cluster
admission (whose controller only knows them too), so neither the router nor a cluster-queue grant
can send it elsewhere. An adapter that no group serves is a 404, as an unknown adapter is. A merged
adapter (`merged_adapters`) goes to the group that serves every adapter of the merge, and is a 400
naming each adapter's group when no group does (`replica_groups.select_merge_group`).
Admin calls (adapter registration, stats, health) reach the replicas of every group.

Several base models (`group_bases`): a request without adapter goes to a group of the base its
`model` names (`GenerateJob.base`); an adapter, or a merge of adapters, to a group of the base
whose groups list it (`group_bases.select_for`, `merge_groups`). The listing (`catalog`) is
refreshed from one replica of each group when it is older than its `max_age_s` and a request for
an adapter needs it, one refresh at a time; a failed refresh keeps the previous listing.
A one-base cluster never refreshes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.errors import AdapterBaseConflictError, AdapterNotFoundError, RequestError
from lora_cluster.serve.http_errors import ApiException, NoReplicaError, describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.serve.routing.group_bases import (
    AdapterCatalog,
    merge_groups,
    registration_base,
    select_for,
    several_bases,
)
from lora_cluster.serve.routing.replica_groups import ReplicaGroup, select_merge_group

log = logging.getLogger(__name__)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("refreshing the adapters of each base failed: %s", task.exception())


class GroupedDispatcher:
    """`Dispatcher`'s calls over several groups, each with its own `Dispatcher` (at least one)."""

    def __init__(self, groups: Sequence[tuple[ReplicaGroup, Dispatcher]],
                 catalog: AdapterCatalog | None = None):
        if not groups:
            raise ValueError("a GroupedDispatcher needs at least one replica group")
        self.groups = [group for group, _ in groups]
        self._dispatchers = {group.name: dispatcher for group, dispatcher in groups}
        self.catalog = catalog or AdapterCatalog(time.monotonic)
        self.several_bases = several_bases(self.groups)
        self._refresh: asyncio.Task | None = None

    @property
    def bases(self) -> list[str]:
        """The base models' API names, in configuration order."""
        return list(dict.fromkeys(group.base for group in self.groups))

    async def listings(self) -> dict[str, list[str]]:
        """{base: adapters listed by one replica of each of its groups} (a group without a running
        replica lists nothing); refreshes the catalog with it when it has several bases."""
        async def listed(group: ReplicaGroup) -> list[str]:
            dispatcher = self._dispatchers[group.name]
            if dispatcher.replica_stats() == {}:
                return []
            try:
                return list(await dispatcher.any_replica("list_adapters"))
            except ApiException as exc:
                log.info("group %s lists no adapters now: %s", group.name, exc.error.message)
                return []

        results = await asyncio.gather(*(listed(g) for g in self.groups))
        by_base: dict[str, list[str]] = {base: [] for base in self.bases}
        for group, ids in zip(self.groups, results, strict=True):
            by_base[group.base].extend(ids)
        if self.several_bases:
            self.catalog.replace(by_base)
        return {base: list(dict.fromkeys(ids)) for base, ids in by_base.items()}

    async def _fresh_catalog(self, ids: Sequence[str | None]) -> None:
        """Refresh a stale catalog (several bases only), one refresh at a time for all callers. A job
        whose adapters (`ids`) the stale listing already places does not wait for it (it refreshes
        behind); one it does not place waits, so a new adapter is found. A refresh that fails is
        logged and the previous listing kept."""
        if not self.several_bases or not self.catalog.stale():
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self.listings())
            self._refresh.add_done_callback(_log_failure)
        if all(self.catalog.bases_of(str(a)) for a in ids):
            return
        with contextlib.suppress(Exception):  # logged by its callback; the old listing stays
            await asyncio.shield(self._refresh)

    def dispatcher(self, group: str) -> Dispatcher:
        """The dispatcher of one group, by name."""
        return self._dispatchers[group]

    def group_for(self, adapter_id: str | None, tenant: str | None = None,
                  base: str | None = None) -> ReplicaGroup:
        """The group serving this adapter (or, without one, this base) and tenant; ApiException 404
        when no group serves the adapter, 409 when it is listed under two bases."""
        try:
            group = select_for(self.groups, base=base, adapter_id=adapter_id, tenant=tenant,
                               catalog=self.catalog)
        except AdapterBaseConflictError as exc:
            raise ApiException(describe(exc)) from None
        if group is None:
            reason = "not found (no replica group serves it)"
            raise ApiException(describe(AdapterNotFoundError(str(adapter_id), reason)))
        return group

    def _group_of(self, adapter_id: str | None, tenant: str | None, base: str | None,
                  merged: Sequence[str] | None) -> ReplicaGroup:
        if merged is None:
            return self.group_for(adapter_id, tenant, base)
        try:
            candidates = merge_groups(self.groups, merged, self.catalog)
            if base is not None and self.several_bases:  # the base its prompt was tokenized for
                candidates = [g for g in candidates if g.base == base] or candidates
            return select_merge_group(candidates, merged, tenant)
        except (AdapterNotFoundError, RequestError, AdapterBaseConflictError) as exc:
            raise ApiException(describe(exc)) from None

    def _for_job(self, job: GenerateJob) -> Dispatcher:
        merged = None if job.merge is None else job.merge.ids
        group = self._group_of(job.adapter_id, job.tenant, job.base, merged)
        if job.base is not None and self.several_bases and group.base != job.base:
            raise ApiException(describe(AdapterBaseConflictError(
                str(job.adapter_id), f"is now listed under base model {group.base!r}, not {job.base!r} "
                "that its prompt was tokenized for; send the request again")))
        return self._dispatchers[group.name]

    async def base_of(self, adapter_id: str | None, tenant: str | None = None, base: str | None = None,
                      merged: Sequence[str] | None = None) -> str:
        """The API name of the base model a request runs on: that of the group `start` would pick for
        its adapter (or merge of adapters `merged`), tenant and named `base` (refreshing a stale
        catalog as `start` does); the ingress tokenizes its prompt with that base's tokenizer and
        sends the job with `base` set to it. ApiException 404/409/400 as `start` raises them."""
        if adapter_id is not None or merged is not None:
            await self._fresh_catalog(merged if merged is not None else (adapter_id,))
        return self._group_of(adapter_id, tenant, base, merged).base

    async def start(self, job: GenerateJob, route: str) -> Generation:
        """Start `job` on a replica of its group (see `Dispatcher.start`)."""
        if job.adapter_id is not None:
            await self._fresh_catalog(job.merge.ids if job.merge is not None else (job.adapter_id,))
        return await self._for_job(job).start(job, route)

    async def start_all(self, jobs: list[GenerateJob], route: str,
                        on_started: Callable[[Generation], None] | None = None) -> list[Generation]:
        """Start the jobs of one request (one adapter, one tenant: one group); see `Dispatcher.start_all`."""
        if not jobs:
            return []
        if jobs[0].adapter_id is not None:
            job = jobs[0]
            await self._fresh_catalog(job.merge.ids if job.merge is not None else (job.adapter_id,))
        return await self._for_job(jobs[0]).start_all(jobs, route, on_started)

    def replica_stats(self) -> dict[str, RoutingStats] | None:
        """Last reports of every group's replicas (replica ids are unique across deployments); None
        until some group's router exists."""
        merged: dict[str, RoutingStats] | None = None
        for dispatcher in self._dispatchers.values():
            stats = dispatcher.replica_stats()
            if stats is not None:
                merged = {**(merged or {}), **stats}
        return merged

    def group_of_replica(self, replica_id: str) -> str | None:
        """The group whose router lists this replica (None: unknown, or no report yet)."""
        for name, dispatcher in self._dispatchers.items():
            if replica_id in (dispatcher.replica_stats() or {}):
                return name
        return None

    async def call(self, replica_id: str, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Call `method` on that replica, through its group's deployment."""
        group = self.group_of_replica(replica_id)
        if group is None:
            raise ApiException(describe(NoReplicaError(f"replica {replica_id} is not running")))
        return await self._dispatchers[group].call(replica_id, method, *args, timeout_s=timeout_s)

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Call `method` on one replica: of the first group that answers, in configuration order."""
        error: ApiException | None = None
        for dispatcher in self._dispatchers.values():
            if dispatcher.replica_stats() == {}:  # its router knows it has no replica
                continue
            try:
                return await dispatcher.any_replica(method, *args, timeout_s=timeout_s)
            except ApiException as exc:
                error = exc
        raise error or ApiException(describe(NoReplicaError("no LoRA replica is running")))

    async def broadcast_base(self, base: str, method: str, *args: Any) -> dict[str, Any]:
        """`broadcast`, to the replicas of the groups of one base model only."""
        chosen = [self._dispatchers[g.name] for g in self.groups if g.base == base]
        results = await asyncio.gather(*(d.broadcast(method, *args) for d in chosen))
        return {rid: result for group_results in results for rid, result in group_results.items()}

    async def registration_base(self, adapter_id: str) -> str | None:
        """The base a run-time registration of `adapter_id` joins (None: one base, every group);
        ApiException 409 when another base lists the id (`group_bases.registration_base`)."""
        if not self.several_bases:
            return None
        await self.listings()  # what every base lists now, not up to max_age_s ago
        try:
            return registration_base(self.groups, adapter_id, self.catalog)
        except AdapterBaseConflictError as exc:
            raise ApiException(describe(exc)) from None

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        """Call `method` on every running replica of every group; {replica id: result}."""
        results = await asyncio.gather(*(d.broadcast(method, *args) for d in self._dispatchers.values()))
        return {rid: result for group_results in results for rid, result in group_results.items()}

    async def cluster_view(self) -> dict[str, Any]:
        """The cluster controller's view (GET /v1/cluster). One group: its controller's view. Several:
        `{"groups": {name: view}}`, each group's view in the one-group shape."""
        if len(self.groups) == 1:
            return await self._dispatchers[self.groups[0].name].cluster_view()
        views = await asyncio.gather(*(d.cluster_view() for d in self._dispatchers.values()))
        return {"groups": dict(zip(self._dispatchers, views, strict=True))}

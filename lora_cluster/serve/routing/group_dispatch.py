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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.errors import AdapterNotFoundError, RequestError
from lora_cluster.serve.http_errors import ApiException, NoReplicaError, describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.serve.routing.replica_groups import ReplicaGroup, select_group, select_merge_group


class GroupedDispatcher:
    """`Dispatcher`'s calls over several groups, each with its own `Dispatcher` (at least one)."""

    def __init__(self, groups: Sequence[tuple[ReplicaGroup, Dispatcher]]):
        if not groups:
            raise ValueError("a GroupedDispatcher needs at least one replica group")
        self.groups = [group for group, _ in groups]
        self._dispatchers = {group.name: dispatcher for group, dispatcher in groups}

    def dispatcher(self, group: str) -> Dispatcher:
        """The dispatcher of one group, by name."""
        return self._dispatchers[group]

    def group_for(self, adapter_id: str | None, tenant: str | None = None) -> ReplicaGroup:
        """The group serving this adapter and tenant; ApiException 404 when no group serves the adapter."""
        group = select_group(self.groups, adapter_id, tenant)
        if group is None:
            reason = "not found (no replica group serves it)"
            raise ApiException(describe(AdapterNotFoundError(str(adapter_id), reason)))
        return group

    def _for_job(self, job: GenerateJob) -> Dispatcher:
        if job.merge is None:
            return self._dispatchers[self.group_for(job.adapter_id, job.tenant).name]
        try:
            group = select_merge_group(self.groups, job.merge.ids, job.tenant)
        except (AdapterNotFoundError, RequestError) as exc:
            raise ApiException(describe(exc)) from None
        return self._dispatchers[group.name]

    async def start(self, job: GenerateJob, route: str) -> Generation:
        """Start `job` on a replica of its group (see `Dispatcher.start`)."""
        return await self._for_job(job).start(job, route)

    async def start_all(self, jobs: list[GenerateJob], route: str,
                        on_started: Callable[[Generation], None] | None = None) -> list[Generation]:
        """Start the jobs of one request (one adapter, one tenant: one group); see `Dispatcher.start_all`."""
        if not jobs:
            return []
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

"""The ingress's side of the replicas: start generations, read their streams, reach every replica.

`Dispatcher.start(job)` sends a job to the LoRA replicas (the request router picks the replica)
and waits for its first item, so that the HTTP status and the routing headers are known before any
byte is sent: a failure before the first token (unknown adapter, prompt too long, overload)
becomes a proper error response even for `stream: true`.

Faults: a job whose replica dies or is unreachable before the first item is sent again (the router
then picks another replica; a cluster-queue grant is dropped), up to `MAX_ATTEMPTS` tries; a
non-streaming job's first item is its whole result, so it is retried whole. A stream whose replica
dies after the first item ends with that error (an SSE error event). Every outcome feeds the
routing-error breaker (`routing_guard`), which sheds new requests with 503 while it is open.

Usage of a lost replica's request: the replica that died cannot record it, so the dispatcher hands
it to `lost` (wired by the ingress: `usage_refusals.RefusalMeter.lost`) with the last item passed on
to the caller (mid-stream), or none (every try failed before a first item): the request's one usage
record then holds the tokens the client received.

Usage of a request whose client went away: its replica may never have run it, or may be killed
before it records the cancellation, and it counts what it produced, not what the client received. So
the dispatcher hands the request to `delivered` (wired by the ingress:
`usage_refusals.RefusalMeter.delivered`) when the caller is cancelled before the first item (`start`:
nothing was handed on; or its replica call is cancelled under it, `is_cancellation`; also after a try
whose replica died, during the pause before the retry or
while the retry runs, where no replica may be left to record it), and when the ingress cancels a
generation not yet ended (`Generation.cancel`: its stream closed because the client left, or a
sibling choice failed; the tokens of the last item passed on, 0 if none). Its part's tokens and
outcome win over the replica's record (`tenancy.usage_record.merge`). A generation that ended (its
final item, an error item, a failed or lost replica call) adds no delivered part.

Seats: a started job's in-flight count in the cluster admission comes back when its replica ends
it, whether or not the caller has read it (`generation`: a non-streaming job's as it starts, a
stream's read ahead to its end), so a fan-out with more choices than the replicas' seats is never
held up by its own unread choices.

Fan-out (`start_all`: `n > 1`, several prompts; also one choice): the choices start concurrently,
each in its own task; a choice whose task is cancelled before its first step (the client went away
while `start_all` made them) never reaches `start`, so `start_all` adds its delivered part of nothing:
every accepted job leaves exactly one record. However the start ends (a choice fails, or the caller
is cancelled, e.g. the client went away, at any await), every choice that had started is cancelled
(its replica aborts it), and its `on_done` runs (the cluster admission's in-flight count for its
replica comes down); a choice still starting is cancelled before it reaches a replica or right after
its first item. The caller learns of each choice as soon
as it starts (`on_started`), so that the tokens of choices cancelled before `start_all` returns are
charged too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.errors import RoutingUnavailableError
from lora_cluster.serve.http_errors import ApiError, ApiException, NoReplicaError, describe
from lora_cluster.serve.ops import metrics
from lora_cluster.serve.ops.generation_metrics import GenerationMetrics, routing_decision
from lora_cluster.serve.ops.ray_internals import own_request_id
from lora_cluster.serve.protocol import GenerateJob, ToReplica
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.serve.routing.generation import Generation, cancel_call, is_cancellation
from lora_cluster.serve.routing.replica_tables import replica_stats
from lora_cluster.serve.routing.routing_guard import RoutingGuard, is_routing_error

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # tries of a job whose replica fails before its first item (see `Dispatcher.start`)
RETRY_PAUSE_S = 0.2  # times the attempt number, before a retry (Serve drops a dead replica meanwhile)

HEADER_REPLICA = "x-lora-replica"
HEADER_HIT = "x-lora-adapter-hit"
HEADER_CACHED = "x-lora-cached-tokens"


class Dispatcher:
    """Sends jobs to the replicas. With a cluster controller, `admission` decides per job whether it
    goes at once (a replica has room) or waits in the cluster queue for a granted replica."""

    def __init__(self, handle: Any, app_name: str, admission: ClusterAdmission | None = None,
                 guard: RoutingGuard | None = None,
                 lost: Callable[..., None] | None = None, delivered: Callable[..., None] | None = None):
        self._handle = handle
        self._lost = lost  # records a lost replica's request (see the module docstring)
        self._delivered = delivered  # records what the client of a request that it left received
        self.guard = guard or RoutingGuard(enabled=False)
        self._stream = handle.options(stream=True)
        self._key = (app_name, handle.deployment_name)
        self.admission = admission or ClusterAdmission(None, capacity=None, replica_stats=self.replica_stats,
                                                       timeout_s=1.0)

    def replica_stats(self) -> dict[str, RoutingStats] | None:
        """Last reports of the running replicas (None until the first call creates the router)."""
        return replica_stats(*self._key)

    async def cluster_view(self) -> dict[str, Any]:
        """The cluster controller's view of these replicas (GET /v1/cluster; see `ClusterAdmission`),
        each replica with its prefix cache's figures from its last routing report (`prefix_cache`,
        `RoutingStats.prefix_cache`; absent for a replica the router has no report of yet)."""
        view = await self.admission.cluster_view()
        stats = self.replica_stats() or {}
        for node in view.get("nodes", {}).values():
            for rid, replica in node.get("replicas", {}).items():
                figures = stats[rid].prefix_cache() if rid in stats else None
                if figures is not None:
                    replica["prefix_cache"] = figures
        return view

    def _check_replicas(self) -> None:
        stats = self.replica_stats()
        if stats is not None and not stats:
            metrics.ROUTING_ERRORS.inc()
            raise ApiException(describe(NoReplicaError("no LoRA replica is running")))

    async def start(self, job: GenerateJob, route: str) -> Generation:
        """Send `job` (at once, or once the cluster queue grants it a replica) and wait for its first
        item; raises ApiException with the request's error (429/503 from the cluster queue too, 503
        while the routing-error breaker sheds). A routing error before the first item (the replica
        died or is unreachable: nothing was sent to the client yet, and a non-streaming job's first
        item is its whole result) is retried on another replica, `MAX_ATTEMPTS` tries in all. A caller
        cancelled meanwhile (its client went away) adds the job's delivered part of nothing."""
        self._check_replicas()
        t0 = time.monotonic()
        try:
            self.guard.admit()
        except RoutingUnavailableError as exc:
            raise ApiException(describe(exc)) from None
        outcome_told = False
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                try:
                    generation = await self._start_once(job, route, t0)
                except ApiException as exc:
                    if is_cancellation(exc.__cause__):  # Serve cancelled the call: the client went away
                        self._record(self._delivered, job, "", None)
                        raise
                    routing = isinstance(exc.__cause__, BaseException) and is_routing_error(exc.__cause__)
                    if routing:
                        metrics.ROUTING_ERRORS.inc()
                    if not routing or attempt == MAX_ATTEMPTS:
                        if routing:
                            self.guard.outcome(True)
                            outcome_told = True
                            self._record(self._lost, job, "", None)
                        raise
                    metrics.RETRIES.inc()
                    log.warning("request %s: replica failed before its first item (%s); retrying on "
                                "another replica", job.request_id, exc.error.message)
                    job = dataclasses.replace(job, replica_id=None, ticket_id=None)
                    await asyncio.sleep(RETRY_PAUSE_S * attempt)
                    continue
                self.guard.outcome(False)
                outcome_told = True
                generation.on_routing_error = self._on_lost_mid_stream
                generation.on_cancelled = self._on_cancelled
                return generation
            raise AssertionError("unreachable")
        except asyncio.CancelledError:  # the client left before the first item (module docstring)
            self._record(self._delivered, job, "", None)
            raise
        finally:
            if not outcome_told:
                self.guard.abandoned()

    def _on_lost_mid_stream(self, generation: Generation) -> None:
        self.guard.outcome(True)
        self._record(self._lost, generation.job, generation.replica, generation.last)

    def _on_cancelled(self, generation: Generation) -> None:
        self._record(self._delivered, generation.job, generation.replica, generation.last)

    @staticmethod
    def _record(part: Callable[..., None] | None, job: GenerateJob, replica: str,
                item: dict[str, Any] | None) -> None:
        """Add a job's usage part through `part` (`RefusalMeter.lost` or `.delivered`, same keywords)."""
        if part is not None:
            part(request_id=job.request_id, tenant=job.tenant, adapter_id=job.adapter_id,
                 sla_class=job.priority_class, queued_s=job.queued_s, replica=replica, item=item)

    async def _start_once(self, job: GenerateJob, route: str, t0: float) -> Generation:
        meter = GenerationMetrics(job.adapter_id, job.tenant, job.priority_class, arrived_at=t0)
        parked = metrics.QUEUE_DEPTH.labels(job.priority_class)
        parked.inc()  # seen by a scrape only while the request actually waits (the fast path awaits nothing)
        try:
            granted = await self.admission.admit(sla_class=job.priority_class, adapter_id=job.adapter_id,
                                                 arrived_at=t0, prefix_of=lambda: job.routing_prefix)
        finally:
            parked.dec()
        meter.admitted()
        sent_at = time.monotonic()
        if granted is not None:
            job = dataclasses.replace(job, replica_id=granted.replica_id, ticket_id=granted.ticket_id,
                                      queued_s=sent_at - t0)
        pinned = granted is not None
        try:
            first, stream = await self._first_item(job)
        except BaseException:
            self.admission.not_started(granted)
            raise
        replica = first["replica"]
        self.admission.started(replica, granted=pinned)
        if "error" in first:
            self.admission.finished(replica, granted=pinned)
            raise ApiException(ApiError.from_dict(first["error"]))
        engine_ttft = first.get("ttft_s")  # a non-streaming job's first item is its last one
        meter.started(None if job.stream or engine_ttft is None else sent_at - t0 + engine_ttft)
        routing_decision(job.adapter_id, replica, first["hit"], self.replica_stats())
        (metrics.ADAPTER_HITS if first["hit"] else metrics.ADAPTER_MISSES).inc()
        generation = Generation(job=job, replica=replica, hit=first["hit"], first=first, stream=stream,
                                on_done=lambda: self.admission.finished(replica, granted=pinned), meter=meter)
        generation.read_ahead()  # its seat comes back when the replica ends it, read or not (`generation`)
        return generation

    async def _first_item(self, job: GenerateJob) -> tuple[dict[str, Any], Any]:
        """The job's first item and its call: a streaming job's stream (`LoraReplica.generate`), a
        non-streaming job's unary call (`LoraReplica.complete`), whose reply is its only item."""
        with own_request_id():
            call = self._stream.generate.remote(job) if job.stream else self._handle.complete.remote(job)
        try:
            first = await call.__anext__() if job.stream else await call
        except StopAsyncIteration:
            first = None
        except asyncio.CancelledError:
            cancel_call(call)
            raise
        except Exception as exc:
            cancel_call(call)
            raise ApiException(describe(exc)) from exc
        if first is None:
            error = NoReplicaError("the replica ended the stream without output")
            raise ApiException(describe(error)) from error
        return first, call

    async def start_all(self, jobs: list[GenerateJob], route: str,
                        on_started: Callable[[Generation], None] | None = None) -> list[Generation]:
        """Start every job concurrently; the generations in the jobs' order. `on_started(generation)`
        runs as each one starts. If one fails, the others are cancelled (started or still starting)
        and its error is raised; if the caller is cancelled, every started one is cancelled before
        the cancellation goes on (see the module docstring)."""
        started: list[Generation] = []
        entered: set[str] = set()  # the jobs whose `start` ran (it records their cancellation itself)

        async def start_one(job: GenerateJob) -> Generation:
            entered.add(job.request_id)
            generation = await self.start(job, route)
            started.append(generation)
            if on_started is not None:
                on_started(generation)
            return generation

        tasks = [asyncio.ensure_future(start_one(job)) for job in jobs]

        def stop_the_rest(task: asyncio.Future[Generation]) -> None:
            if not task.cancelled() and task.exception() is not None:
                for other in tasks:
                    other.cancel()

        def record_unstarted(job: GenerateJob, task: asyncio.Future[Generation]) -> None:
            if task.cancelled() and job.request_id not in entered:  # cancelled before its first step
                self._record(self._delivered, job, "", None)

        for job, task in zip(jobs, tasks, strict=True):
            task.add_done_callback(stop_the_rest)
            task.add_done_callback(functools.partial(record_unstarted, job))
        try:
            # gather waits for every task to end, cancelled ones included, before it returns or raises
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # the caller was cancelled: its client went away
            for generation in started:
                generation.cancel()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for generation in started:
                generation.cancel()
            raise next((r for r in errors if not isinstance(r, asyncio.CancelledError)), errors[0])
        return list(results)  # type: ignore[arg-type]

    async def call(self, replica_id: str, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Call `method(ToReplica(replica_id), *args)` on that replica."""
        with own_request_id():
            response = getattr(self._handle, method).remote(ToReplica(replica_id), *args)
        try:
            return await asyncio.wait_for(response, timeout_s)
        except TimeoutError:
            cancel_call(response)
            raise ApiException(describe(NoReplicaError(f"replica {replica_id} did not answer"))) from None

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Call `method(None, *args)` on whichever replica the router picks."""
        with own_request_id():
            response = getattr(self._handle, method).remote(None, *args)
        try:
            return await asyncio.wait_for(response, timeout_s)
        except TimeoutError:
            cancel_call(response)
            raise ApiException(describe(NoReplicaError(f"no replica answered within {timeout_s}s"))) from None

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        """Call `method` on every running replica; {replica id: result}."""
        stats = self.replica_stats()
        if stats is None:  # no router yet: one call creates it, then the replica list arrives
            await self.any_replica("ping")
            for _ in range(50):
                stats = self.replica_stats()
                if stats:
                    break
                await asyncio.sleep(0.1)
        if not stats:
            raise ApiException(describe(NoReplicaError("no LoRA replica is running")))
        ids = sorted(stats)
        results = await asyncio.gather(*(self.call(rid, method, *args) for rid in ids))
        return dict(zip(ids, results, strict=True))


def cached_tokens(generations: list[Generation], prompts: int = 1) -> int:
    """Prompt tokens the replicas' prefix caches held for `generations` (in prompt order, the same
    number per prompt): those of each prompt's first generation, so that a prompt counts once, as in
    the usage's `prompt_tokens`."""
    per_prompt = max(1, len(generations) // max(1, prompts))
    return sum(int(g.first.get("cached_tokens") or 0) for g in generations[::per_prompt])


def routing_headers(generations: list[Generation], prompts: int = 1) -> dict[str, str]:
    """`x-lora-replica` (the replicas that served, comma-separated), `x-lora-adapter-hit` and
    `x-lora-cached-tokens` (`cached_tokens` of the generations of `prompts` prompts)."""
    replicas = list(dict.fromkeys(g.replica for g in generations))
    return {HEADER_REPLICA: ",".join(replicas),
            HEADER_HIT: "true" if all(g.hit for g in generations) else "false",
            HEADER_CACHED: str(cached_tokens(generations, prompts))}

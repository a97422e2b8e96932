"""The LoRA replica deployment: one engine, its own continuous-batching loop, streamed outputs.

Each replica runs an `AsyncEngine` (a loop thread that steps the engine: requests of any adapter
join the running batch at the next step, so Ray Serve's `@serve.batch`, which splits batches by
model id, is not used). `generate` is a streaming method: the ingress calls it through
`handle.options(stream=True)` and gets one item per engine output (see `protocol`); a job with
`stream=False` goes to `complete`, the same run as a unary call (its one item is the reply). When the
caller goes away (client disconnect), Ray cancels the call, which aborts the request in the engine
and frees its batch slot before the call ends; the replica counts it as `cancelled`. The cancellation
reaches `generate` in one of two ways: a `CancelledError` where it awaits the engine, or, while it
waits at a `yield` (Serve running user code on its own loop, as in throughput mode, throws
`CancelledError` there or closes the generator), a close of the generator (`GeneratorExit`).

`record_routing_stats` reports what the router needs: adapters on the device and loading, free
adapter and batch slots, running and waiting requests; `prefixes`, the routing keys of the prompt
prefixes it ran lately (`cluster.prefix_keys.PrefixSummary`, bounded; with the prefix cache on), which
the router weighs with adapter residency and load; and, under `classes`, per SLA class: requests
running and waiting now, and over the last minute finished requests, TTFT and TPOT p50/p99 and SLO
attainment (`lora_cluster.cluster.class_stats`). Each job runs at its class's priority in the engine.

With a cluster controller, the replica also reports to it (`reporter`, `replica_report`): every
`controller_report_period_s`, and at once when a request finishes while requests wait in the
cluster queue (at most one such report per `controller_report_coalesce_s`; mostly deltas of its
report, `cluster.report_delta`); it prefetches the adapters the controller's placement names for it,
and fills its host tier ahead of requests with the cluster's busiest adapters (`demand_prefetch`).

Each request's usage record (`usage.UsageTap`) goes to the shipper, and its node-local spool, before
the request's final item leaves the replica (a kill after the client's last token loses nothing;
`serve.ops.usage_shipper`); a request that ends otherwise is recorded as it ends.

The replica is its engine's composition root: it builds the adapter store (`store.build_adapter_loader`,
once the engine knows the base model's shapes and device) and wires it into the engine as its
`EnginePort`, and it talks to the store's catalog (register, unregister, list, merge) and counters
itself, never through the engine (`store.ports`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from lora_cluster.cluster.class_stats import ClassStats
from lora_cluster.cluster.prefix_keys import PrefixSummary
from lora_cluster.cluster.report_rules import (
    MAX_PREFETCHES,
    AdapterDemand,
    AdmissionWindow,
    ServiceTime,
    window_limit,
)
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import load_config
from lora_cluster.engine import AsyncEngine, EngineStats, build_engine
from lora_cluster.errors import AdapterNotFoundError, LoraClusterError
from lora_cluster.serve.http_errors import describe
from lora_cluster.serve.ops.logs import configure_logging, set_request_id
from lora_cluster.serve.ops.usage_shipper import UsageShipper, take_meter
from lora_cluster.serve.protocol import GenerateJob, ToReplica, output_item
from lora_cluster.serve.replica.cluster_tier import RayClusterTier
from lora_cluster.serve.replica.demand_prefetch import ControllerHotList, DemandPrefetch
from lora_cluster.serve.replica.model import resolve_model, served_name
from lora_cluster.serve.replica.outputs import coalesce, tracked
from lora_cluster.serve.replica.report import build_report, host_by_recency, host_held, memory_split
from lora_cluster.serve.replica.reporter import ControllerReporter
from lora_cluster.serve.replica.tier_actors import cluster_tier_actor, node_holder
from lora_cluster.serve.replica.usage import UsageTap
from lora_cluster.serve.routing.replica_groups import DEFAULT_GROUP
from lora_cluster.store import TieredAdapterStore, build_adapter_loader
from lora_cluster.store.ports import AdapterStore

if TYPE_CHECKING:
    import torch

    from lora_cluster.adapter_format import ModelShapes
    from lora_cluster.config import EngineConfig

log = logging.getLogger(__name__)


@serve.deployment(name="LoraReplica")
class LoraReplica:
    def __init__(self, config: dict[str, Any], controller: Any | None = None, group: str = DEFAULT_GROUP,
                 usage_sink: Any | None = None):
        self.config = resolve_model(load_config(config))
        self.group = group  # its replica group (`replica_groups`), reported in the routing stats
        configure_logging(self.config.metrics.log_format)
        # the engine builds the store through `_build_store`, which keeps it as `self.store`
        self.engine = build_engine(config=self.config.engine, adapter_loader=self._build_store)
        self._capacity = self.config.admission.admission_capacity or self.config.engine.max_num_seqs
        admission = self.config.admission
        self.window = AdmissionWindow(window_limit(admission.admission_window_max,
                                                   admission.max_ongoing_requests, self._capacity))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.counts: collections.Counter[str] = collections.Counter()
        self.sla_classes = build_sla_classes(self.config)
        self.class_stats = ClassStats(self.sla_classes)
        self._registered: dict[str, str] = {}  # adapters registered here through the vLLM API
        self._registering = asyncio.Lock()  # one registration at a time: a path is registered once
        self.node_id = ray.get_runtime_context().get_node_id()
        self.demand = AdapterDemand()
        self.prefixes = PrefixSummary()  # prompt prefixes run here lately (empty with the prefix cache off)
        self.service_time = ServiceTime()
        self._prefetching: set[str] = set()
        self.active = 0  # generate calls in progress: what the controller counts against capacity
        self._arrived: collections.deque[str] = collections.deque(maxlen=4096)  # granted tickets, unreported
        self.reporter = None if controller is None else ControllerReporter(
            controller, self._report, self._on_reply, self.config.controller.controller_report_period_s,
            self.config.controller.controller_report_coalesce_s,
            budget_per_s=self.config.controller.controller_report_budget_per_s,
            heartbeat_s=self.config.controller.controller_shard_heartbeat_s)
        self.aengine = AsyncEngine(self.engine, on_step=self._observe_step)  # after the reporter it reads
        self.prefetcher = self._demand_prefetch(controller)
        # usage records go to the `UsageSink` deployment in batches (`serve.ops.usage_shipper`)
        self.usage = None if usage_sink is None else UsageShipper(
            lambda batch: usage_sink.record.remote(batch), self.config.tenancy.usage_flush_s,
            owner=self.replica_id, spool_dir=self.config.tenancy.usage_spool_dir,
            take=lambda: self.aengine.call(take_meter))  # the meter's slot and load time, on its thread
        log.info("replica %s serving %s", self.replica_id, self.config.model)

    def _demand_prefetch(self, controller: Any | None) -> DemandPrefetch | None:
        """Demand prefetch (`demand_prefetch`): with a controller and a tiered store, unless
        `prefetch_bytes_per_s` or `prefetch_max_bytes` is 0; its byte bound within the host tier's."""
        engine = self.config.engine
        if controller is None or not isinstance(self.store, TieredAdapterStore):
            return None
        max_bytes = min(int(engine.prefetch_max_bytes), int(engine.host_cache_bytes))
        if not engine.prefetch_bytes_per_s or not max_bytes:
            return None
        return DemandPrefetch(ControllerHotList(controller), self.store, self.engine,
                              bytes_per_s=float(engine.prefetch_bytes_per_s), max_bytes=max_bytes,
                              period_s=engine.prefetch_hot_period_s)

    def _build_store(self, config: EngineConfig, shapes: ModelShapes, device: torch.device) -> AdapterStore:
        """The engine's loader factory: builds the adapter store and keeps it as `self.store`, the
        catalog and counters this replica talks to (the engine gets its weights and hooks); a tiered
        store gets the cluster tier (`serve.replica.cluster_tier`) unless `cluster_tier_bytes` is 0."""
        self.cluster_tier: RayClusterTier | None = None
        if config.adapter_store != "folder" and config.cluster_tier_bytes:
            node, budget = ray.get_runtime_context().get_node_id(), int(config.cluster_tier_bytes)

            def app() -> str:  # asked on the tier's first use (a store that never downloads never asks)
                return serve.get_replica_context().app_name

            self.cluster_tier = RayClusterTier(
                lambda: cluster_tier_actor(budget, app()), lambda: node_holder(node, app()), node,
                timeout_s=config.fetch_timeout_s)
        tier = self.cluster_tier
        self.store: AdapterStore = build_adapter_loader(config, shapes, device, cluster_tier=tier)
        return self.store

    # ----- generation ---------------------------------------------------------------------

    async def generate(self, job: GenerateJob) -> AsyncIterator[dict[str, Any]]:
        """Run `job` at its class's priority, with its class's patience before it preempts
        (`SlaClass.preempt_after_s`); its class's stats count it (an error is a missed SLO, a
        caller that goes away is no sample). The call's task logs with the job's `x-request-id`."""
        async with contextlib.aclosing(self._run(job, stream=job.stream)) as items:
            async for item in items:
                yield item

    async def complete(self, job: GenerateJob) -> dict[str, Any] | None:
        """`generate` as a unary call for a non-streaming job (its `stream` is not read): the one item
        `generate` would yield for it (None: the engine ended without a final output). The ingress
        sends `stream: false` jobs here, one reply instead of a streamed item and the stream's end."""
        last = None
        async with contextlib.aclosing(self._run(job, stream=False)) as items:
            async for item in items:
                last = item
        return last

    async def _run(self, job: GenerateJob, *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        set_request_id(job.http_request_id)  # this call's own task (context): nothing to reset
        aid = job.adapter_id
        hit = aid is None or aid in self.aengine.stats.resident_adapters
        self.counts["requests"] += 1
        self.counts["hits" if hit else "misses"] += 1
        head: dict[str, Any] = {"replica": self.replica_id, "hit": hit}
        tracker = self.class_stats.start(job.priority_class)
        self.demand.record(aid)
        self.active += 1
        if job.ticket_id is not None:
            self._arrived.append(job.ticket_id)
        started = time.monotonic()
        if self.reporter is not None:
            self.reporter.ticket_arrived(job.ticket_id, aid)  # its shard's share (no ticket: nothing)
            self.reporter.start()
        if self.prefetcher is not None:
            self.prefetcher.start()
        ended = False  # the request's final item was produced: a close after it cancels nothing
        tap, cancelled, refused = UsageTap(), False, False
        try:
            if job.adapter_path is not None and aid is not None:
                await self._ensure_registered(aid, job.adapter_path)
            if job.merge is not None:  # a merged adapter: its recipe first, then its id like any other
                aid = self.store.define_merge(job.merge)
            sla = self.sla_classes.by_name.get(job.priority_class)
            patience = sla.preempt_after_s(self.config.engine.preempt_patience) if sla is not None else 0.0
            outputs = tap.watch(tracked(self.aengine.generate(
                job.prompt, aid, job.sampling, request_id=job.request_id, priority=job.priority,
                preempt_after_s=patience), tracker))
            if self.config.engine.enable_prefix_caching:
                self.prefixes.record(job.routing_prefix)
            if not stream:
                async with contextlib.aclosing(outputs):  # a close aborts the request at once
                    async for out in outputs:
                        if out.finished:
                            ended = self._record_usage(tap, job, cancelled=False, refused=False)
                            yield {**head, **output_item(out, full=True)}
                return
            async with contextlib.aclosing(coalesce(outputs)) as items:  # a close aborts the request at once
                async for item in items:
                    # the record is spooled before the final item leaves: a kill after it loses nothing
                    ended = item["finished"] and self._record_usage(tap, job, cancelled=False, refused=False)
                    yield {**head, **item}
                    head = {}
        except (asyncio.CancelledError, GeneratorExit):
            # the caller went away: cancelled where this awaits, or closed at a `yield` (module doc)
            if not ended:
                self.counts["cancelled"] += 1
            tracker.cancelled()
            cancelled = True
            raise
        except LoraClusterError as exc:
            self.counts["errors"] += 1
            if isinstance(exc, AdapterNotFoundError):  # no source has it: not demand for a real adapter
                self.demand.forget(job.adapter_id)
            refused = True
            tracker.failed()
            yield {**head, "error": describe(exc).to_dict()}
        except Exception:
            tracker.failed()
            raise
        finally:
            tracker.cancelled()  # the caller closed the stream early; no-op once the request ended
            self.active -= 1
            self.service_time.record(time.monotonic() - started)
            if not ended:
                self._record_usage(tap, job, cancelled=cancelled, refused=refused)
            if self.reporter is not None:
                self.reporter.request_finished(self.active + 1, self.capacity)

    def _record_usage(self, tap: UsageTap, job: GenerateJob, *, cancelled: bool, refused: bool) -> bool:
        """Add the request's usage record to the shipper (and its spool) once, as the request ends."""
        if self.usage is not None:
            self.usage.add(tap.record(job, self.replica_id, served_name(self.config), cancelled=cancelled,
                                      refused=refused))
        return True

    async def _ensure_registered(self, adapter_id: str, path: str) -> None:
        if self._registered.get(adapter_id) == path:
            return
        async with self._registering:
            if self._registered.get(adapter_id) != path:
                await self._register(adapter_id, path)
                self._registered[adapter_id] = path

    async def _register(self, adapter_id: str, path: str) -> None:
        """`store.register` in a worker thread (blocking I/O); refused once the engine loop is gone."""
        self.aengine.check_open()
        await asyncio.to_thread(self.store.register, adapter_id, path)

    # ----- routing stats, admin -----------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        if self.reporter is not None:
            self.reporter.start()  # Serve polls this from the start: the reports begin with it
        if self.prefetcher is not None:
            self.prefetcher.start()
        if self.usage is not None:
            self.usage.start()  # dead senders' spools on this node are adopted from the start
        # fresh from the loop thread: `AsyncEngine.stats` is refreshed only by engine steps, so it
        # would still show an aborted request as running while the engine idles
        s, counters = await self.aengine.call(lambda engine: (engine.stats(), engine.counters_snapshot()))
        held = set(s.resident_adapters) | set(s.loading_adapters)
        store = self._store_tiers()
        return RoutingStats(
            resident=tuple(sorted(s.resident_adapters)),
            loading=tuple(sorted(s.loading_adapters)),
            empty_adapter_slots=max(0, self.config.engine.max_loras - len(held)),
            free_adapter_slots=s.free_adapter_slots,
            max_loras=self.config.engine.max_loras,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            free_seq_slots=s.free_seq_slots,
            max_num_seqs=self.config.engine.max_num_seqs,
            miss_penalty=s.miss_penalty,
            adapter_thrash=s.adapter_thrash,
            breakers={**s.breakers, **self.store.snapshot().get("breakers", {})},
            group=self.group,
            base=served_name(self.config),
            **{k: self.counts[k] for k in ("requests", "hits", "misses", "cancelled", "errors")},
            store=store,
            classes=self.class_stats.snapshot(),
            engine={**counters, "preemptions": s.num_preemptions, "failed_steps": s.failed_steps,
                    **self._cold_start_counters()},
            memory=dataclasses.asdict(memory_split(self.engine, store)),
            node_id=self.node_id,
            prefixes=self.prefixes.keys(),
            host_held=self._host_held(),
        ).to_dict()

    # ----- the cluster controller ---------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests this replica takes at once before tickets wait in the cluster queue: its
        admission capacity plus its admission window (`cluster.report_rules.AdmissionWindow`)."""
        return self._capacity + self.window.extra

    def _observe_step(self, stats: EngineStats) -> None:
        """After each engine step (engine thread): the admission window learns whether a seat idled."""
        queued = self.reporter is not None and self.reporter.queue_depth > 0
        self.window.observe(free_seats=stats.free_seq_slots, waiting=stats.num_waiting, tickets_queued=queued)

    async def _report(self) -> ReplicaReport:
        # the tickets first, then the stats: a ticket reported as arrived must be in the engine's
        # counts (its request joins the engine from its own task, which the pause lets run first)
        arrived = tuple(self._arrived)
        self._arrived.clear()
        await asyncio.sleep(0)
        s = await self.aengine.call(lambda engine: engine.stats())
        return build_report(
            active=self.active, arrived_tickets=arrived,
            replica_id=self.replica_id, node_id=self.node_id,
            capacity=self.capacity, stats=s,
            max_num_seqs=self.config.engine.max_num_seqs, max_loras=self.config.engine.max_loras,
            classes=self.class_stats.snapshot(), adapter_requests=self.demand.take(),
            memory=memory_split(self.engine, self._store_tiers()), service_time_s=self.service_time.mean,
            sent_at=time.time(), base=served_name(self.config), prefixes=self.prefixes.keys(),
            host_held=self._host_held(),
            cluster_held=() if self.cluster_tier is None else self.cluster_tier.local_adapters())

    def _host_held(self) -> tuple[str, ...]:
        """Its host tier's adapters as its reports (`report.host_held`) and routing stats list them."""
        return host_held(host_by_recency(self.store))

    async def _on_reply(self, reply: dict[str, Any]) -> None:
        """Prefetch what the controller's placement chose this replica for (host copy first; the
        device slot follows with the first request the router spreads here)."""
        for adapter_id in reply.get("prefetch", ()):
            if len(self._prefetching) >= MAX_PREFETCHES or adapter_id in self._prefetching:
                continue
            self._prefetching.add(adapter_id)
            asyncio.get_running_loop().create_task(self._prefetch(adapter_id))

    async def _prefetch(self, adapter_id: str) -> None:
        try:
            await self.aengine.load_adapter(adapter_id)
        except LoraClusterError as exc:
            log.info("prefetch of %r for placement failed: %s", adapter_id, exc)
        finally:
            self._prefetching.discard(adapter_id)

    def _cold_start_counters(self) -> dict[str, int]:
        """Its demand prefetch's and cluster tier's counters (`metrics.COLD_START_COUNTERS`), if any."""
        counters = {} if self.prefetcher is None else self.prefetcher.counters()
        return counters if self.cluster_tier is None else {**counters, **self.cluster_tier.counters()}

    def _store_tiers(self) -> dict[str, Any]:
        """The adapter store's per-tier counters (for /metrics); empty with the plain folder loader."""
        return self.store.snapshot().get("tiers", {})

    async def stats(self, _target: ToReplica | None = None) -> dict[str, Any]:
        """Fresh stats of this replica (the routing stats, as of the engine's last step)."""
        return {"replica": self.replica_id, **(await self.record_routing_stats())}

    async def register_adapter(self, _target: ToReplica | None, name: str, path: str) -> dict[str, Any]:
        """vLLM's load_lora_adapter on this replica: validate the adapter at `path` and serve it as `name`."""
        try:
            async with self._registering:
                await self._register(name, path)
        except LoraClusterError as exc:
            return {"error": describe(exc).to_dict()}
        self._registered[name] = path
        return {"replica": self.replica_id, "ok": True}

    async def unregister_adapter(self, _target: ToReplica | None, name: str) -> dict[str, Any]:
        """vLLM's unload_lora_adapter on this replica; the adapter leaves the device once idle."""
        known = self._registered.pop(name, None) is not None
        self.aengine.check_open()
        await asyncio.to_thread(self.store.unregister, name)
        await self.aengine.unload_adapter(name)
        return {"replica": self.replica_id, "ok": known}

    async def list_adapters(self, _target: ToReplica | None = None) -> list[str]:
        self.aengine.check_open()
        return await asyncio.to_thread(self.store.list_adapters)

    async def ping(self, _target: ToReplica | None = None) -> str:
        return self.replica_id

    def check_health(self) -> None:
        """Serve's health probe: fails while the engine loop is gone or its steps keep failing."""
        self.aengine.check_health()

    async def __del__(self) -> None:
        """Serve's graceful shutdown (awaited): the usage records still buffered are sent first."""
        usage = getattr(self, "usage", None)
        if usage is not None:
            await usage.close()
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        prefetcher = getattr(self, "prefetcher", None)
        if prefetcher is not None:
            prefetcher.stop()
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()

"""The ingress deployment: the HTTP API (FastAPI through `@serve.ingress`) and the model router.

It parses and validates requests, tokenizes prompts (with the tokenizer of the base the request
runs on, the same as its engines', so limits are checked before a replica is bothered; each distinct
base's tokenizer loaded once, here; on the tokenizer threads, never on the event loop: see
`tokenization`), and sends each generation to the LoRA replicas through a deployment handle
whose request router is `LoraAffinityRouter`: the handle of the request's replica group
(`group_dispatch`). Responses carry `x-lora-replica` and `x-lora-adapter-hit`, as reported by the
replica that served them, and every response `x-lora-ingress`: the Serve replica id of the ingress
that answered (several ingress replicas: `ingress_num_replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from ray import serve

from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import load_config
from lora_cluster.serve.http.admin_api import admin_router
from lora_cluster.serve.http.body_limits import BodyLimitsMiddleware
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.lorax_api import lorax_router
from lora_cluster.serve.http.openai_api import openai_router
from lora_cluster.serve.http.openapi import install_openapi
from lora_cluster.serve.http.registry import LocalRegistrations, SharedRegistrations
from lora_cluster.serve.http.release_shadow import ShadowCopies
from lora_cluster.serve.http.releases_api import ReleaseRoutes, releases_router
from lora_cluster.serve.http.schema_limits import constrain
from lora_cluster.serve.http.usage_api import RemoteUsage, usage_router
from lora_cluster.serve.http_errors import install_handlers
from lora_cluster.serve.ops import generation_metrics, metrics, metrics_exposition, release_metrics
from lora_cluster.serve.ops.logs import RequestIdMiddleware, configure_logging
from lora_cluster.serve.ops.metrics_hub import SharedMetrics
from lora_cluster.serve.ops.ray_internals import serve_root_url
from lora_cluster.serve.ops.ready import ready_line, watch_in_background
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.replica.model import DEMO, load_tokenizers, resolve_model, served_name
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.serve.routing.auth import CallerMiddleware
from lora_cluster.serve.routing.dispatch import Dispatcher
from lora_cluster.serve.routing.group_bases import group_configs
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.quotas import RemoteQuotas
from lora_cluster.serve.routing.replica_groups import replica_groups
from lora_cluster.serve.routing.replica_tables import publish_placement, replica_stats
from lora_cluster.serve.routing.routing_guard import RoutingGuard
from lora_cluster.tenancy.watch import TenantsWatcher


class MetricsMiddleware:
    """Counts every HTTP request by route template and status, and times it to its last byte.
    A request whose client went away before the response started is counted as status 499."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 0  # 0: no response started

        async def send_and_watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except asyncio.CancelledError:
            status = status or 499
            raise
        finally:
            status = status or 500
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            metrics.REQUESTS.labels(route, str(status)).inc()
            metrics.REQUEST_LATENCY.labels(route).observe(time.monotonic() - start)


class IngressIdMiddleware:
    """Adds `x-lora-ingress: <ingress_id>` to every HTTP response."""

    def __init__(self, app: Any, ingress_id: str):
        self.app, self.header = app, (b"x-lora-ingress", ingress_id.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_fastapi(ctx: ApiContext, *, echo_request_id: bool = True) -> FastAPI:
    """The API app; `echo_request_id=False` under Ray Serve, whose proxy already echoes `x-request-id`."""
    shadows = ShadowCopies(ctx)  # one per ingress: the bound of copies in flight holds for every route

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.release_state.start()  # follow the shared release state from the start (http.release_state)
        yield
        shadows.stop()  # the shadow copies in flight

    app = FastAPI(title="lora-cluster", description="OpenAI-, LoRAX- and vLLM-compatible multi-LoRA serving.",
                  dependencies=[Depends(ctx.policy.authenticate)],  # THE auth dependency, every route
                  openapi_url=None, docs_url=None, redoc_url=None,  # served as app routes (http.openapi)
                  lifespan=lifespan)
    install_handlers(app)
    app.add_middleware(CallerMiddleware)  # closes each request's Caller once its response is over
    app.add_middleware(BodyLimitsMiddleware, max_bytes=ctx.config.api.max_body_bytes,
                       max_depth=ctx.config.api.max_json_depth)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RequestIdMiddleware, echo=echo_request_id)  # outermost: every line has the id
    app.include_router(openai_router(ctx, shadows))
    app.include_router(lorax_router(ctx, shadows))
    releases = ReleaseRoutes(ctx)
    app.include_router(admin_router(ctx, releases))
    app.include_router(usage_router(ctx.usage))
    ctx.export_usage_metrics()  # the usage counters' label bounds, the budget gauge
    metrics_exposition.set_scrape_collector("releases", release_metrics.ReleaseGauges(
        ctx.releases, ctx.config.metrics.metrics_max_adapter_labels))  # steps, shares, rollbacks
    app.include_router(releases_router(releases))
    # the schema declares every status, body and content type, and the SLA classes (serve.http.openapi)
    install_openapi(app, priority_classes=[c.name for c in ctx.policy.sla.classes],
                    auth=ctx.policy.authenticate,
                    bodies=lambda components: constrain(  # when the schema is first asked for
                        components, limits=ctx.config, vocab_size=ctx.tokens.vocab_size,
                        base_models=ctx.models.base_names, prompt_tokens=ctx.tokens.prompt_limit,
                        counts=ctx.tokens.chat_limits_schema))
    return app


@serve.deployment(name="LoraIngress")
@serve.ingress()
class LoraIngress:
    def __init__(self, replicas: dict[str, Any], config: dict[str, Any],
                 controllers: dict[str, Any | None] | None = None, quota_ledger: Any | None = None,
                 registry: Any | None = None, metrics_hub: Any | None = None, usage_sink: Any | None = None):
        """`replicas`: each replica group's deployment handle by group name (`replica_groups`);
        `controllers`: each group's cluster controller (None or absent: controller off);
        `quota_ledger`: the tenants' `QuotaLedger` (None: no tenants file); `registry`: the
        `AdapterRegistry` that several ingress replicas share (None: one ingress, registrations kept
        here; `http.registry`); `metrics_hub`: the `MetricsHub` that sums several ingress replicas'
        request metrics (None: this ingress's own; `ops.metrics_hub`); `usage_sink`: the `UsageSink`
        that GET /v1/usage reads (None: usage is not recorded)."""
        top = load_config(config)
        configs = group_configs(top)  # each group's base and engine settings (group_bases)
        requested = next(iter(configs.values()))  # the first group's: its base is the first base
        resolved = resolve_model(requested)
        configure_logging(resolved.metrics.log_format)
        by_group = {name: resolve_model(c) for name, c in configs.items()}
        tokenizers = load_tokenizers(by_group)  # one per base, by API name; the first group's first
        replica = serve.get_replica_context()
        app_name, self.ingress_id = replica.app_name, replica.replica_id.unique_id
        tenancy = resolved.tenancy  # its refusals, lost replicas' and left clients' requests are usage
        refusals = RefusalMeter.to_sink(usage_sink, tenancy.usage_flush_s, served_name(resolved),
                                        self.ingress_id, spool_dir=tenancy.usage_spool_dir)
        groups = []
        for group in replica_groups(top):  # one admission per group, keyed by its deployment
            handle = replicas[group.name]
            admission = ClusterAdmission(
                (controllers or {}).get(group.name), capacity=resolved.admission.admission_capacity,
                replica_stats=functools.partial(replica_stats, app_name, handle.deployment_name),
                timeout_s=resolved.controller.cluster_queue_timeout_s,
                placement_sink=functools.partial(publish_placement, app_name, handle.deployment_name),
                placement_period_s=resolved.controller.controller_report_period_s,
                report_lag_s=2 * resolved.router.routing_stats_period_s,
                park_batch_max=resolved.controller.controller_park_batch_max)
            guard = RoutingGuard.from_config(resolved)  # routing-error breaker, one per group
            parts = refusals.parts(served_name(by_group.get(group.name, resolved)))  # lost, delivered
            groups.append((group, Dispatcher(handle, app_name, admission, guard, **parts)))
        dispatcher = GroupedDispatcher(groups)
        self.tenants = None if tenancy.tenants_file is None else TenantsWatcher(
            tenancy.tenants_file, build_sla_classes(resolved).names, tenancy.tenants_reload_period_s)
        quotas = None if quota_ledger is None else RemoteQuotas(quota_ledger, resolved.tenancy.quota_lease_s)
        registrations = LocalRegistrations() if registry is None else SharedRegistrations(
            registry, catalog=dispatcher.catalog)
        shared_metrics = None if metrics_hub is None else SharedMetrics(metrics_hub, self.ingress_id)
        self.ctx = ApiContext(config=resolved, tokenizer=tokenizers[served_name(resolved)],
                              dispatcher=dispatcher, tokenizers=tokenizers,
                              tenants=self.tenants, quotas=quotas, registrations=registrations,
                              metrics_hub=shared_metrics,
                              usage=None if usage_sink is None else RemoteUsage(usage_sink),
                              refusals=refusals, ingress_id=self.ingress_id)
        if isinstance(registrations, SharedRegistrations):
            registrations.start()  # this ingress follows the registry from its start
        generation_metrics.configure(resolved)  # bounded adapter/tenant labels, SLA classes
        release_metrics.configure(resolved)  # bounded names of the per-version release metrics
        metrics_exposition.set_replica_stats_source(dispatcher.replica_stats)
        if self.ctx.metrics_hub is not None:
            self.ctx.metrics_hub.start()  # pushes from the ingress's start (on its event loop)
        demo_folder = str(Path(resolved.model).parent) if requested.model == DEMO else None
        self._ready_watch = watch_in_background(serve_root_url, functools.partial(
            ready_line, model=served_name(resolved), adapter_source=resolved.engine.adapter_source,
            demo_folder=demo_folder))

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_fastapi(self.ctx, echo_request_id=False)
        app.add_middleware(IngressIdMiddleware, ingress_id=self.ingress_id)
        return app

    async def __del__(self) -> None:
        """Serve's graceful shutdown (awaited): the refusals' usage records still buffered are sent."""
        watch = getattr(self, "_ready_watch", None)
        if watch is not None:
            watch.set()
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            await ctx.refusals.close()
            ctx.close()
        tenants = getattr(self, "tenants", None)
        if tenants is not None:
            tenants.close()

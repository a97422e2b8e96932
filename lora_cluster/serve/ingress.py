"""The ingress deployment: the HTTP API (FastAPI through `serve.ingress`) and the model router.

It parses and validates requests, tokenizes prompts (the same tokenizer as the engines, so limits
are checked before a replica is bothered; on the context's tokenizer threads, never on the event
loop: see `context`), and sends each generation to the LoRA replicas through a deployment handle
whose request router is `LoraAffinityRouter`. Responses carry `x-lora-replica` and
`x-lora-adapter-hit`, as reported by the replica that served them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from fastapi import FastAPI
from ray import serve

from lora_cluster.serve import metrics
from lora_cluster.serve.admin_api import admin_router
from lora_cluster.serve.admission import ClusterAdmission
from lora_cluster.serve.affinity import publish_placement, replica_stats
from lora_cluster.serve.context import ApiContext
from lora_cluster.serve.dispatch import Dispatcher
from lora_cluster.serve.http_errors import install_handlers
from lora_cluster.serve.lorax_api import lorax_router
from lora_cluster.serve.model import load_config, load_tokenizer, resolve_model
from lora_cluster.serve.openai_api import openai_router


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


def build_fastapi(ctx: ApiContext) -> FastAPI:
    app = FastAPI(title="lora-cluster", description="OpenAI-, LoRAX- and vLLM-compatible multi-LoRA serving.")
    install_handlers(app)
    app.add_middleware(MetricsMiddleware)
    app.include_router(openai_router(ctx))
    app.include_router(lorax_router(ctx))
    app.include_router(admin_router(ctx))
    return app


@serve.deployment(name="LoraIngress")
@serve.ingress()
class LoraIngress:
    def __init__(self, replicas: Any, config: dict[str, Any], controller: Any | None = None):
        resolved = resolve_model(load_config(config))
        app_name = serve.get_replica_context().app_name
        admission = ClusterAdmission(
            controller, capacity=resolved.admission_capacity,
            replica_stats=functools.partial(replica_stats, app_name, replicas.deployment_name),
            timeout_s=resolved.cluster_queue_timeout_s,
            placement_sink=functools.partial(publish_placement, app_name, replicas.deployment_name),
            placement_period_s=resolved.controller_report_period_s,
            report_lag_s=2 * resolved.routing_stats_period_s)
        dispatcher = Dispatcher(replicas, app_name, admission)
        self.ctx = ApiContext(config=resolved, tokenizer=load_tokenizer(resolved), dispatcher=dispatcher)
        metrics.set_replica_stats_source(dispatcher.replica_stats)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi(self.ctx)

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.close()

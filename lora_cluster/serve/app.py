"""The Ray Serve application: `build_app(args)`, the import path of serve_config.yaml.

    applications:
      - name: lora-cluster
        import_path: lora_cluster.serve.app:build_app
        args: {max_loras: 8, num_replicas: 2}

`args` are `ServeConfig` fields (every `EngineConfig` field passes through to the engines); a field
not given is read from `LORA_CLUSTER_<FIELD>`, else its default. The graph is one ingress
deployment (`LoraIngress`) holding a handle to the LoRA replicas (`LoraReplica`), whose requests
are placed by `LoraAffinityRouter`.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from lora_cluster.cluster.actor import ClusterController
from lora_cluster.config import ServeConfig
from lora_cluster.serve.ingress import LoraIngress
from lora_cluster.serve.model import load_config, resolve_model
from lora_cluster.serve.replica import LoraReplica
from lora_cluster.serve.request_router import LoraAffinityRouter


def replica_options(config: ServeConfig) -> dict[str, Any]:
    """Deployment options of the LoRA replicas (resources, concurrency, the request router)."""
    return {
        "num_replicas": config.num_replicas,
        "ray_actor_options": {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class=LoraAffinityRouter,
            request_router_kwargs={"miss_cost": config.router_miss_cost,
                                   "placement_ttl_s": config.router_placement_ttl_s},
            request_routing_stats_period_s=config.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * config.routing_stats_period_s),
        ),
    }


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The application for `args` (serve_config.yaml's application args); raises ConfigError."""
    config = load_config(args)
    resolve_model(config)  # build the demo zoo now (once), not in every replica at the same time
    fields = config.model_dump(exclude_unset=False)
    controller = None
    if config.controller:  # every waiting request holds one call to it: room for the whole queue
        room = config.cluster_queue_size + 4096
        controller = ClusterController.options(max_ongoing_requests=room).bind(fields)
    replicas = LoraReplica.options(**replica_options(config)).bind(fields, controller)
    ingress = LoraIngress.options(
        num_replicas=config.ingress_num_replicas,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
    )
    return ingress.bind(replicas, fields, controller)

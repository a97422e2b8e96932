"""The Ray Serve application: `build_app(args)`, the import path of serve_config.yaml.

    applications:
      - name: lora-cluster
        import_path: lora_cluster.serve.app:build_app
        args: {max_loras: 8, num_replicas: 2}

`args` are `ServeConfig` fields (every `EngineConfig` field passes through to the engines); a field
not given is read from `LORA_CLUSTER_<FIELD>`, else its default. The graph is one ingress
deployment (`LoraIngress`) holding a handle to the LoRA replicas (`LoraReplica`), whose requests
are placed by `LoraAffinityRouter`. With `replica_groups`, each group is its own LoRA replica
deployment (`LoraReplica-<name>`) with its own cluster controller (`ClusterController-<name>`); the
ingress gets {group name: handle} (see `replica_groups`, `group_dispatch`). A group's replicas and
controller run its own configuration (`group_bases.group_config`: its `model` and engine settings
over the top-level ones); the ingress gets the top-level one. With a `tenants_file`,
a one-replica `QuotaLedger` holds every tenant's quota for all ingress replicas (`serve.routing.quotas`).
Unless `usage_db_path` and `usage_store_uri` are empty, a one-replica `UsageSink` owns the usage store,
and every LoRA replica sends it its usage records in batches (`serve.ops.usage_sink`,
`serve.ops.usage_shipper`).
With several ingress replicas (`ingress_num_replicas` > 1 or `ingress_autoscaling_config`), a
one-replica `AdapterRegistry` holds the adapters loaded through the vLLM API for all of them
(`serve.http.registry`), and a one-replica `MetricsHub` sums their request metrics so that each
one's /metrics counts every request (`serve.ops.metrics_hub`). With `controller_shards` n > 1, a
group's controller runs as n deployments (`ClusterController[-<name>]`, then `-shard1` ...;
`cluster.sharding`), and the group's replicas and the ingress get the list of their handles.

Event loops: Ray Serve runs a replica's code, and the request router of the handles it holds, on
event loops of their own threads by default, so every request crosses threads on each hop (the
proxy's call into the ingress, the ingress's call through its router, the replica's call into its
code, and the way back). The ingress and the LoRA replicas keep blocking work off their loop
(tokenizer threads, the engine's loop thread), so both run on Serve's main loop instead
(`SINGLE_LOOP_ENV` in their actors' environment); measured in docs/bench_router.md. An environment
that sets either variable itself (`serve run`'s, the cluster's) keeps its value.

Logs: every deployment but the ingress gets `logging_config` `{enable_access_log:
internal_access_log}` (off by default): Serve's access lines for the internal calls (1-3 a request)
cost about 5% of the server's CPU per request (docs/soak.md, "Serve's access lines"); the ingress
keeps Serve's HTTP access line under the application's own `logging_config`.
"""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from lora_cluster.cluster.controller_settings import cluster_queue_bound
from lora_cluster.cluster.sharding import shard_deployment
from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import ServeConfig, load_config
from lora_cluster.errors import ConfigError
from lora_cluster.serve.controller_actor import ClusterController
from lora_cluster.serve.http.ingress import LoraIngress
from lora_cluster.serve.http.registry import AdapterRegistry
from lora_cluster.serve.ops.metrics_hub import MetricsHub
from lora_cluster.serve.ops.usage_shipper import SEND_TIMEOUT_S
from lora_cluster.serve.ops.usage_sink import UsageSink
from lora_cluster.serve.replica.deployment import LoraReplica
from lora_cluster.serve.replica.model import load_tokenizers, resolve_model
from lora_cluster.serve.routing.group_bases import group_configs
from lora_cluster.serve.routing.quotas import QuotaLedger
from lora_cluster.serve.routing.replica_groups import ReplicaGroup, replica_groups
from lora_cluster.serve.routing.request_router import LoraAffinityRouter
from lora_cluster.tenancy.usage_db import require_psycopg
from lora_cluster.tenancy.usage_export import require_pyarrow
from lora_cluster.tenancy.usage_export_target import open_export_target
from lora_cluster.tenancy.watch import read_tenants

# Ray Serve 2.60's switches (public environment variables) for running replica code and a handle's
# router on the replica's main event loop (see the module docstring)
SINGLE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                   "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def single_loop(ray_actor_options: dict[str, Any]) -> dict[str, Any]:
    """`ray_actor_options` whose `runtime_env` also sets `SINGLE_LOOP_ENV`'s variables, those that
    neither this process's environment nor the options' own `env_vars` set."""
    runtime_env = dict(ray_actor_options.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    added = {k: v for k, v in SINGLE_LOOP_ENV.items() if k not in os.environ and k not in env_vars}
    if not added:
        return ray_actor_options
    return {**ray_actor_options, "runtime_env": {**runtime_env, "env_vars": {**env_vars, **added}}}


def internal_logging(config: ServeConfig) -> dict[str, Any]:
    """The `logging_config` of every deployment but the ingress: Serve's access line for each call
    only with `internal_access_log`. Set in code, it stands in for an application-level
    `logging_config` on these deployments (Serve applies that only where code set none); a
    per-deployment one in serve_config.yaml still overrides it."""
    return {"enable_access_log": config.metrics.internal_access_log}


def replica_count(config: ServeConfig, group: ReplicaGroup) -> dict[str, Any]:
    """`{"num_replicas": n}`, or with `autoscaling_config` set `{"autoscaling_config": ...}` (Ray Serve
    then adds and removes LoRA replicas of every group between min_replicas and max_replicas, to keep
    about target_ongoing_requests per replica). Raises ConfigError for an invalid autoscaling_config."""
    return _count(group.num_replicas, config.autoscaling_config, "autoscaling_config")


def most_replicas(config: ServeConfig, group: ReplicaGroup) -> int:
    """The most LoRA replicas `group` runs: its `num_replicas`, or `max_replicas` with autoscaling.
    Raises ConfigError for an invalid autoscaling_config."""
    autoscaling = _autoscaling(config.autoscaling_config, "autoscaling_config")
    return group.num_replicas if autoscaling is None else int(autoscaling.max_replicas)


def ingress_count(config: ServeConfig) -> dict[str, Any]:
    """The ingress's `{"num_replicas": ingress_num_replicas}`, or its `{"autoscaling_config": ...}`
    with `ingress_autoscaling_config` set. Raises ConfigError for an invalid one."""
    return _count(config.ingress_num_replicas, config.ingress_autoscaling_config,
                  "ingress_autoscaling_config")


def several_ingresses(config: ServeConfig) -> bool:
    """The ingress may run more than one replica: its registrations then live in `AdapterRegistry`
    and its request metrics are summed by `MetricsHub`."""
    return config.ingress_num_replicas > 1 or config.ingress_autoscaling_config is not None


def _count(num_replicas: int, autoscaling_config: dict[str, Any] | None, field: str) -> dict[str, Any]:
    autoscaling = _autoscaling(autoscaling_config, field)
    if autoscaling is None:
        return {"num_replicas": num_replicas}
    return {"autoscaling_config": autoscaling.model_dump(exclude_unset=True)}


def _autoscaling(autoscaling_config: dict[str, Any] | None, field: str) -> AutoscalingConfig | None:
    """`autoscaling_config` parsed by Ray Serve's own model (None: not set); ConfigError names `field`."""
    if autoscaling_config is None:
        return None
    try:
        return AutoscalingConfig(**autoscaling_config)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {field}: {exc}") from exc


def preemption_headroom(config: ServeConfig, group: ReplicaGroup) -> int:
    """Requests a LoRA replica of `group` accepts beyond `max_ongoing_requests`: with the cluster
    controller on, its batch slots (its group's `max_num_seqs`), the most urgent requests the
    controller sends it at once over capacity to preempt less urgent running work (a preempting grant
    counts against the less urgent requests running there, so no more than its batch slots). Without
    this room, a replica whose admission window is full (`max_ongoing_requests` = capacity + window
    in flight) would hold a preempting grant in Serve's router, first in first out, until one of its
    requests ends, while the less urgent requests of its window start first. Controller off: 0."""
    if not config.controller.enabled:
        return 0
    return group_configs(config)[group.name].engine.max_num_seqs


def replica_options(config: ServeConfig, group: ReplicaGroup | None = None) -> dict[str, Any]:
    """Deployment options of one group's LoRA replicas (name, resources and node labels, concurrency,
    the request router); `group` None: the first group of `config`. Serve's `max_ongoing_requests` is
    the admission section's plus `preemption_headroom`."""
    group = group or replica_groups(config)[0]
    return {
        "name": group.deployment,
        **replica_count(config, group),
        "ray_actor_options": group.ray_actor_options(),
        "max_ongoing_requests": config.admission.max_ongoing_requests + preemption_headroom(config, group),
        "max_queued_requests": config.admission.max_queued_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class=LoraAffinityRouter,
            request_router_kwargs={"router": config.router.model_dump()},
            request_routing_stats_period_s=config.router.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * config.router.routing_stats_period_s),
        ),
    }


def usage_sink(config: ServeConfig) -> Application:
    """The `UsageSink` deployment, on `usage_store_uri` (PostgreSQL) or else the SQLite `usage_db_path`;
    psycopg (for `usage_store_uri`) and pyarrow (for `usage_export_uri`) are checked here (ConfigError),
    so a missing extra stops the start rather than the first write. A minute closes once late batches
    (one flush interval and a send timeout) have had their time."""
    tenancy = config.tenancy
    if tenancy.usage_store_uri:
        require_psycopg()
    if tenancy.usage_export_uri:
        require_pyarrow(tenancy.usage_export_uri)
        open_export_target(tenancy.usage_export_uri)  # a malformed URI: ConfigError now
    return UsageSink.options(logging_config=internal_logging(config)).bind(
        tenancy.usage_store_uri or tenancy.usage_db_path, tenancy.usage_retention_s,
        export_uri=tenancy.usage_export_uri,
        export_interval_s=tenancy.usage_export_interval_s,
        close_after_s=tenancy.usage_flush_s + SEND_TIMEOUT_S)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The application for `args` (serve_config.yaml's application args); raises ConfigError."""
    config = load_config(args)
    configs = group_configs(config)  # each group's model and engine settings (group_bases)
    resolved = {name: resolve_model(c) for name, c in configs.items()}  # demo zoos: built once, here
    load_tokenizers(resolved)  # each base's tokenizer loads (the ingress encodes with it), or no start
    replicas: dict[str, Application] = {}
    controllers: dict[str, Application | list[Application] | None] = {}
    sink = None  # the usage store (`serve.ops.usage_sink`): every group's replicas send to it
    if config.tenancy.usage_store_uri or config.tenancy.usage_db_path:
        sink = usage_sink(config)
    for group in replica_groups(config):  # each group: its own replicas and cluster controller
        fields = configs[group.name].model_dump(exclude_unset=False)
        controller: Application | list[Application] | None = None
        if config.controller.enabled:  # every waiting request holds one call to it: room for the whole queue
            queued = cluster_queue_bound(config.controller.cluster_queue_size, most_replicas(config, group))
            room = queued + 4096
            n = config.controller.controller_shards
            shards = [ClusterController.options(name=shard_deployment(group.controller, k),
                                                max_ongoing_requests=room,
                                                logging_config=internal_logging(config)).bind(fields, k, n)
                      for k in range(n)]
            controller = shards[0] if n == 1 else shards
        options = {**replica_options(config, group), "logging_config": internal_logging(config)}
        options["ray_actor_options"] = single_loop(options["ray_actor_options"])
        replicas[group.name] = LoraReplica.options(**options).bind(fields, controller, group.name, sink)
        controllers[group.name] = controller
    ingress = LoraIngress.options(
        **ingress_count(config),
        ray_actor_options=single_loop({"num_cpus": config.ingress_num_cpus}),
        max_ongoing_requests=config.ingress_max_ongoing_requests,
    )
    ledger = None
    if config.tenancy.tenants_file is not None:  # check the file now (a broken one stops the start here)
        read_tenants(config.tenancy.tenants_file, build_sla_classes(config).names)
        ledger = QuotaLedger.options(logging_config=internal_logging(config)).bind(
            config.tenancy.quota_ticket_ttl_s)
    registry = hub = None
    if several_ingresses(config):
        registry = AdapterRegistry.options(logging_config=internal_logging(config)).bind()
        hub = MetricsHub.options(logging_config=internal_logging(config)).bind(
            config.metrics.metrics_max_adapter_labels, config.metrics.metrics_max_tenant_labels,
            config.metrics.metrics_label_window_s)
    return ingress.bind(replicas, config.model_dump(exclude_unset=False), controllers, ledger, registry, hub,
                       sink)

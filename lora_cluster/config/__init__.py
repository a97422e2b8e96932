"""The one typed configuration of lora-cluster: `ServeConfig` (the Ray Serve application, config.serve)
in sections, each taken whole by its owner: `EngineConfig` (one engine, config.engine), the control
plane's `RouterConfig`, `AdmissionConfig` and `ControllerConfig` (config.control_plane) and the
ingress's `ApiConfig`, `TenancyConfig` and `MetricsConfig` (config.ingress), and `ReleasesConfig`
(config.releases).

Every field documents itself, is validated when the config is built, and can be overridden by an
environment variable `LORA_CLUSTER_<FIELD>` (config.parsing), its flat name also for a section's
field (config.flat_aliases). `python -m lora_cluster.config.docs`
writes the field tables of the docs and the commented args of serve_config.yaml from the fields.
"""

from lora_cluster.config.control_plane import AdmissionConfig, ControllerConfig, RouterConfig
from lora_cluster.config.engine import EngineConfig
from lora_cluster.config.ingress import ApiConfig, MetricsConfig, TenancyConfig
from lora_cluster.config.parsing import ENV_PREFIX, ByteSize, StrList, build_config, env_var, parse_bytes
from lora_cluster.config.releases import ReleasesConfig
from lora_cluster.config.serve import (
    DEFAULT_CLASS,
    DEFAULT_SLA_CLASSES,
    MAX_CLASSES,
    MAX_GROUP_PATTERNS,
    MAX_REPLICA_GROUPS,
    ReplicaGroupConfig,
    ServeConfig,
    SlaClassConfig,
    load_config,
    serve_defaults,
)

__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_SLA_CLASSES",
    "ENV_PREFIX",
    "MAX_CLASSES",
    "MAX_GROUP_PATTERNS",
    "MAX_REPLICA_GROUPS",
    "AdmissionConfig",
    "ApiConfig",
    "ByteSize",
    "ControllerConfig",
    "EngineConfig",
    "MetricsConfig",
    "ReleasesConfig",
    "ReplicaGroupConfig",
    "RouterConfig",
    "ServeConfig",
    "SlaClassConfig",
    "StrList",
    "TenancyConfig",
    "build_config",
    "env_var",
    "load_config",
    "parse_bytes",
    "serve_defaults",
]

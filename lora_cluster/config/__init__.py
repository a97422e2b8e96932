"""The one typed configuration of lora-cluster: `EngineConfig` (one engine, config.engine) and
`ServeConfig` (the Ray Serve application, with SLA classes and replica groups, config.serve).

Every field documents itself, is validated when the config is built, and can be overridden by an
environment variable `LORA_CLUSTER_<FIELD>` (config.parsing). `python -m lora_cluster.config.docs`
writes the field tables of the docs and the commented args of serve_config.yaml from the fields.
"""

from lora_cluster.config.engine import EngineConfig
from lora_cluster.config.parsing import ENV_PREFIX, ByteSize, StrList, build_config, env_var, parse_bytes
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
    "ByteSize",
    "EngineConfig",
    "ReplicaGroupConfig",
    "ServeConfig",
    "SlaClassConfig",
    "StrList",
    "build_config",
    "env_var",
    "load_config",
    "parse_bytes",
    "serve_defaults",
]

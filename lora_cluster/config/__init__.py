"""The one typed configuration of lora-cluster (see `lora_cluster.config.engine`)."""

from lora_cluster.config.engine import (
    EngineConfig,
    ReplicaGroupConfig,
    ServeConfig,
    SlaClassConfig,
    build_config,
    build_sla_classes,
)

__all__ = ["EngineConfig", "ReplicaGroupConfig", "ServeConfig", "SlaClassConfig", "build_config",
           "build_sla_classes"]

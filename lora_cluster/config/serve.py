"""The configuration of the Ray Serve application (`ServeConfig`): the base model, replicas and
resources, SLA classes and replica groups, and one section per owner (engine, router, admission,
controller, api, tenancy, metrics, releases), each field also by its flat name (config.flat_aliases)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from lora_cluster.config.control_plane import AdmissionConfig, ControllerConfig, RouterConfig
from lora_cluster.config.engine import EngineConfig
from lora_cluster.config.flat_aliases import FlatEnvSource, FlatNames
from lora_cluster.config.ingress import ApiConfig, MetricsConfig, TenancyConfig
from lora_cluster.config.parsing import SETTINGS, build_config
from lora_cluster.config.releases import ReleasesConfig

MAX_CLASSES = 16
DEFAULT_CLASS = "standard"
MAX_REPLICA_GROUPS = 16
MAX_GROUP_PATTERNS = 256


def _default_demo_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lora-cluster", "demo-zoo")


class SlaClassConfig(BaseModel):
    """One SLA class of `ServeConfig.sla_classes`; `lora_cluster.cluster.sla` holds the policy that
    resolves a request's class from them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="What clients send in `x-lora-priority` and get back in `x-lora-priority-class`: "
        "1-64 letters, digits, `_`, `.` or `-`.",
    )
    priority: int = Field(description="Lower is more urgent (vLLM's convention); the engine orders by it.")
    ttft_s: float | None = Field(None, gt=0, description="Time-to-first-token target (None: no target).")
    tpot_s: float | None = Field(None, gt=0, description="Time-per-output-token target (None: no target).")


DEFAULT_SLA_CLASSES = (
    SlaClassConfig(name="interactive", priority=0, ttft_s=1.0, tpot_s=0.2),
    SlaClassConfig(name="standard", priority=1, ttft_s=5.0, tpot_s=0.5),
    SlaClassConfig(name="batch", priority=2),
)


class ReplicaGroupConfig(BaseModel):
    """One named group of LoRA replicas (`ServeConfig.replica_groups`): its own Ray Serve deployment
    with its own replica count and resources, serving the adapters and tenants it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$",
        description="Group name (1-32 lowercase letters, digits or `-`): the deployment is "
        "`LoraReplica-<name>`, its controller `ClusterController-<name>`.",
    )
    num_replicas: int = Field(1, ge=1, le=1024, description="LoRA replicas of this group.")
    num_cpus: float | None = Field(None, ge=0, description="CPUs per replica (default: num_cpus).")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per replica (default: num_gpus).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {finance-node: 1}."
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels the replicas must run on (Ray's label_selector), e.g. "
        "{lora-group: finance}; KubeRay sets them from a worker group's `labels`.",
    )
    adapters: list[str] = Field(
        default_factory=list, max_length=MAX_GROUP_PATTERNS,
        description="Glob patterns (fnmatch, case-sensitive) of the adapter ids this group serves.",
    )
    tenants: list[str] = Field(
        default_factory=list, max_length=MAX_GROUP_PATTERNS,
        description="Tenant names (of the tenants file) whose requests this group serves.",
    )
    model: str | None = Field(
        None,
        description="This group's base model (as `model`: a local folder, a hub id or `demo`); default: "
        "the top-level `model`. Groups on different bases make a cluster of several base models: "
        "/v1/models lists each base with its adapters, and a request's `model` selects the group.",
    )
    served_model_name: str | None = Field(
        None, description="Name of this group's base in the API; default: the top-level "
        "served_model_name when the group keeps the top-level model, else its `model`.",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine settings of this group's replicas (EngineConfig fields other than `model`, "
        "e.g. {max_loras: 16, adapter_source: [s3://bucket/qwen3/], dtype: bfloat16}); the others "
        "are the top-level ones.",
    )

    @field_validator("engine")
    @classmethod
    def _engine_fields_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(k for k in value if k not in EngineConfig.model_fields or k == "model")
        if unknown:
            raise ValueError(f"engine lists {', '.join(unknown)}, which is not an engine setting of a "
                             "replica group (set a group's base model with its `model`)")
        return value


class ServeConfig(BaseSettings):
    """Configuration of the Ray Serve application: the base model, replicas and resources, SLA classes
    and replica groups at the top, and one section per owner (`engine`, `router`, `admission`,
    `controller`, `api`, `tenancy`, `metrics`); each owner takes its section whole.

    These are the application `args` of serve_config.yaml (`lora_cluster.serve.app:build_app`), in
    sections or flat: every section field keeps its flat key and its flat variable
    `LORA_CLUSTER_<FIELD>` (config.flat_aliases). Every replica builds its engine from `engine`,
    whose `model` is always the top-level `model`.
    """

    model_config = SETTINGS

    model: str = Field(
        "demo",
        description="Base model (a dense family of docs/model_families.md: Llama, Mistral, Qwen2/3, Gemma "
        "2/3, Phi-3/4, Granite, OLMo 2, SmolLM3): a local folder, a Hugging Face hub id, or `demo` = the "
        "built-in demo zoo "
        "(a tiny random-weight Llama model and its adapters, built into `demo_dir` on first use).",
    )
    demo_dir: str = Field(
        default_factory=_default_demo_dir,
        description="Cache folder of the demo zoo. Default: $XDG_CACHE_HOME/lora-cluster/demo-zoo "
        "(~/.cache/...).",
    )
    demo_num_adapters: int = Field(64, ge=1, le=4096, description="Adapters a0..a{N-1} of the demo zoo.")
    demo_size: Literal["tiny", "base", "1b"] = Field(
        "tiny", description="Demo model size: tiny, base (~88M) or 1b (~1.0B parameters, for a GPU)."
    )
    served_model_name: str | None = Field(
        None, description="Name of the base model in the API (`model` field, /v1/models); default: `model`."
    )
    num_replicas: int = Field(1, ge=1, le=1024, description="LoRA replicas (engines), each its own slots.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per LoRA replica (Ray resource).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per LoRA replica (Ray resource).")
    ingress_num_replicas: int = Field(
        1, ge=1, description="Replicas of the HTTP ingress (API, router). Several share the tenants' quotas "
        "(quota ledger), the adapters loaded through the vLLM API (adapter registry) and the cluster queue.",
    )
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs reserved per ingress replica.")
    ingress_max_ongoing_requests: int = Field(4096, ge=1, description="Requests one ingress replica accepts.")
    ingress_autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling of the ingress replicas (Ray's `autoscaling_config`, as for "
        "autoscaling_config); when set, it replaces ingress_num_replicas. Environment: a JSON object. "
        "Default: a fixed ingress_num_replicas.",
        examples=[{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 512}],
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling of the LoRA replicas (Ray's `autoscaling_config`: "
        "target_ongoing_requests, min_replicas, max_replicas, upscale_delay_s, downscale_delay_s, ...); "
        "when set, it replaces num_replicas. Environment: a JSON object. Default: a fixed num_replicas.",
        examples=[{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 24,
                   "upscale_delay_s": 30, "downscale_delay_s": 600}],
    )

    sla_classes: list[SlaClassConfig] = Field(
        default_factory=lambda: list(DEFAULT_SLA_CLASSES),
        description="SLA classes a request can ask for (header `x-lora-priority: <name>`, or vLLM's "
        "integer `priority` field): name, priority (lower = more urgent), ttft_s and tpot_s targets "
        "(null = none). 1 to 16 classes, unique names. Environment: a JSON list. Default: interactive "
        "(0, 1 s, 0.2 s), standard (1, 5 s, 0.5 s), batch (2, no targets).",
    )
    default_priority_class: str = Field(
        DEFAULT_CLASS, description="The class of a request that names none (one of `sla_classes`)."
    )
    replica_groups: list[ReplicaGroupConfig] = Field(
        default_factory=list,
        description="Named groups of LoRA replicas, each its own deployment with its own num_replicas, "
        "num_cpus/num_gpus/resources and node_labels, serving the adapters (glob patterns) and "
        "tenants it lists: a request goes to the first group (in this order) matching its adapter "
        "or tenant, else to the first group listing neither (catch-all), else it is a 404. Empty "
        "(the default): one group of num_replicas replicas serving everything. Environment: a JSON list.",
        examples=[[{"name": "finance", "num_replicas": 2, "num_cpus": 4, "num_gpus": 1,
                    "node_labels": {"lora-group": "finance"}, "adapters": ["fin-*"], "tenants": ["finance"]},
                   {"name": "service", "num_replicas": 2}]],
    )

    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig.model_construct(model="demo"),
        description="The engine of each LoRA replica (EngineConfig): adapter slots, batching, KV cache, "
        "the adapter store's tiers, breakers and rotation; its `model` is the top-level `model`.",
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description=RouterConfig.__doc__)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description=AdmissionConfig.__doc__)
    controller: ControllerConfig = Field(default_factory=ControllerConfig,
                                         description=ControllerConfig.__doc__)
    api: ApiConfig = Field(default_factory=ApiConfig, description=ApiConfig.__doc__)
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig, description=TenancyConfig.__doc__)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description=MetricsConfig.__doc__)
    releases: ReleasesConfig = Field(default_factory=ReleasesConfig, description=ReleasesConfig.__doc__)

    def __init__(self, **values: Any) -> None:
        super().__init__(**FLAT.nest(values))

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Explicit arguments, then the flat variables of every field and section field."""
        return init_settings, FlatEnvSource(settings_cls, FLAT)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, data: Any) -> Any:
        """Flat keys into their sections; the engine's `model` is the top-level one."""
        if not isinstance(data, dict):
            return data
        data = FLAT.nest(data)
        engine = dict(data.get("engine") or {})
        model = data.get("model", cls.model_fields["model"].default)
        if engine.setdefault("model", model) != model:
            raise ValueError("engine.model is the top-level `model`; set the base model there")
        data["engine"] = engine
        return data

    @model_validator(mode="after")
    def _adapter_wait_bounds_from_classes(self) -> ServeConfig:
        """Adapter rotation's fairness bounds follow the SLA classes unless set explicitly."""
        engine = self.engine
        if "adapter_wait_bounds_s" not in engine.model_fields_set:
            engine.adapter_wait_bounds_s = {c.priority: c.ttft_s * engine.adapter_wait_fraction
                                            for c in self.sla_classes if c.ttft_s is not None}
        return self

    @model_validator(mode="after")
    def _replica_groups_consistent(self) -> ServeConfig:
        names = [g.name for g in self.replica_groups]
        if len(names) > MAX_REPLICA_GROUPS:
            raise ValueError(f"replica_groups lists {len(names)} groups; at most {MAX_REPLICA_GROUPS}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"replica_groups names must be unique; repeated: {', '.join(duplicates)}")
        top = self.served_model_name or self.model
        models: dict[str, str] = {}  # a base's API name -> its model: one model per name
        for g in self.replica_groups:
            model = g.model or self.model
            name = g.served_model_name or (top if model == self.model else model)
            if models.setdefault(name, model) != model:
                raise ValueError(f"replica_groups: group {g.name!r} serves another base model under the name "
                                 f"{name!r}; give each base its own served_model_name")
        return self

    @model_validator(mode="after")
    def _sla_classes_consistent(self) -> ServeConfig:
        names = [c.name for c in self.sla_classes]
        if not 1 <= len(names) <= MAX_CLASSES:
            raise ValueError(f"sla_classes must list between 1 and {MAX_CLASSES} classes, got {len(names)}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"sla_classes names must be unique; repeated: {', '.join(duplicates)}")
        if self.default_priority_class not in names:
            raise ValueError(
                f"default_priority_class={self.default_priority_class!r} is not one of sla_classes "
                f"({', '.join(names)})"
            )
        return self


FLAT = FlatNames({"engine": EngineConfig, "router": RouterConfig, "admission": AdmissionConfig,
                   "controller": ControllerConfig, "api": ApiConfig, "tenancy": TenancyConfig,
                   "metrics": MetricsConfig, "releases": ReleasesConfig}, excluded=frozenset({"model"}))
"""Every section field's flat name (config.flat_aliases)."""


def serve_defaults() -> ServeConfig:
    """Every field of `ServeConfig` at its default, typed: what the simulator and the router read so
    that they run what a user gets. Neither the environment nor serve_config.yaml is read, and no
    validator runs (`adapter_wait_bounds_s` stays empty; serving derives it from the SLA classes)."""
    return ServeConfig.model_construct()


def load_config(args: dict[str, Any] | None) -> ServeConfig:
    """The `ServeConfig` of a Serve application's args, with `LORA_CLUSTER_*` overrides from the
    environment; raises `ConfigError` naming the field."""
    return build_config(ServeConfig, **(args or {}))

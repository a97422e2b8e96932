"""Replica groups: which named group of LoRA replicas serves a request (pure policy, no Ray).

Layered routing: business lines share the cluster, but finance traffic runs on finance
nodes. `ServeConfig.replica_groups` names groups of LoRA replicas; each group is its own Ray Serve
deployment (`LoraReplica-<name>`, with its own replica count, resources and node labels) with its
own cluster controller (`ClusterController-<name>`), so the request router and the cluster queue of a
group only ever see that group's replicas: a group's traffic never leaves it.

Selection (`select_group`), for a request's adapter id and tenant name:
1. the first group, in configuration order, whose `adapters` glob patterns match the adapter id
   or whose `tenants` list the tenant;
2. else the first catch-all group (one listing neither adapters nor tenants);
3. else, for the base model (no adapter), the first group (every replica serves the base model);
   for an adapter, no group: the adapter is not served here (the caller answers 404).

A merge of adapters (`merged_adapters`) runs where every one of its adapters may run
(`select_merge_group`): a group serves an adapter of the merge when it is the group `select_group`
picks for that adapter and tenant, or when it names the adapter or the tenant itself. The first
group, in configuration order, that serves every adapter of the merge runs it; when none does (a
finance adapter merged with one only the shared group serves), the merge is refused (a 400
naming each adapter's group), so that an adapter never leaves its group.

Each group serves one base model (`base`, its API name: see `base_name`); groups on different bases
make a cluster of several base models, whose selection by a request's `model` is `group_bases`'s.

Without `replica_groups`, there is one catch-all group, `default`, made of the `num_replicas`,
`num_cpus` and `num_gpus` fields, deployed under the historical names `LoraReplica` and
`ClusterController`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from lora_cluster.config import ReplicaGroupConfig, ServeConfig
from lora_cluster.errors import AdapterNotFoundError, RequestError

DEFAULT_GROUP = "default"
REPLICA_DEPLOYMENT = "LoraReplica"
CONTROLLER_DEPLOYMENT = "ClusterController"


@dataclass(frozen=True)
class ReplicaGroup:
    """One group as deployed: names, resources, and what it serves."""

    name: str
    deployment: str  # the Ray Serve deployment of its LoRA replicas
    controller: str  # the Ray Serve deployment of its cluster controller
    num_replicas: int
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)
    node_labels: dict[str, str] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()
    tenants: frozenset[str] = frozenset()
    base: str = ""  # the served name of its base model (`base_name`); "" only in hand-built groups

    @property
    def catch_all(self) -> bool:
        return not self.adapters and not self.tenants

    def matches(self, adapter_id: str | None, tenant: str | None) -> bool:
        """The group names this adapter (by a pattern) or this tenant."""
        if tenant is not None and tenant in self.tenants:
            return True
        return adapter_id is not None and any(fnmatchcase(adapter_id, p) for p in self.adapters)

    def ray_actor_options(self) -> dict[str, Any]:
        """`ray_actor_options` of the group's replicas: CPUs, GPUs, custom resources, node labels."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.node_labels:
            options["label_selector"] = dict(self.node_labels)
        return options


def base_name(config: ServeConfig, group: ReplicaGroupConfig | None = None) -> str:
    """The API name of a group's base model: its `served_model_name`, else (a group that keeps the
    top-level model) the top-level served name, else its `model`; `group` None: the top-level base."""
    top = config.served_model_name or config.model
    if group is None:
        return top
    if group.served_model_name:
        return group.served_model_name
    return top if group.model in (None, config.model) else group.model


def replica_groups(config: ServeConfig) -> list[ReplicaGroup]:
    """The groups of `config`, in order (one catch-all `default` group when none is configured)."""
    if not config.replica_groups:
        return [ReplicaGroup(DEFAULT_GROUP, REPLICA_DEPLOYMENT, CONTROLLER_DEPLOYMENT, config.num_replicas,
                             config.num_cpus, config.num_gpus, base=base_name(config))]
    return [ReplicaGroup(
        name=g.name, deployment=f"{REPLICA_DEPLOYMENT}-{g.name}",
        controller=f"{CONTROLLER_DEPLOYMENT}-{g.name}",
        num_replicas=g.num_replicas, num_cpus=config.num_cpus if g.num_cpus is None else g.num_cpus,
        num_gpus=config.num_gpus if g.num_gpus is None else g.num_gpus, resources=dict(g.resources),
        node_labels=dict(g.node_labels), adapters=tuple(g.adapters), tenants=frozenset(g.tenants),
        base=base_name(config, g),
    ) for g in config.replica_groups]


def select_group(groups: Sequence[ReplicaGroup], adapter_id: str | None,
                 tenant: str | None = None) -> ReplicaGroup | None:
    """The group that serves a request (see the module docstring); None: no group serves the adapter."""
    for group in groups:
        if group.matches(adapter_id, tenant):
            return group
    for group in groups:
        if group.catch_all:
            return group
    if adapter_id is None and groups:
        return groups[0]
    return None


def select_merge_group(groups: Sequence[ReplicaGroup], adapter_ids: Sequence[str],
                       tenant: str | None = None) -> ReplicaGroup:
    """The group that runs a merge of `adapter_ids` (see the module docstring). Raises
    AdapterNotFoundError for an adapter no group serves, RequestError (naming each adapter's group)
    when no group serves them all."""
    own: dict[str, ReplicaGroup] = {}
    for adapter_id in adapter_ids:
        group = select_group(groups, adapter_id, tenant)
        if group is None:
            raise AdapterNotFoundError(adapter_id, "not found (no replica group serves it)")
        own[adapter_id] = group
    for group in groups:
        if all(own[aid] is group or group.matches(aid, tenant) for aid in adapter_ids):
            return group
    placed = ", ".join(f"{aid!r} (group {group.name!r})" for aid, group in own.items())
    raise RequestError(f"merged_adapters: no replica group serves every adapter of the merge: {placed}; "
                       "merge adapters that one group serves")

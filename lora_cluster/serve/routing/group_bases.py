"""Several base models in one cluster: each replica group's engine settings, and which group a
request's `model` selects (pure policy, no Ray).

A replica group may name its own `model` and engine settings (`ReplicaGroupConfig.model`,
`.engine`); `group_config` is the configuration its replicas and its cluster controller run: the
top-level one with the group's settings over it (so the default group, and every group that names
neither, runs the top-level `model` unchanged). Each group serves one base, named in the API by
`ReplicaGroup.base`. In a cluster of several bases, each group's replicas check an adapter's
`base_model_name_or_path` against their base strictly (`base_model_check: strict`, refused with a
400 naming both) unless the top-level config or the group's `engine` sets `base_model_check`.

Selection (`select_for`), for a request's base model or adapter id and its tenant:
1. a request for a base model (its `model` is a base's name): `select_group` among the groups of
   that base only;
2. a request for an adapter: the bases whose groups list it (`AdapterCatalog`, from each group's
   adapter sources and registrations). Listed under two bases: refused (`AdapterBaseConflictError`,
   a 409 naming both), since the request cannot say which it means. Listed under one: `select_group`
   among that base's groups. Listed under none (or a one-base cluster): `select_group` among all
   groups, as in a one-base cluster.
A merge of adapters (`merge_groups`) runs among the groups of the base its adapters are listed
under; adapters listed under different bases are a 400 naming each one's base.
So an adapter only ever runs on a group of the base it is listed under, and a one-base cluster
selects exactly as `select_group` does.

The catalog is bounded by what the groups' replicas list (`MAX_CATALOG_ADAPTERS` per base) and is
replaced whole by each refresh; its age says when the caller should refresh it (`stale`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from lora_cluster.config import ReplicaGroupConfig, ServeConfig
from lora_cluster.errors import AdapterBaseConflictError, RequestError
from lora_cluster.serve.routing.replica_groups import DEFAULT_GROUP, ReplicaGroup, select_group

MAX_CATALOG_ADAPTERS = 100_000  # adapter ids remembered per base


def group_config(config: ServeConfig, group: ReplicaGroupConfig | None) -> ServeConfig:
    """The configuration a group's replicas and controller run: `config` with the group's `model`,
    `served_model_name` and engine settings over it (`group` None, or one naming none: `config`).
    Validated as a whole (a group setting out of range raises pydantic's ValidationError); the
    environment is not read again, so a `LORA_CLUSTER_*` override never hides a group's own value."""
    several = len({g.model or config.model for g in config.replica_groups}) > 1
    if group is None or (group.model is None and group.served_model_name is None and not group.engine
                         and not several):
        return config
    fields = config.model_dump()
    engine = fields["engine"]
    if several and "base_model_check" not in config.engine.model_fields_set:
        engine["base_model_check"] = "strict"  # several bases: an adapter of another base is refused
    engine.update(group.engine)
    if group.model is not None and group.model != config.model:
        fields.update(model=group.model, served_model_name=group.served_model_name)
        engine["model"] = group.model
    elif group.served_model_name is not None:
        fields["served_model_name"] = group.served_model_name
    return ServeConfig.model_validate(fields)


def group_configs(config: ServeConfig) -> dict[str, ServeConfig]:
    """Each group's configuration by group name (`{"default": config}` without replica_groups)."""
    if not config.replica_groups:
        return {DEFAULT_GROUP: config}
    return {g.name: group_config(config, g) for g in config.replica_groups}


def several_bases(groups: Sequence[ReplicaGroup]) -> bool:
    """The groups serve more than one base model."""
    return len({g.base for g in groups}) > 1


class AdapterCatalog:
    """Which bases list which adapter ids (from each group's `list_adapters` and registrations).
    `clock` is injected (seconds); `max_age_s` is how long a listing is trusted."""

    def __init__(self, clock: Callable[[], float], max_age_s: float = 10.0):
        self._clock, self.max_age_s = clock, max_age_s
        self._by_base: dict[str, frozenset[str]] = {}
        self._registered: dict[str, str] = {}  # adapter id -> base: kept across refreshes
        self._refreshed_at: float | None = None

    def replace(self, listings: dict[str, Iterable[str]]) -> None:
        """Take a fresh listing: {base name: adapter ids its groups list} (each cut to the bound)."""
        by_base = {}
        for base, ids in listings.items():
            kept = list(dict.fromkeys(ids))[:MAX_CATALOG_ADAPTERS]
            by_base[base] = frozenset(kept)
        self._by_base = by_base
        self._refreshed_at = self._clock()

    def register(self, base: str, adapter_id: str) -> None:
        """An adapter registered on `base`'s groups (vLLM's load_lora_adapter): listed there until
        `unregister`, whatever the refreshes list. The registrations bound these."""
        self._registered[adapter_id] = base

    def unregister(self, adapter_id: str) -> None:
        self._registered.pop(adapter_id, None)

    def stale(self) -> bool:
        """Never refreshed, or older than `max_age_s`."""
        return self._refreshed_at is None or self._clock() - self._refreshed_at > self.max_age_s

    def bases_of(self, adapter_id: str) -> list[str]:
        """The bases listing `adapter_id`, sorted."""
        bases = {base for base, ids in self._by_base.items() if adapter_id in ids}
        if adapter_id in self._registered:
            bases.add(self._registered[adapter_id])
        return sorted(bases)

    def adapters_of(self, base: str) -> list[str]:
        """The adapters listed under `base`: its registrations, then its groups' listing."""
        registered = [a for a, b in self._registered.items() if b == base]
        return list(dict.fromkeys([*registered, *sorted(self._by_base.get(base, ()))]))


def check_unique_base(adapter_id: str, bases: Sequence[str]) -> None:
    """Raise AdapterBaseConflictError when `adapter_id` is listed under more than one base."""
    if len(bases) > 1:
        raise AdapterBaseConflictError(adapter_id, f"exists under several base models ({', '.join(bases)}); "
                                       "an adapter id must be unique across the cluster's base models")


def registration_base(groups: Sequence[ReplicaGroup], adapter_id: str, catalog: AdapterCatalog) -> str:
    """The base an adapter registered at run time (vLLM's load_lora_adapter) joins: that of the group
    `select_group` picks for its id (the groups' `adapters` patterns, else the catch-all, else the
    first group). Raises AdapterBaseConflictError when another base already lists that id."""
    group = select_group(groups, adapter_id) or groups[0]
    others = [b for b in catalog.bases_of(adapter_id) if b != group.base]
    if others:
        raise AdapterBaseConflictError(adapter_id, f"exists under base model {others[0]!r}; it cannot also "
                                       f"be registered on base model {group.base!r} (replica group "
                                       f"{group.name!r}): an adapter id must be unique across base models")
    return group.base


def merge_groups(groups: Sequence[ReplicaGroup], adapter_ids: Sequence[str],
                 catalog: AdapterCatalog | None) -> list[ReplicaGroup]:
    """The groups a merge of `adapter_ids` may run on: with several bases, those of the one base that
    lists its adapters (`select_merge_group` then applies the group rules among them); all groups
    when no adapter is listed, or in a one-base cluster. Raises AdapterBaseConflictError for an
    adapter listed under two bases, RequestError when the adapters are listed under different bases."""
    if catalog is None or not several_bases(groups):
        return list(groups)
    bases: dict[str, str] = {}
    for adapter_id in adapter_ids:
        listed = catalog.bases_of(adapter_id)
        check_unique_base(adapter_id, listed)
        if listed:
            bases[adapter_id] = listed[0]
    if len(set(bases.values())) > 1:
        placed = ", ".join(f"{aid!r} (base {base!r})" for aid, base in bases.items())
        raise RequestError(f"merged_adapters: the adapters of a merge must share one base model: {placed}")
    if not bases:
        return list(groups)
    base = next(iter(bases.values()))
    return [g for g in groups if g.base == base]


def select_for(groups: Sequence[ReplicaGroup], *, base: str | None, adapter_id: str | None,
               tenant: str | None, catalog: AdapterCatalog | None) -> ReplicaGroup | None:
    """The group serving a request (see the module docstring); None: no group serves its adapter.
    `base` names a base model for a request without adapter (None: the first group's). Raises
    AdapterBaseConflictError for an adapter listed under two bases."""
    if adapter_id is None:
        chosen = [g for g in groups if base is None or g.base == base] or list(groups)
        return select_group(chosen, None, tenant)
    bases = catalog.bases_of(adapter_id) if catalog is not None and several_bases(groups) else []
    check_unique_base(adapter_id, bases)
    chosen = [g for g in groups if g.base == bases[0]] if bases else list(groups)
    return select_group(chosen, adapter_id, tenant)

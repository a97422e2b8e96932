"""What the names in a request run on: the base models' API names, the base a request runs on, the
adapter its `model` names (within what the caller's tenant may use; `fin@N` one version of `fin`, the
bare `fin` its latest: `adapter_versions`), and where an adapter registered through the vLLM API lies.

A route first asks which base a request runs on (`request_base`: the base its `model` names, or that
of the group its adapter or merge goes to, as the dispatcher will pick it), then tokenizes with that
base's tokenizer (`tokenization`) and sends its jobs with `base` set, so the dispatcher runs them on
that base only.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from lora_cluster.config import ServeConfig
from lora_cluster.errors import AdapterIdError, AdapterNotFoundError, AdapterVersionNotFoundError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.refs import parse_ref
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.serve.http.adapter_versions import VersionIndex
from lora_cluster.serve.http.registry import Registrations
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.replica.model import served_name
from lora_cluster.serve.routing.auth import Caller
from lora_cluster.serve.routing.dispatch import Dispatcher
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher


class ModelNames:
    """The model names of one ingress (see the module docstring)."""

    def __init__(self, config: ServeConfig, dispatcher: Dispatcher | GroupedDispatcher,
                 registrations: Registrations, releases: ReleaseBook | None = None):
        self.config, self.dispatcher, self.registrations = config, dispatcher, registrations
        self.versions = VersionIndex(registrations)
        self.releases = releases

    @property
    def base_name(self) -> str:
        """The API name of the (first group's) base model."""
        return served_name(self.config)

    @property
    def base_names(self) -> list[str]:
        """Every base model's API name (several with replica groups on several bases), first first."""
        bases = getattr(self.dispatcher, "bases", None) or []
        return list(dict.fromkeys([self.base_name, *bases]))

    def base_for(self, model: str | None) -> str | None:
        """The base model's API name when `model` names a base (by API name; the first base also by
        its `model`), else None (an adapter, or no `model`: the first base's group decides)."""
        if model == self.config.model:
            return self.base_name
        return model if model in self.base_names else None

    async def request_base(self, model: str | None, adapter: str | None, merged: Sequence[str] | None,
                           tenant: str | None) -> str | None:
        """The API name of the base model a request runs on (None: a one-base cluster, the first base):
        the base its `model` names, or that of the group its adapter (or merge) goes to. The dispatcher
        answers 404/409/400 here as it would when starting the request."""
        grouped = self.dispatcher
        if not isinstance(grouped, GroupedDispatcher) or not grouped.several_bases:
            return self.base_for(model)
        return await grouped.base_of(adapter, tenant, self.base_for(model), merged)

    def adapter_for(self, model: str | None, caller: Caller, *, merging: bool = False,
                    user: str | None = None) -> str | None:
        """The replica adapter id a request's `model` names (None: the base model; `fin@N` and `fin`
        resolved by `adapter_versions`, a bare name under release by the release for `user`, the
        end user: sticky; None: a share of the anonymous requests); a 404 with the body of an unknown
        adapter when the caller's tenant may not use the name (existence does not leak), the name is
        no valid adapter id (`request.adapter_id`: no replica is asked, no demand counted), or the
        version is not kept. `merging`: the request merges adapters (`merged_adapters`) onto the base
        model it names; the merge's own adapter ids are checked then (`schemas.merge_of`), so a
        tenant without `base_model` access may merge adapters it owns."""
        adapter = None if model is None or self.base_for(model) is not None else model
        name = None if adapter is None else parse_ref(adapter)[0]
        if not (merging and adapter is None) and not caller.may_use(name):
            raise ApiException(describe(AdapterNotFoundError(model or self.base_name, "not accessible")))
        if adapter is None:
            return None
        try:
            check_adapter_id(adapter)  # no adapter can have it: answered here, never sent to a replica
            return self.versions.replica_id(adapter, self._alias(adapter, user))
        except (AdapterIdError, AdapterVersionNotFoundError) as exc:
            raise ApiException(describe(exc)) from exc

    def _alias(self, adapter: str, user: str | None) -> int | None:
        """The version a bare name under release means for `user` (None: a `name@N`, or the latest)."""
        if self.releases is None or parse_ref(adapter)[1] is not None:
            return None
        kept = self.versions.versions(adapter)
        return self.releases.alias(adapter, kept, user or uuid.uuid4().hex) if kept else None

    def adapter_path(self, adapter_id: str | None) -> str | None:
        """The path of an adapter registered through vLLM's load_lora_adapter (None: not registered)."""
        return None if adapter_id is None else self.registrations.path(adapter_id)

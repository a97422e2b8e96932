"""Several base models in one cluster, without Ray: each group's configuration and base, which group a
request's `model` selects, and the refusals (an adapter id under two bases; an adapter of another base;
two bases under one name). The Ray app of two bases is tests/serve/test_multi_base_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig, load_config
from lora_cluster.engine import SamplingParams
from lora_cluster.errors import AdapterBaseConflictError, AdapterBaseModelError, ConfigError, RequestError
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.group_bases import (
    AdapterCatalog,
    group_config,
    group_configs,
    merge_groups,
    registration_base,
    select_for,
)
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.replica_groups import replica_groups, select_group
from lora_cluster.store.admission import AdmissionPolicy, check_base_model

TWO_BASES = [{"name": "llama"},
             {"name": "qwen", "model": "/srv/models/qwen3", "served_model_name": "qwen3", "adapters": ["q-*"],
              "engine": {"max_loras": 3, "adapter_source": ["/srv/adapters/qwen3"]}}]


def _config(groups: list[dict[str, Any]] = TWO_BASES, **top: Any) -> ServeConfig:
    return load_config({"model": "/srv/models/llama", "served_model_name": "llama", "max_loras": 5,
                        "replica_groups": groups, **top})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ----- configuration ---------------------------------------------------------------------------------


def test_the_default_group_inherits_the_top_level_model_and_settings():
    config = _config()
    llama = group_configs(config)["llama"]
    names = (llama.model, llama.served_model_name, llama.engine.max_loras)
    assert names == ("/srv/models/llama", "llama", 5), (
        "a group naming no model runs the top-level model, name and engine settings")


def test_a_group_runs_its_own_model_and_engine_settings_over_the_top_level_ones():
    qwen = group_configs(_config())["qwen"]
    assert qwen.model == "/srv/models/qwen3", "the group's replicas load its own model"
    assert qwen.served_model_name == "qwen3", "the group's base has its own API name"
    assert qwen.engine.max_loras == 3, "the group's engine settings replace the top-level ones"
    assert qwen.engine.adapter_source == ["/srv/adapters/qwen3"], "the group reads adapters from its sources"
    assert qwen.api.max_new_tokens == ServeConfig().api.max_new_tokens, (
        "settings the group does not name are the top-level ones")


def test_several_bases_check_adapters_against_their_base_strictly_unless_configured():
    assert {c.engine.base_model_check for c in group_configs(_config()).values()} == {"strict"}, (
        "with several bases, an adapter of another base is refused, not only logged")
    warned = group_configs(_config(base_model_check="warn"))
    assert warned["qwen"].engine.base_model_check == "warn", "an explicit top-level base_model_check is kept"


def test_a_group_setting_from_the_environment_does_not_hide_the_groups_own(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_MAX_LORAS", "7")
    configs = group_configs(_config())
    assert configs["qwen"].engine.max_loras == 3, "its engine setting wins over LORA_CLUSTER_MAX_LORAS"


def test_one_base_keeps_the_single_base_configuration_unchanged():
    groups = [{"name": "fin", "adapters": ["f-*"]}, {"name": "ops"}]
    config = load_config({"model": "m", "replica_groups": groups})
    assert all(c is config for c in group_configs(config).values()), (
        "groups naming no model nor settings run the top-level configuration itself")
    assert {g.base for g in replica_groups(config)} == {"m"}, "every group serves the one base"
    assert group_config(config, None) is config, "no group: the top-level configuration"


@pytest.mark.parametrize(("groups", "needle"), [
    ([{"name": "a", "engine": {"model": "x"}}], "engine lists model"),
    ([{"name": "a", "engine": {"max_lorras": 2}}], "max_lorras"),
    ([{"name": "a"}, {"name": "b", "model": "other", "served_model_name": "llama"}],
     "under the name 'llama'"),
])
def test_an_invalid_group_base_is_a_config_error_naming_it(groups, needle):
    with pytest.raises(ConfigError, match=needle):
        _config(groups)


def test_each_group_reports_its_bases_api_name():
    assert [g.base for g in replica_groups(_config())] == ["llama", "qwen3"], "each group names its base"
    unnamed = _config([{"name": "a"}, {"name": "b", "model": "org/other"}])
    assert [g.base for g in replica_groups(unnamed)] == ["llama", "org/other"], (
        "a group's base without served_model_name is named by its model")


# ----- selection ---------------------------------------------------------------------------------------


def _catalog(listings: dict[str, list[str]]) -> AdapterCatalog:
    catalog = AdapterCatalog(Clock())
    catalog.replace(listings)
    return catalog


GROUPS = replica_groups(_config([{"name": "llama"},
                                  {"name": "qwen", "model": "/q", "served_model_name": "qwen3"}]))


def test_a_base_name_selects_a_group_of_that_base():
    chosen = select_for(GROUPS, base="qwen3", adapter_id=None, tenant=None, catalog=None)
    assert chosen.name == "qwen", "a request for the qwen3 base runs on the qwen group"
    first = select_for(GROUPS, base=None, adapter_id=None, tenant=None, catalog=None)
    assert first.name == "llama", "a request naming no base runs on the first group's base"


def test_an_adapter_selects_a_group_of_the_base_listing_it():
    catalog = _catalog({"llama": ["a0", "a1"], "qwen3": ["q0"]})
    chosen = select_for(GROUPS, base=None, adapter_id="q0", tenant=None, catalog=catalog)
    assert chosen.name == "qwen", "an adapter listed under qwen3 runs there, not on the first catch-all group"
    llama = select_for(GROUPS, base=None, adapter_id="a1", tenant=None, catalog=catalog)
    assert llama.name == "llama", "an adapter listed under llama runs there"


def test_an_adapter_id_under_two_bases_is_refused_naming_both():
    catalog = _catalog({"llama": ["a0"], "qwen3": ["a0"]})
    with pytest.raises(AdapterBaseConflictError, match=r"'a0'.*llama, qwen3"):
        select_for(GROUPS, base=None, adapter_id="a0", tenant=None, catalog=catalog)


def test_one_base_selects_as_the_replica_groups_do():
    groups = replica_groups(load_config({"model": "m", "replica_groups": [{"name": "f", "adapters": ["f*"]},
                                                                          {"name": "o"}]}))
    catalog = _catalog({"m": ["f1", "o1"]})
    for adapter in ("f1", "o1", "x"):
        assert select_for(groups, base=None, adapter_id=adapter, tenant=None, catalog=catalog) is \
            select_group(groups, adapter), f"{adapter}: one base selects exactly as select_group"


def test_a_registration_joins_its_groups_base_and_is_refused_when_another_base_lists_it():
    groups = replica_groups(_config())
    catalog = _catalog({"llama": ["a0"], "qwen3": ["q-1"]})
    assert registration_base(groups, "q-7", catalog) == "qwen3", "a name the qwen patterns match joins qwen3"
    assert registration_base(groups, "a5", catalog) == "llama", "another name joins the catch-all's base"
    with pytest.raises(AdapterBaseConflictError, match=r"'q-1'.*'llama'.*'qwen3'"):
        registration_base(groups, "q-1", _catalog({"llama": ["q-1"], "qwen3": []}))


def test_the_catalog_keeps_registrations_across_refreshes_and_ages_with_its_clock():
    clock = Clock()
    catalog = AdapterCatalog(clock, max_age_s=10)
    assert catalog.stale(), "a catalog never refreshed is stale"
    catalog.replace({"llama": ["a0"], "qwen3": []})
    catalog.register("qwen3", "q-new")
    catalog.replace({"llama": ["a0"], "qwen3": ["q0"]})
    assert catalog.bases_of("q-new") == ["qwen3"], "a registered adapter stays listed after a refresh"
    assert catalog.adapters_of("qwen3") == ["q-new", "q0"], "a base lists its registrations and its sources"
    assert not catalog.stale(), "a fresh listing is trusted"
    clock.now = 11
    assert catalog.stale(), "a listing older than max_age_s is refreshed"
    catalog.unregister("q-new")
    assert catalog.bases_of("q-new") == [], "an unregistered adapter is no longer listed"


# ----- the dispatcher over groups of two bases ----------------------------------------------------------


class _GroupReplicas:
    """One group's `Dispatcher` as the GroupedDispatcher uses it: lists its adapters, records jobs."""

    def __init__(self, replica: str, adapters: list[str]):
        self.replica, self.adapters, self.jobs, self.listed = replica, adapters, [], 0

    def replica_stats(self) -> dict[str, RoutingStats]:
        return {self.replica: RoutingStats()}

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        assert method == "list_adapters", method
        self.listed += 1
        return list(self.adapters)

    async def start(self, job: GenerateJob, route: str) -> str:
        self.jobs.append(job)
        return self.replica

    async def start_all(self, jobs: list[GenerateJob], route: str, on_started: Any = None) -> list[str]:
        return [await self.start(job, route) for job in jobs]

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        return {self.replica: method}


def _job(adapter: str | None, base: str | None = None) -> GenerateJob:
    return GenerateJob(request_id="r", prompt=[1], adapter_id=adapter, sampling=SamplingParams(), base=base)


async def test_the_dispatcher_sends_each_base_and_adapter_to_its_bases_group():
    llama, qwen = _GroupReplicas("l-1", ["a0", "a1", "both"]), _GroupReplicas("q-1", ["q0", "both"])
    clock = Clock()
    dispatcher = GroupedDispatcher(list(zip(GROUPS, [llama, qwen], strict=True)), AdapterCatalog(clock, 10))
    started = [await dispatcher.start(_job("q0"), "/"), await dispatcher.start(_job("a1"), "/"),
               await dispatcher.start(_job(None, base="qwen3"), "/"), await dispatcher.start(_job(None), "/")]
    assert started == ["q-1", "l-1", "q-1", "l-1"], (
        "an adapter runs on its base's group, a base request on the base it names, else the first base")
    assert (llama.listed, qwen.listed) == (1, 1), "the listing is refreshed once while it is fresh"
    with pytest.raises(ApiException) as refused:
        await dispatcher.start(_job("both"), "/")
    assert refused.value.error.status == 409, "an adapter under two bases is a 409"
    assert "llama, qwen3" in refused.value.error.message, "the 409 names both bases"
    assert await dispatcher.broadcast_base("qwen3", "register_adapter") == {"q-1": "register_adapter"}, (
        "a registration on one base reaches that base's replicas only")
    assert dispatcher.bases == ["llama", "qwen3"], "the dispatcher lists both bases"


async def test_a_registration_under_another_bases_id_is_a_409():
    llama, qwen = _GroupReplicas("l-1", ["a0"]), _GroupReplicas("q-1", ["q0"])
    dispatcher = GroupedDispatcher(list(zip(GROUPS, [llama, qwen], strict=True)))
    assert await dispatcher.registration_base("new") == "llama", "a new id joins its group's base"
    groups = replica_groups(_config())
    dispatcher = GroupedDispatcher(list(zip(groups, [llama, _GroupReplicas("q-1", ["q-0"])], strict=True)))
    llama.adapters.append("q-0")
    with pytest.raises(ApiException) as refused:
        await dispatcher.registration_base("q-0")
    assert refused.value.error.status == 409, "an id another base lists cannot be registered on a second"


# ----- the base check when an adapter is loaded ---------------------------------------------------------


def test_an_adapter_of_another_base_is_refused_naming_both_bases_and_no_server_path():
    policy = AdmissionPolicy(shapes=ModelShapes(num_layers=1, modules={}), max_rank=64,
                             base_model="/srv/private/models/Llama-3.1-8B", base_model_check="strict")
    with pytest.raises(AdapterBaseModelError) as refused:
        check_base_model("fin-qa", {"base_model_name_or_path": "Qwen/Qwen3-8B"}, policy)
    message = str(refused.value)
    assert "'fin-qa'" in message, "the refusal names the adapter"
    assert "Qwen/Qwen3-8B" in message, "the refusal names the adapter's base_model_name_or_path"
    assert "Llama-3.1-8B" in message, "the refusal names the served base"
    assert "/srv/private" not in message, "the refusal never shows the server's path"


# ----- merges --------------------------------------------------------------------------------------------


def test_a_merge_runs_on_the_base_of_its_adapters_and_never_across_bases():
    catalog = _catalog({"llama": ["a0", "a1"], "qwen3": ["q0", "q1"]})
    assert [g.name for g in merge_groups(GROUPS, ["q0", "q1"], catalog)] == ["qwen"], (
        "a merge of Qwen3 adapters runs among the Qwen3 groups")
    assert [g.name for g in merge_groups(GROUPS, ["a0", "a1"], catalog)] == ["llama"], (
        "a merge of Llama adapters runs among the Llama groups")
    with pytest.raises(RequestError, match=r"'a0' \(base 'llama'\), 'q1' \(base 'qwen3'\)"):
        merge_groups(GROUPS, ["a0", "q1"], catalog)


async def test_the_dispatcher_sends_a_merge_to_its_bases_group():
    llama, qwen = _GroupReplicas("l-1", ["a0"]), _GroupReplicas("q-1", ["q0", "q1"])
    dispatcher = GroupedDispatcher(list(zip(GROUPS, [llama, qwen], strict=True)))
    merged = MergeSpec.parse(["q0", "q1"], [0.5, 0.5], max_ids=4)
    job = GenerateJob(request_id="r", prompt=[1], adapter_id=merged.adapter_id, sampling=SamplingParams(),
                      merge=merged)
    assert await dispatcher.start(job, "/") == "q-1", "a merge of Qwen3 adapters runs on the Qwen3 group"


async def test_a_stale_listing_is_refreshed_and_a_new_adapter_waits_for_it():
    import asyncio

    llama, qwen = _GroupReplicas("l-1", ["a0"]), _GroupReplicas("q-1", ["q0"])
    clock = Clock()
    dispatcher = GroupedDispatcher(list(zip(GROUPS, [llama, qwen], strict=True)), AdapterCatalog(clock, 10))
    await dispatcher.start(_job("q0"), "/")
    clock.now = 11
    qwen.adapters.append("q-new")
    assert await dispatcher.start(_job("q-new"), "/") == "q-1", (
        "an adapter the stale listing does not place waits for the refresh and runs on its base")
    clock.now = 22
    assert await dispatcher.start(_job("q0"), "/") == "q-1", "a placed adapter runs on its base at once"
    for _ in range(10):  # the refresh runs behind, on the loop
        await asyncio.sleep(0)
    assert qwen.listed == 3, "the stale listing is refreshed behind a placed adapter's request"


# ----- the environment -------------------------------------------------------------------------------


def test_group_bases_come_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_REPLICA_GROUPS", '[{"name": "a"}, {"name": "b", "model": "org/other", '
                       '"served_model_name": "other", "engine": {"max_loras": 2}}]')
    config = load_config({"model": "m"})
    assert [g.base for g in replica_groups(config)] == ["m", "other"], "the variable names bases"
    assert group_configs(config)["b"].engine.max_loras == 2, "and each group's engine settings"

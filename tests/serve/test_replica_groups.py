"""Replica groups (issue 10 part 6): group selection, deployment options and the grouped dispatcher,
without Ray (two groups on Ray: test_replica_groups_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig, load_config
from lora_cluster.engine import SamplingParams
from lora_cluster.errors import ConfigError
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.replica_groups import replica_groups, select_group

GROUPS = [
    {"name": "fin", "adapters": ["a[0-3]"], "tenants": ["finance"], "node_labels": {"lora-group": "finance"},
     "resources": {"fin-node": 0.5}, "num_gpus": 0.25},
    {"name": "ops", "num_replicas": 2},
]


def _groups(groups: list[dict[str, Any]] = GROUPS) -> list:
    return replica_groups(ServeConfig(model="m", num_cpus=2, replica_groups=groups))


# ----- selection and configuration (no Ray) --------------------------------------------------------------


def test_a_request_goes_to_the_first_group_matching_its_adapter_or_tenant():
    groups = _groups([{"name": "ops"}, *GROUPS[:1], {"name": "shared", "adapters": ["a*"]}])
    assert select_group(groups, "a2").name == "fin", "a pattern match wins over an earlier catch-all group"
    assert select_group(groups, "a7").name == "shared", "the first group whose pattern matches serves"
    assert select_group(groups, "b1").name == "ops", "an adapter no pattern matches goes to the catch-all"
    assert select_group(groups, "b1", tenant="finance").name == "fin", "a group listing the tenant serves"
    assert select_group(groups, None).name == "ops", "the base model goes to the catch-all group"


def test_without_a_catch_all_group_an_unmatched_adapter_has_no_group():
    groups = _groups([GROUPS[0], {"name": "shared", "adapters": ["s-*"]}])
    assert select_group(groups, "zz") is None, "no group serves an adapter that matches no pattern"
    assert select_group(groups, None).name == "fin", "the base model goes to the first group"
    assert select_group(groups, "zz", tenant="finance").name == "fin", "the tenant's group serves"


def test_without_replica_groups_one_default_group_serves_everything_under_the_old_names():
    (group,) = replica_groups(ServeConfig(model="m", num_replicas=3, num_cpus=1.5, num_gpus=0.5))
    assert group.name == "default", "the one group is named default"
    assert (group.deployment, group.controller) == ("LoraReplica", "ClusterController"), (
        "it is deployed under the names of a single-group app")
    assert (group.num_replicas, group.num_cpus, group.num_gpus) == (3, 1.5, 0.5), (
        "it has num_replicas replicas with num_cpus and num_gpus each")
    assert select_group([group], "anything").name == "default", "it serves every adapter"


def test_each_group_is_its_own_deployment_with_its_resources_and_node_labels():
    from lora_cluster.serve.app import replica_options

    config = ServeConfig(model="m", num_cpus=2, replica_groups=GROUPS)
    fin, ops = replica_groups(config)
    fin_options, ops_options = replica_options(config, fin), replica_options(config, ops)
    assert fin_options["name"] == "LoraReplica-fin", "a group's deployment is named after it"
    assert fin_options["ray_actor_options"] == {
        "num_cpus": 2, "num_gpus": 0.25, "resources": {"fin-node": 0.5},
        "label_selector": {"lora-group": "finance"}}, (
        "a group's replicas carry its resources, and its node labels as Ray's label selector")
    assert ops_options["num_replicas"] == 2, "a group has its own replica count"
    assert ops_options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0}, (
        "a group without resources of its own takes num_cpus and num_gpus")
    assert ops.controller == "ClusterController-ops", "each group has its own cluster controller"


def test_replica_groups_come_from_the_environment_as_json(monkeypatch):
    groups = '[{"name": "fin", "adapters": ["fin-*"]}, {"name": "ops"}]'
    monkeypatch.setenv("LORA_CLUSTER_REPLICA_GROUPS", groups)
    config = load_config({"model": "m"})
    assert [g.name for g in config.replica_groups] == ["fin", "ops"], (
        "LORA_CLUSTER_REPLICA_GROUPS is a JSON list")
    assert config.replica_groups[0].adapters == ["fin-*"], "a group's patterns come with it"


@pytest.mark.parametrize(("groups", "needle"), [
    ([{"name": "fin"}, {"name": "fin"}], "repeated: fin"),
    ([{"name": "Fin!"}], "name"),
    ([{"name": "fin", "num_replicas": 0}], "num_replicas"),
    ([{"name": "fin", "colour": "red"}], "colour"),
])
def test_an_invalid_group_is_a_config_error_naming_it(groups, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config({"model": "m", "replica_groups": groups})


class _GroupReplicas:
    """One group's `Dispatcher` as the GroupedDispatcher uses it: records the jobs it is given."""

    def __init__(self, replica: str):
        self.replica, self.jobs = replica, []

    def replica_stats(self) -> dict[str, RoutingStats]:
        return {self.replica: RoutingStats()}

    async def start(self, job: GenerateJob, route: str) -> str:
        self.jobs.append(job)
        return self.replica

    async def start_all(self, jobs: list[GenerateJob], route: str, on_started: Any = None) -> list[str]:
        return [await self.start(job, route) for job in jobs]

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        return {self.replica: method}


def _job(adapter: str | None, tenant: str | None = None, merge: Any = None) -> GenerateJob:
    return GenerateJob(request_id="r", prompt=[1], adapter_id=adapter, sampling=SamplingParams(),
                       tenant=tenant, merge=merge)


async def test_the_grouped_dispatcher_sends_each_job_to_its_groups_replicas_only():
    fin, ops = _GroupReplicas("fin-1"), _GroupReplicas("ops-1")
    groups = _groups([{"name": "fin", "adapters": ["a[0-3]"], "tenants": ["finance"]}, {"name": "ops"}])
    dispatcher = GroupedDispatcher(list(zip(groups, [fin, ops], strict=True)))
    merged = MergeSpec.parse(["a1", "a2"], [0.5, 0.5], max_ids=4)
    started = [await dispatcher.start(_job("a2"), "/"), await dispatcher.start(_job("a9"), "/"),
               await dispatcher.start(_job("a9", tenant="finance"), "/"),
               *(await dispatcher.start_all([_job(None), _job(None)], "/")),
               await dispatcher.start(_job(merged.adapter_id, merge=merged), "/")]
    assert started == ["fin-1", "ops-1", "fin-1", "ops-1", "ops-1", "fin-1"], (
        "a job runs in the group of its adapter, else its tenant, else the catch-all; a merged adapter "
        "in the group of its components")
    assert await dispatcher.broadcast("stats") == {"fin-1": "stats", "ops-1": "stats"}, (
        "an admin broadcast reaches every group's replicas")
    assert dispatcher.group_of_replica("ops-1") == "ops", "a replica id maps to its group"


async def test_an_adapter_that_no_group_serves_is_a_404_like_an_unknown_adapter():
    groups = _groups([{"name": "fin", "adapters": ["a[0-3]"]}])
    dispatcher = GroupedDispatcher([(groups[0], _GroupReplicas("fin-1"))])
    with pytest.raises(ApiException) as raised:
        await dispatcher.start(_job("b7"), "/")
    assert raised.value.error.status == 404, "no group serves b7: a 404"
    assert raised.value.error.code == "adapter_not_found", "with the code of an unknown adapter"


def _merge(*ids: str) -> Any:
    return MergeSpec.parse(list(ids), [1.0 / len(ids)] * len(ids), max_ids=4)


MERGE_GROUPS = [{"name": "shared", "adapters": ["shared-*"]},
                {"name": "finance", "adapters": ["fin-*"]},
                {"name": "hr", "tenants": ["hr"]},
                {"name": "ops"}]


async def test_a_merge_runs_in_the_group_that_serves_every_adapter_of_it():
    groups = _groups(MERGE_GROUPS)
    replicas = {g.name: _GroupReplicas(f"{g.name}-1") for g in groups}
    dispatcher = GroupedDispatcher([(g, replicas[g.name]) for g in groups])
    fin = _merge("fin-a", "fin-b")
    hr = _merge("shared-a", "hr-b")
    assert await dispatcher.start(_job(fin.adapter_id, tenant="finance", merge=fin), "/") == "finance-1", (
        "a merge of two finance adapters runs in the finance group")
    assert await dispatcher.start(_job(hr.adapter_id, tenant="hr", merge=hr), "/") == "hr-1", (
        "the hr group names the hr tenant, so it serves hr's merge of a shared adapter and its own")
    assert [j.merge for j in replicas["shared"].jobs] == [], "no merge was sent to the shared group"


async def test_a_merge_that_no_group_serves_whole_is_a_400_naming_each_adapters_group():
    groups = _groups(MERGE_GROUPS)
    replicas = {g.name: _GroupReplicas(f"{g.name}-1") for g in groups}
    dispatcher = GroupedDispatcher([(g, replicas[g.name]) for g in groups])
    crossing = _merge("shared-a", "fin-b")
    with pytest.raises(ApiException) as raised:
        await dispatcher.start_all([_job(crossing.adapter_id, tenant="finance", merge=crossing)] * 2, "/")
    error = raised.value.error
    assert error.status == 400, f"a merge across groups is refused as a bad request: {error}"
    assert "'shared-a' (group 'shared')" in error.message and "'fin-b' (group 'finance')" in error.message, (
        f"the refusal names each adapter of the merge and its group: {error.message}")
    assert all(not r.jobs for r in replicas.values()), "nothing was sent to any group's replicas"
    unserved = _merge("fin-a", "zz")
    only_fin = GroupedDispatcher([(groups[1], replicas["finance"])])
    with pytest.raises(ApiException) as raised:
        await only_fin.start(_job(unserved.adapter_id, merge=unserved), "/")
    assert raised.value.error.status == 404 and "zz" in raised.value.error.message, (
        f"an adapter of a merge that no group serves is a 404 naming it: {raised.value.error}")

"""Replica groups (issue 10 part 6): group selection, deployment options, and two groups on Ray.

The Ray test runs one app with two groups of one replica each on this machine: `fin` serves
adapters a0..a3, `ops` is the catch-all. A burst on `fin` (more requests than its batch slots, so
its cluster queue fills) must not make `ops` requests wait behind its queue (their p50 stays far
below `fin`'s; on 2 shared cores `ops` still slows with the CPU the burst takes, which a test does
not time closely: docs/bench_sla.md measures latencies), and every response's
`x-lora-replica` must name a replica of the request's group (replica ids are mapped to groups with
`/debug/replicas`, where each replica reports its group).
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from typing import Any

import httpx
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


# ----- two groups on Ray --------------------------------------------------------------------------------

FIN = ["a0", "a1", "a2", "a3"]
OPS = ["a8", "a9"]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def grouped_app(ray_app, demo_zoo):
    config = {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "num_cpus": 1,
        "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256,
        "max_ongoing_requests": 8, "routing_stats_period_s": 0.5, "controller_report_period_s": 0.25,
        "replica_groups": [{"name": "fin", "adapters": ["a[0-3]"]}, {"name": "ops"}],
    }
    with ray_app(config, name="groups") as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _complete(http: httpx.Client, adapter: str, max_tokens: int) -> tuple[float, str, int, float]:
    """(latency s, replica that served, status, end time) of one greedy completion."""
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"model": adapter, "prompt": PROMPT, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    end = time.monotonic()
    return end - t0, r.headers.get("x-lora-replica", ""), r.status_code, end


def _ops_latencies(http: httpx.Client, rounds: int) -> list[tuple[float, str, int, float]]:
    return [_complete(http, OPS[i % len(OPS)], 8) for i in range(rounds)]


@pytest.mark.e2e
def test_a_burst_on_one_group_stays_in_it_and_leaves_the_other_groups_latency(grouped_app):
    http = grouped_app
    for adapter in FIN + OPS:  # warm-up: every adapter on its group's device, both routers created
        assert _complete(http, adapter, 2)[2] == 200, f"{adapter}: the warm-up request succeeds"
    time.sleep(1.5)  # the replicas' reports reach the routers
    replicas = http.get("/debug/replicas").json()["replicas"]
    group_of = {rid: stats["group"] for rid, stats in replicas.items()}
    assert sorted(group_of.values()) == ["fin", "ops"], f"one replica per group reports: {group_of}"

    baseline = _ops_latencies(http, 12)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # 16 at once on 4 batch slots: queued
        burst = [pool.submit(_complete, http, FIN[i % len(FIN)], 48) for i in range(32)]
        time.sleep(0.5)  # the burst is running and queueing
        during = _ops_latencies(http, 12)
        burst_done = [f.result(timeout=300) for f in burst]

    fin_served = {r[1] for r in burst_done}
    ops_served = {r[1] for r in baseline + during}
    assert all(r[2] == 200 for r in burst_done), "every burst request succeeds"
    assert all(r[2] == 200 for r in baseline + during), "every ops request succeeds"
    assert {group_of.get(rid) for rid in fin_served} == {"fin"}, (
        f"every fin request ran on a fin replica: {fin_served} vs {group_of}")
    assert {group_of.get(rid) for rid in ops_served} == {"ops"}, (
        f"every ops request ran on an ops replica: {ops_served} vs {group_of}")
    views = http.get("/v1/cluster").json()["groups"]
    for name, view in views.items():
        in_view = {rid for node in view["nodes"].values() for rid in node["replicas"]}
        assert {group_of.get(rid) for rid in in_view} == {name}, (
            f"the {name} group's cluster controller knows only {name} replicas: {in_view} vs {group_of}")
    assert views["fin"]["ingress"]["admission"].get("parked", 0) > 0, (
        "the fin burst overflowed fin's batch slots into fin's own cluster queue")
    assert views["ops"]["ingress"]["admission"].get("parked", 0) == 0, (
        "no ops request waited in a cluster queue during the fin burst")
    assert max(r[3] for r in burst_done) > max(r[3] for r in during), (
        "the fin burst was still running when the last ops request of the comparison ended")
    # latency is a benchmark's figure (printed here, never asserted: the 2 cores are shared); the
    # isolation it reflects is asserted above: ops ran only on ops replicas, while the burst ran,
    # and never waited in a cluster queue
    base = [r[0] for r in baseline]
    p50_base, p50_during = statistics.median(base), statistics.median(r[0] for r in during)
    fin_p50 = statistics.median(r[0] for r in burst_done)
    print(f"\nops p50 idle {p50_base * 1e3:.1f} ms, during the fin burst {p50_during * 1e3:.1f} ms; "
          f"fin burst p50 {fin_p50 * 1e3:.1f} ms, longest {max(r[0] for r in burst_done):.2f} s")

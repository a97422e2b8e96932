"""Merged adapters (`merged_adapters`) under tenants and replica groups, through the HTTP API.

A merge names the base model (OpenAI `model`, or no LoRAX `adapter_id`) and merges the adapters of
its `ids`: a tenant without `base_model` access merges adapters it owns; one of another tenant's
adapters in the merge is a 404, as that adapter alone is. With replica groups, a merge runs in the
group that serves every adapter of it, and a merge that no group serves whole is a 400 naming each
adapter's group (an adapter never leaves its group). The app is the ingress's FastAPI app in process
around the tenants' fake replica (`tenant_app.ZooDispatcher`, which also refuses an unknown adapter
inside a merge).
"""

from __future__ import annotations

from typing import Any

import pytest
from tenant_app import FIN_KEY, HR_KEY, ZOO, ZooDispatcher, bearer, tenant_app

from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.replica_groups import replica_groups


class MergingZooDispatcher(ZooDispatcher):
    """The zoo's replica, which also merges: every adapter of a merge must be in the zoo."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        for adapter_id in job.merge.ids if job.merge is not None else ():
            if adapter_id not in ZOO:
                error = AdapterNotFoundError(adapter_id, "not found in the configured adapter sources")
                raise ApiException(describe(error))
        if job.merge is not None:  # its merged id is no zoo adapter: served as the zoo's replica serves
            return await super(ZooDispatcher, self).start(job, route)
        return await super().start(job, route)


def merge_body(ids: list[str]) -> dict[str, Any]:
    return {"ids": ids, "weights": [1.0 / len(ids)] * len(ids)}


def merge_request(endpoint: str, ids: list[str]) -> tuple[str, dict[str, Any]]:
    """(path, body) of a generation with a merge of `ids` onto the base model through `endpoint`."""
    merged = merge_body(ids)
    lorax = {"max_new_tokens": 2, "merged_adapters": merged}  # no adapter_id: onto the base model
    return {
        "completions": ("/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2,
                                            "merged_adapters": merged}),
        "chat": ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2, "merged_adapters": merged}),
        "generate": ("/generate", {"inputs": "hi", "parameters": lorax}),
        "generate_stream": ("/generate_stream", {"inputs": "hi", "parameters": lorax}),
    }[endpoint]


MERGE_ENDPOINTS = ["completions", "chat", "generate", "generate_stream"]


@pytest.mark.parametrize("endpoint", MERGE_ENDPOINTS)
async def test_a_tenant_without_base_model_access_merges_adapters_it_owns(tenants_file, endpoint):
    dispatcher = MergingZooDispatcher()
    async with tenant_app(tenants_file, dispatcher) as client:
        path, body = merge_request(endpoint, ["hr-a", "hr-secret"])
        merged = await client.post(path, json=body, headers=bearer(HR_KEY))
        path, body = merge_request(endpoint, ["hr-a", "fin-a"])
        foreign = await client.post(path, json=body, headers=bearer(HR_KEY))
    assert merged.status_code == 200, (
        f"{endpoint}: hr (base_model: false) merges two adapters it owns onto the base model: {merged.text}")
    assert [list(j.merge.ids) for j in dispatcher.jobs if j.merge is not None] == [["hr-a", "hr-secret"]], (
        f"{endpoint}: the merge of hr's own adapters was sent, and only it")
    assert foreign.status_code == 404, (
        f"{endpoint}: a merge with another tenant's adapter is a 404: {foreign.text}")
    assert "fin-a" in foreign.json()["error"]["message"], f"{endpoint}: the 404 names that adapter"


async def test_the_base_model_alone_stays_refused_to_a_tenant_without_access(tenants_file):
    async with tenant_app(tenants_file, MergingZooDispatcher()) as client:
        alone = await client.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2},
                                  headers=bearer(HR_KEY))
        lorax = await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                                  headers=bearer(HR_KEY))
    assert alone.status_code == 404, (
        f"without a merge, base_model: false still refuses the base model: {alone.text}")
    assert lorax.status_code == 404, f"the same through LoRAX without adapter_id: {lorax.text}"


# ----- replica groups --------------------------------------------------------------------------------------


class GroupReplica(MergingZooDispatcher):
    """One group's replicas: the zoo's replica, named for its group."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group

    def replica_stats(self) -> dict[str, RoutingStats]:
        return {f"{self.group}-1": RoutingStats()}


def grouped() -> tuple[GroupedDispatcher, dict[str, GroupReplica]]:
    """A shared group (shared-*), a finance group (fin-*) and an hr group (the hr tenant)."""
    config = ServeConfig(model="base", replica_groups=[
        {"name": "shared", "adapters": ["shared-*"]}, {"name": "finance", "adapters": ["fin-*"]},
        {"name": "hr", "tenants": ["hr"]}])
    groups = replica_groups(config)
    replicas = {g.name: GroupReplica(g.name) for g in groups}
    return GroupedDispatcher([(g, replicas[g.name]) for g in groups]), replicas


@pytest.mark.parametrize("endpoint", MERGE_ENDPOINTS)
async def test_a_merge_across_replica_groups_is_a_400_naming_each_adapters_group(tenants_file, endpoint):
    dispatcher, replicas = grouped()
    async with tenant_app(tenants_file, dispatcher) as client:
        path, body = merge_request(endpoint, ["shared-x", "fin-a"])
        crossing = await client.post(path, json=body, headers=bearer(FIN_KEY))
        path, body = merge_request(endpoint, ["fin-a", "fin-b"])
        within = await client.post(path, json=body, headers=bearer(FIN_KEY))
    assert crossing.status_code == 400, f"{endpoint}: no group serves shared-x and fin-a: {crossing.text}"
    message = crossing.json()["error"]["message"]
    assert "'shared-x' (group 'shared')" in message and "'fin-a' (group 'finance')" in message, (
        f"{endpoint}: the refusal names each adapter of the merge and its group: {message}")
    assert within.status_code == 200, f"{endpoint}: a merge of two finance adapters is served: {within.text}"
    assert [list(j.merge.ids) for j in replicas["finance"].jobs] == [["fin-a", "fin-b"]], (
        f"{endpoint}: the finance merge ran in the finance group")
    assert not replicas["shared"].jobs and not replicas["hr"].jobs, (
        f"{endpoint}: nothing of finance's merges reached another group (fin-a never loads on shared nodes)")

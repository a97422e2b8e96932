"""The ingress's usage counters (`serve.ops.usage_metrics`): tokens and device-seconds per tenant
and SLA class at /metrics, refusals counted, and labels bounded by the tenants file and the classes
whatever names reach them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from app_client import FakeDispatcher, FakeStream, outputs
from prometheus_client.parser import text_string_to_metric_families
from tenant_app import ADMIN_KEY, FIN_KEY, bearer, tenant_app

from lora_cluster.errors import ClusterOverloadedError
from lora_cluster.serve.ops import usage_metrics
from lora_cluster.serve.ops.generation_metrics import GenerationMetrics
from lora_cluster.serve.ops.metrics import NO_TENANT, REGISTRY
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation
from lora_cluster.tenancy.watch import TenantsWatcher

DEVICE_S = 0.125  # what the fake replica charges each generation


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series of a scrape (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def registry_value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def bounded(tenants_file) -> Iterator[None]:
    """The labels as the ingress bounds them: tenants finance and hr, three classes."""
    watcher = TenantsWatcher(str(tenants_file), start=False)
    usage_metrics.configure(watcher, ("interactive", "standard", "batch"))
    yield
    usage_metrics.configure(None, ())


class ChargingReplica(FakeDispatcher):
    """The fake replica, charging each generation DEVICE_S on its items, with the generation's
    metrics as the dispatcher starts them."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        first, *rest = [{**item, "device_s": DEVICE_S} for item in outputs(job)]
        meter = GenerationMetrics(job.adapter_id, job.tenant, job.priority_class)
        meter.started()
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest), meter=meter)


async def test_a_tenants_tokens_and_device_seconds_are_counted_per_class(tenants_file, bounded):
    labels = {"tenant": "finance", "priority_class": "interactive"}
    before = {n: registry_value(n, **labels) for n in (
        "lora_cluster_usage_output_tokens_total", "lora_cluster_usage_device_seconds_total",
        "lora_cluster_usage_prompt_tokens_total")}
    async with tenant_app(tenants_file, ChargingReplica()) as client:
        for _ in range(2):
            body = {"model": "fin-a", "prompt": "hi", "max_tokens": 3}
            reply = await client.post("/v1/completions", json=body, headers=bearer(FIN_KEY))
            assert reply.status_code == 200, f"precondition: served: {reply.text}"
        scrape = (await client.get("/metrics", headers=bearer(ADMIN_KEY))).text
    output = sample(scrape, "lora_cluster_usage_output_tokens_total", **labels)
    assert output - before["lora_cluster_usage_output_tokens_total"] == 6, \
        "the output tokens the client received: 2 requests of 3 tokens"
    device = sample(scrape, "lora_cluster_usage_device_seconds_total", **labels)
    assert device - before["lora_cluster_usage_device_seconds_total"] == pytest.approx(2 * DEVICE_S), \
        "the device-seconds the replica charged, from the final items"
    prompt = sample(scrape, "lora_cluster_usage_prompt_tokens_total", **labels)
    assert prompt > before["lora_cluster_usage_prompt_tokens_total"], "prompt tokens are counted"


class FullClusterQueue(FakeDispatcher):
    async def start(self, job: GenerateJob, route: str):
        raise ClusterOverloadedError("the cluster queue is full (8 requests wait; cluster_queue_size)", 2.0)


async def test_a_refused_request_is_counted_refused(tenants_file, bounded):
    labels = {"tenant": "finance", "priority_class": "interactive", "outcome": "refused"}
    before = registry_value("lora_cluster_usage_requests_total", **labels)
    async with tenant_app(tenants_file, FullClusterQueue()) as client:
        reply = await client.post("/v1/completions", json={"model": "fin-a", "prompt": "hi", "max_tokens": 3},
                                  headers=bearer(FIN_KEY))
    assert reply.status_code == 429, f"precondition: refused: {reply.text}"
    assert registry_value("lora_cluster_usage_requests_total", **labels) == before + 1, \
        "the refusal is counted under its tenant and class"


def test_labels_are_bounded_by_the_tenants_file_and_the_classes(bounded):
    for i in range(50):  # names no tenants file holds, classes no configuration has
        usage_metrics.count(tenant=f"client-chosen-{i}", sla_class=f"class-{i}", outcome="completed",
                            output_tokens=1)
    usage_metrics.count(tenant=None, sla_class="standard", outcome="completed", output_tokens=1)
    tenants = {s.labels["tenant"] for family in REGISTRY.collect()
               if family.name == "lora_cluster_usage_output_tokens" for s in family.samples}
    assert not any(t.startswith("client-chosen") for t in tenants), f"no client-chosen label: {tenants}"
    assert {"other", NO_TENANT} <= tenants, f"unknown tenants are 'other', none is {NO_TENANT!r}: {tenants}"
    with pytest.raises(ValueError, match="not one of"):
        usage_metrics.count(tenant="finance", sla_class="standard", outcome="whatever")

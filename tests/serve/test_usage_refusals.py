"""Usage records of the requests the ingress refuses itself (`serve.ops.usage_refusals`): one
`refused` record per refused request, with its tenant, adapter, SLA class and wait and no device time,
on the OpenAI and LoRAX routes; nothing for an error that is not a refusal."""

from __future__ import annotations

import pytest
from app_client import FakeDispatcher
from helpers import FakeClock
from tenant_app import FIN_KEY, bearer, tenant_app

from lora_cluster.errors import ClusterOverloadedError, ClusterQueueTimeoutError, RequestError
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.tenancy.usage_record import Outcome


async def ignore(batch) -> None:
    return None


def test_a_refusal_leaving_watch_is_one_refused_record_with_its_wait():
    shipper = UsageShipper(ignore, background=False)
    timer = FakeClock()
    meter = RefusalMeter(shipper, "demo", "ingress-1", clock=lambda: 1_796_000_000.0, timer=timer)
    watch = meter.watch(tenant="acme", adapter_id="fin@3", sla_class="batch", request_id="cmpl-1")
    with pytest.raises(ClusterQueueTimeoutError), watch:
        timer.advance(2.5)  # waited in the cluster queue, then given up
        raise ClusterQueueTimeoutError("waited longer than cluster_queue_timeout_s")
    (rec,) = shipper.buffer.take()
    assert rec.outcome is Outcome.REFUSED, "a request given up in the cluster queue is refused"
    assert (rec.request_id, rec.tenant, rec.adapter, rec.version, rec.sla_class) == (
        "cmpl-1", "acme", "fin", 3, "batch"), f"the request's names: {rec}"
    assert (rec.base_model, rec.replica) == ("demo", "ingress-1"), "the base model, the ingress that refused"
    assert rec.queue_s == 2.5, "its wait is its queue time"
    assert rec.device_s == 0.0 and rec.output_tokens == 0, "a refused request used no device time"


def test_an_error_that_is_not_a_refusal_is_not_recorded():
    shipper = UsageShipper(ignore, background=False)
    meter = RefusalMeter(shipper, "demo")
    with pytest.raises(RequestError), meter.watch(tenant="acme", adapter_id=None, sla_class="standard"):
        raise RequestError("a bad parameter")
    assert len(shipper.buffer) == 0, "a 400 is the client's error, not a refusal: no record"
    RefusalMeter(None, "demo").refused(tenant="acme", adapter_id=None, sla_class="standard")  # no store


class FullClusterQueue(FakeDispatcher):
    """The cluster queue refuses every request, as the ingress's admission does."""

    async def start(self, job: GenerateJob, route: str):
        raise ClusterOverloadedError("the cluster queue is full (8 requests wait; cluster_queue_size)", 2.0)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"model": "fin-a", "prompt": "hi", "max_tokens": 2}),
    ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "fin-a", "max_new_tokens": 2}}),
])
async def test_a_request_refused_by_the_cluster_queue_is_recorded_refused(tenants_file, route, body):
    shipper = UsageShipper(ignore, background=False)
    refusals = RefusalMeter(shipper, "base", "ingress-1")
    async with tenant_app(tenants_file, FullClusterQueue(), refusals=refusals) as client:
        reply = await client.post(route, json=body, headers=bearer(FIN_KEY))
    assert reply.status_code == 429, f"precondition: the request is refused: {reply.text}"
    records = shipper.buffer.take()
    assert len(records) == 1, f"one record for the refused request: {records}"
    names = (records[0].tenant, records[0].adapter, records[0].sla_class)
    assert names == ("finance", "fin-a", "interactive"), f"tenant, adapter, class: {records[0]}"
    assert records[0].outcome is Outcome.REFUSED, "its outcome is refused"

"""Usage records from a replica to the store (`serve.ops.usage_shipper`, `serve.ops.usage_sink`):
one call per flush whatever the number of requests, a failed call sent again, the rest sent at close,
and the store's file keeps what it acknowledged across a restart of its owner."""

from __future__ import annotations

import asyncio

from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.serve.ops.usage_sink import UsageSinkCore
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord


def rec(rid: str, tenant: str = "acme", output_tokens: int = 5) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant=tenant, adapter="a1", version=1, sla_class="standard",
                       base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=0,
                       output_tokens=output_tokens, device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED,
                       ended_at=1_795_995_601.0)


async def test_many_requests_are_sent_in_one_call_per_flush():
    calls: list[list[UsageRecord]] = []

    async def send(batch):
        calls.append(batch)

    shipper = UsageShipper(send, background=False)
    for i in range(50):
        shipper.add(rec(f"r{i}"))
    await shipper.flush()
    await shipper.flush()
    assert len(calls) == 1, "one call for the batch, none for an empty buffer"
    assert len(calls[0]) == 50, "the call carries every record"


async def test_a_failed_send_is_sent_again_at_the_next_flush():
    calls: list[list[UsageRecord]] = []
    fail = [True]

    async def send(batch):
        if fail[0]:
            raise ConnectionError("sink down")
        calls.append(batch)

    shipper = UsageShipper(send, background=False)
    shipper.add(rec("r1"))
    assert not await shipper.flush(), "a failed call is reported"
    fail[0] = False
    assert await shipper.flush(), "the next call succeeds"
    assert [r.request_id for r in calls[0]] == ["r1"], "the failed batch is sent again"


async def test_a_send_that_never_answers_is_given_up_and_kept():
    async def send(batch):
        await asyncio.sleep(60)

    shipper = UsageShipper(send, background=False, timeout_s=0.05)
    shipper.add(rec("r1"))
    assert not await shipper.flush(), "a send past the timeout counts as failed"
    assert len(shipper.buffer) == 1, "its record stays for the next flush"


async def test_the_background_task_flushes_and_close_sends_the_rest(tmp_path):
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=86400.0)
    shipper = UsageShipper(sink.record, interval_s=0.02)
    shipper.add(rec("r1", tenant="acme"))
    for _ in range(100):
        if shipper.sent:
            break
        await asyncio.sleep(0.01)
    assert shipper.sent == 1, "the background task sent the record within a few intervals"
    shipper.add(rec("r2", tenant="beta"))
    await shipper.close()
    rows = await sink.query(group_by=("tenant",))
    assert [(r["tenant"], r["requests"]) for r in rows] == [("acme", 1), ("beta", 1)], \
        "both records reached the store, one per request"
    sink.close()
    reopened = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=86400.0)
    rows = await reopened.query(group_by=())
    assert rows[0]["requests"] == 2, "a restarted sink reports the usage stored before"
    reopened.close()

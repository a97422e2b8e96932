"""Usage records from a replica to the store (`serve.ops.usage_shipper`, `serve.ops.usage_sink`):
one call per flush whatever the number of requests, a failed call sent again, the rest sent at close,
the store's file keeps what it acknowledged across a restart of its owner, and every batch counts
exactly once whatever calls, replies and store processes are lost."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

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
    assert len(calls[0].records) == 50, "the call carries every record"


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
    assert [r.request_id for r in calls[0].records] == ["r1"], "the failed batch is sent again"


async def test_a_send_that_never_answers_is_given_up_and_kept():
    async def send(batch):
        await asyncio.sleep(60)

    shipper = UsageShipper(send, background=False, timeout_s=0.05)
    shipper.add(rec("r1"))
    assert not await shipper.flush(), "a send past the timeout counts as failed"
    assert shipper.pending == 1, "its record stays for the next flush"


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


async def test_a_batch_whose_reply_was_lost_is_counted_once(tmp_path):
    sink = UsageSinkCore(str(tmp_path / "usage.db"), retention_s=10 * 365 * 86400.0)  # keeps rec()'s rows
    replies_lost = [1]

    async def send(batch):
        await sink.record(batch)  # the sink stores it ...
        if replies_lost[0]:
            replies_lost[0] -= 1
            raise ConnectionError("... and its reply is lost on the way back")

    shipper = UsageShipper(send, background=False)
    shipper.add(rec("r1"))
    assert not await shipper.flush(), "the lost reply counts as a failed send"
    shipper.add(rec("r2"))
    assert await shipper.flush(), "the batch is sent again and acknowledged"
    assert await shipper.flush(), "what arrived meanwhile is sent in the next batch"
    rows = await sink.query(group_by=())
    assert rows[0]["requests"] == 2, f"one record per request: {rows}"
    assert rows[0]["device_s"] == 1.0, f"r1's 0.5 device-seconds are counted once, not twice: {rows}"
    assert rows[0]["queue_s"] == 0.2, f"r1's queue-seconds are counted once: {rows}"
    sink.close()


async def test_random_lost_calls_replies_and_store_restarts_count_every_part_exactly_once(tmp_path):
    rng = random.Random(48)
    path = str(tmp_path / "usage.db")
    sinks = [UsageSinkCore(path, retention_s=10 * 365 * 86400.0)]

    async def send(batch):
        fate = rng.random()
        if fate < 0.2:
            raise ConnectionError("the call is lost before it lands")
        await sinks[-1].record(batch)
        if fate < 0.4:
            raise ConnectionError("the reply is lost after it landed")
        if fate < 0.45:  # the store is killed after it committed, and restarted on the same file
            sinks.append(UsageSinkCore(path, retention_s=10 * 365 * 86400.0))

    shippers = [UsageShipper(send, background=False, owner=f"replica-{i}") for i in range(3)]
    expected: dict[str, float] = {}  # request id -> device-seconds of all its parts
    for step in range(300):
        rid = f"r{rng.randrange(120)}"  # a request may come back in parts (re-dispatch, another replica)
        part = replace(rec(rid, output_tokens=rng.randrange(1, 50)), device_s=rng.choice([0.25, 0.5, 1.0]))
        expected[rid] = expected.get(rid, 0.0) + part.device_s
        shipper = shippers[rng.randrange(3)]
        shipper.add(part)
        if step % 7 == 0:
            await shipper.flush()
    for shipper in shippers:
        for _ in range(100):  # a bounded number of retries: each flush fails at most 45% of the time
            if not len(shipper.buffer) and not shipper.pending:
                break
            await shipper.flush()
        assert not len(shipper.buffer) and not shipper.pending, "precondition: every record was sent"
    store = sinks[-1].store
    for rid, device_s in expected.items():
        got = store.get(rid)
        assert got is not None, f"{rid}: one record"
        assert got.device_s == pytest.approx(device_s), f"{rid}: every part's device time, once"
    total = (await sinks[-1].query(group_by=()))[0]
    assert total["requests"] == len(expected), f"one record per request, whatever was sent again: {total}"
    assert total["device_s"] == pytest.approx(sum(expected.values())), \
        f"the sums count each part once: {total}"
    for sink in sinks:
        sink.close()


async def test_residency_and_load_seconds_from_the_meter_reach_the_store_once_across_a_resent_batch(tmp_path):
    from lora_cluster.engine.schedule.step_meter import StepMeter
    from lora_cluster.serve.ops.usage_shipper import take_meter

    ticks = iter([100.0, 103.0])
    meter = StepMeter(clock=lambda: next(ticks))
    meter.resided(["a1@1"])
    meter.resided(["a1@1", "b2@1"])  # 3 s each
    meter.loaded("b2@1", 0.25)

    class Engine:
        pass

    engine = Engine()
    engine.meter = meter
    core = UsageSinkCore(str(tmp_path / "usage.db"), 365 * 86400.0)  # keeps the batch seqs
    lost_reply = [True]

    async def send(batch):
        await core.record(batch)
        if lost_reply.pop() if lost_reply else False:
            raise TimeoutError("the reply was lost")

    async def take():
        return take_meter(engine)

    shipper = UsageShipper(send, background=False, owner="r0", take=take, clock=lambda: 1_795_995_601.0)
    shipper.add(rec("q1"))
    assert not await shipper.flush(), "the reply was lost: the batch stays pending"
    assert await shipper.flush(), "sent again under the same id"
    assert await shipper.flush(), "nothing new: the meter was cleared by the take"
    store = core.store
    assert store.residency() == {"a1@1": 3.0, "b2@1": 3.0}, "slot-seconds taken once"
    assert store.loads() == {"a1@1": 0.0, "b2@1": 0.25}, "load seconds taken once"
    rows = store.query(group_by=("adapter",), residency=True)
    assert [(r["adapter"], r["requests"], r["slot_s"], r["load_s"]) for r in rows] == [
        ("a1", 1, 3.0, 0.0), ("b2", 0, 3.0, 0.25)]
    assert "slot_s" not in store.query(group_by=("adapter",), tenant="acme", residency=True)[0], \
        "a tenant-scoped query has no residency (the store keeps it per adapter only)"
    core.close()

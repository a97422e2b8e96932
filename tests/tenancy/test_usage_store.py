"""Usage records and their durable store (`tenancy.usage_record`, `tenancy.usage_store`): one record per
request id whatever the parts, per-minute sums equal to the records, grouping, filters, durability
across a reopen, bounded per-request rows, each sender's batch taken exactly once."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lora_cluster.errors import RequestError
from lora_cluster.tenancy import usage_store
from lora_cluster.tenancy.usage_record import MAX_FIELD_CHARS, Outcome, UsageBatch, UsageRecord, final_outcome
from lora_cluster.tenancy.usage_store import UsageStore

T0 = 1_795_995_600.0  # 2026-11-29T23:40:00Z, a minute boundary


def rec(rid: str, tenant: str = "acme", adapter: str = "a1", **kw) -> UsageRecord:
    base = dict(request_id=rid, tenant=tenant, adapter=adapter, version=1, sla_class="standard",
                base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=0, output_tokens=5,
                device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=T0 + 1)
    return UsageRecord(**{**base, **kw})


@pytest.fixture
def store(tmp_path):
    s = UsageStore(tmp_path / "usage.db")
    yield s
    s.close()


def test_a_retried_request_is_one_record_with_both_attempts_cost(store: UsageStore):
    assert store.record([rec("r1", output_tokens=0, device_s=0.2, outcome=Outcome.FAILED, replica="r0")]) == 1
    assert store.record([rec("r1", output_tokens=7, device_s=0.3, replica="r1")]) == 0, (
        "a second part of a request already stored is not a new record"
    )
    merged = store.get("r1")
    assert merged is not None, "the request has its record"
    assert merged.device_s == pytest.approx(0.5), "both attempts' device time is charged"
    assert merged.output_tokens == 7, "tokens are those the client received: the last attempt's"
    assert merged.outcome is Outcome.COMPLETED, "the outcome is the last attempt's"
    [row] = store.query(group_by=("tenant",))
    assert row["requests"] == 1, "the per-minute sums count the request once"
    assert row["device_s"] == pytest.approx(0.5), "the per-minute sums hold the merged device time"
    assert row["output_tokens"] == 7, "the per-minute sums hold the merged tokens"


def test_a_preempted_then_completed_request_reads_preempted_resumed(store: UsageStore):
    store.record([rec("r1", preempted=True, outcome=Outcome.CANCELLED, output_tokens=2)])
    store.record([rec("r1", output_tokens=6)])
    merged = store.get("r1")
    assert merged is not None and merged.outcome is Outcome.PREEMPTED_RESUMED, (
        "a request completed after a preemption with recompute reads preempted_resumed"
    )


def test_the_minute_sums_equal_the_sum_of_the_records(store: UsageStore):
    rng = random.Random(1)
    parts = [rec(f"r{rng.randint(0, 40)}", tenant=rng.choice(["acme", "globex"]),
                 output_tokens=rng.randint(0, 50), device_s=rng.uniform(0, 1),
                 ended_at=T0 + rng.uniform(0, 7200)) for _ in range(300)]
    for i in range(0, len(parts), 17):
        store.record(parts[i:i + 17])
    records = [store.get(f"r{i}") for i in range(41)]
    records = [r for r in records if r is not None]
    rows = {row["tenant"]: row for row in store.query(group_by=("tenant",))}
    for tenant in ("acme", "globex"):
        mine = [r for r in records if r.tenant == tenant]
        assert rows[tenant]["requests"] == len(mine), f"{tenant}: one request per record"
        assert rows[tenant]["output_tokens"] == sum(r.output_tokens for r in mine), f"{tenant}: tokens add up"
        assert rows[tenant]["device_s"] == pytest.approx(sum(r.device_s for r in mine)), (
            f"{tenant}: device-seconds add up"
        )


def test_usage_groups_by_hour_and_day_and_filters_by_tenant(store: UsageStore):
    store.record([rec("r1", ended_at=T0 + 30), rec("r2", ended_at=T0 + 1800),
                  rec("r3", tenant="globex", ended_at=T0 + 1800)])
    hours = store.query(group_by=("hour",), tenant="acme")
    assert [(h["hour"], h["requests"]) for h in hours] == [("2026-11-29T23:00:00Z", 1),
                                                          ("2026-11-30T00:00:00Z", 1)], (
        "hourly rows are keyed by the hour's UTC start, filtered to the tenant"
    )
    days = store.query(group_by=("day", "tenant"))
    assert [(d["day"], d["tenant"]) for d in days] == [("2026-11-29", "acme"), ("2026-11-30", "acme"),
                                                      ("2026-11-30", "globex")], "grouped by day, then tenant"
    assert store.query(group_by=(), since=T0 + 600)[0]["requests"] == 2, "since filters by the end minute"


def test_an_unknown_group_is_refused(store: UsageStore):
    with pytest.raises(RequestError, match="group_by 'planet'"):
        store.query(group_by=("planet",))


def test_usage_survives_a_reopen(tmp_path):
    first = UsageStore(tmp_path / "usage.db")
    first.record([rec("r1"), rec("r2")])
    first.record_residency(int(T0 // 60), "r0", {"a1": 42.0})
    del first  # no close: a process killed after its last commit
    again = UsageStore(tmp_path / "usage.db")
    assert again.query(group_by=())[0]["requests"] == 2, "records committed before the kill are still there"
    assert again.residency() == {"a1": 42.0}, "and so are the slot-seconds"
    again.close()


def test_pruning_drops_old_request_rows_and_keeps_the_sums(tmp_path):
    store = UsageStore(tmp_path / "usage.db", retention_s=3600)
    store.record([rec("old", ended_at=T0), rec("new", ended_at=T0 + 7000)])
    assert store.prune(now=T0 + 7200) == 1, "one record ended more than the retention ago"
    assert store.get("old") is None, "its per-request row is gone"
    assert store.query(group_by=())[0]["requests"] == 2, "the per-minute sums keep it"
    store.close()


def test_records_are_bounded_and_validated():
    with pytest.raises(RequestError, match="tenant longer than"):
        rec("r1", tenant="t" * (MAX_FIELD_CHARS + 1))
    with pytest.raises(RequestError, match="must be >= 0"):
        replace(rec("r1"), output_tokens=-1)


def test_the_outcome_of_a_request_that_ran():
    assert final_outcome("length", cancelled=False, preempted=False) is Outcome.COMPLETED, "finished"
    assert final_outcome("eos", cancelled=False, preempted=True) is Outcome.PREEMPTED_RESUMED, "resumed"
    assert final_outcome("abort", cancelled=False, preempted=True) is Outcome.CANCELLED, "aborted"
    assert final_outcome("length", cancelled=True, preempted=False) is Outcome.CANCELLED, "client left"
    assert final_outcome("error", cancelled=False, preempted=False) is Outcome.FAILED, "engine error"


def test_a_batch_sent_again_is_taken_once_even_after_a_reopen(tmp_path):
    first = UsageStore(tmp_path / "usage.db")
    batch = UsageBatch("replica-1-ab12", 1, (rec("r1"), rec("r2")))
    assert first.record_batch(batch) == 2, "a new batch's requests are new"
    assert first.record_batch(batch) == 0, "the same batch again adds no request"
    del first  # no close: a killed store, then the sender's retry reaches its successor
    again = UsageStore(tmp_path / "usage.db")
    assert again.record_batch(batch) == 0, "the batch id is remembered across a restart"
    row = again.query(group_by=())[0]
    assert row["device_s"] == 1.0, f"two requests of 0.5 device-seconds, each counted once: {row}"
    assert again.record_batch(UsageBatch("replica-1-ab12", 2, (rec("r1"),))) == 0, \
        "the next batch of the source is taken (a later part of r1 merges into its record)"
    assert again.query(group_by=())[0]["device_s"] == 1.5, "the later part's device time is added"
    assert again.record_batch(UsageBatch("replica-2-cd34", 1, (rec("r3"),))) == 1, \
        "another source's batch 1 is its own"
    again.close()


def test_the_remembered_sources_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(usage_store, "MAX_SOURCES", 3)
    store = UsageStore(tmp_path / "usage.db", retention_s=3600)
    for i in range(5):
        store.record_batch(UsageBatch(f"replica-{i}", 1, (rec(f"r{i}", ended_at=T0 + i),)))
    store.prune(now=T0 + 10)
    assert store.sources() == 3, "past MAX_SOURCES, the least recently heard of sources are forgotten"
    store.prune(now=T0 + 3600 + 3)
    assert store.sources() == 2, "a source not heard of for retention_s is forgotten"
    store.close()


def test_a_batch_is_validated():
    with pytest.raises(RequestError, match="seq must be >= 1"):
        UsageBatch("replica-1", 0, ())
    with pytest.raises(RequestError, match="source longer than"):
        UsageBatch("s" * (MAX_FIELD_CHARS + 1), 1, ())


@pytest.mark.parametrize("lost_first", [True, False])
def test_a_lost_part_keeps_what_the_client_received_in_either_order(tmp_path, lost_first):
    store = UsageStore(tmp_path / "usage.db")
    lost = rec("r1", output_tokens=4, device_s=0.3, outcome=Outcome.LOST, replica="dead")
    own = rec("r1", output_tokens=6, device_s=0.5, outcome=Outcome.CANCELLED, replica="dead")
    for part in ([lost, own] if lost_first else [own, lost]):
        store.record([part])
    merged = store.get("r1")
    rows = store.query(group_by=())
    store.close()
    assert merged is not None, "the request has its record"
    assert merged.output_tokens == 4, f"the tokens the ingress sent the client win: {merged}"
    assert merged.outcome is Outcome.LOST, f"the record says its replica was lost: {merged}"
    assert merged.device_s == pytest.approx(0.5), f"the attempt's cost counts once, the larger side: {merged}"
    assert rows[0]["requests"] == 1, f"one record: {rows}"
    assert rows[0]["output_tokens"] == 4, f"the sums follow the record: {rows}"

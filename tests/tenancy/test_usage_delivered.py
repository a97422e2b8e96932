"""A delivered part (`tenancy.usage_record.merge`): the ingress's account of what a client that went
away received wins the output tokens and the outcome over a replica's part, in either order of
arrival, in the buffer and in the store across flushes; device- and queue-seconds still add up from
the replica's parts; a store file from before the flag gets its column when it is opened."""

from __future__ import annotations

import sqlite3

import pytest

from lora_cluster.tenancy.usage_buffer import UsageBuffer
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord, merge
from lora_cluster.tenancy.usage_spool import decode, encode
from lora_cluster.tenancy.usage_store import UsageStore

T0 = 1_795_995_600.0  # a minute boundary


def rec(**kw) -> UsageRecord:
    base = dict(request_id="cmpl-1-0", tenant="acme", adapter="a1", version=1, sla_class="standard",
                base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=2, output_tokens=9,
                device_s=0.5, queue_s=0.1, outcome=Outcome.CANCELLED, ended_at=T0 + 1)
    return UsageRecord(**{**base, **kw})


def delivered(tokens: int = 4, **kw) -> UsageRecord:
    return rec(replica="", prompt_tokens=0, cached_tokens=0, output_tokens=tokens, device_s=0.0,
               queue_s=0.0, delivered=True, ended_at=T0 + 2, **kw)


@pytest.mark.parametrize("delivered_first", [True, False])
def test_a_delivered_part_wins_tokens_and_outcome_in_either_order(delivered_first):
    own = rec(outcome=Outcome.COMPLETED)
    merged = merge(delivered(), own) if delivered_first else merge(own, delivered())
    assert merged.output_tokens == 4, f"the tokens the client received win: {merged}"
    assert merged.outcome is Outcome.CANCELLED, f"the client went away: {merged}"
    assert merged.delivered, f"the merged record remembers that its tokens are final: {merged}"
    assert merged.device_s == pytest.approx(0.5), f"the replica's device time is charged: {merged}"
    assert merged.queue_s == pytest.approx(0.1), f"the replica's queue time is charged: {merged}"
    assert (merged.prompt_tokens, merged.cached_tokens) == (10, 2), f"the replica's prompt counts: {merged}"
    assert merged.replica == "r0", f"the replica it ran on: {merged}"
    assert merged.ended_at == T0 + 2, f"the later end: {merged}"


def test_the_merge_with_a_delivered_part_is_the_same_in_either_order():
    own = rec(outcome=Outcome.COMPLETED, preempted=True)
    assert merge(delivered(), own) == merge(own, delivered()), "order does not matter"


def test_replica_parts_after_a_delivered_one_add_their_cost_and_keep_its_tokens():
    merged = merge(merge(delivered(), rec(device_s=0.25)), rec(device_s=0.5, output_tokens=30))
    assert merged.output_tokens == 4, f"a later replica part does not override what was delivered: {merged}"
    assert merged.device_s == pytest.approx(0.75), f"both attempts' device time adds up: {merged}"


def test_a_delivered_part_meeting_a_lost_one_wins_and_counts_the_lost_attempt_once():
    lost = rec(outcome=Outcome.LOST, output_tokens=3, device_s=0.3)
    for merged in (merge(lost, delivered()), merge(delivered(), lost)):
        assert (merged.outcome, merged.output_tokens) == (Outcome.CANCELLED, 4), f"delivered wins: {merged}"
        assert merged.device_s == pytest.approx(0.3), f"the lost attempt's cost once: {merged}"


def test_the_buffer_merges_a_delivered_part_with_the_replicas():
    buffer = UsageBuffer()
    buffer.add(delivered(0))
    buffer.add(rec(output_tokens=40))
    [merged] = buffer.take()
    assert (merged.output_tokens, merged.delivered) == (0, True), f"nothing was delivered: {merged}"


@pytest.mark.parametrize("delivered_first", [True, False])
def test_the_store_keeps_the_delivered_tokens_across_flushes(tmp_path, delivered_first):
    store = UsageStore(tmp_path / "usage.db")
    for part in ([delivered()], [rec(output_tokens=12)]) if delivered_first else \
            ([rec(output_tokens=12)], [delivered()]):
        store.record(part)  # two flushes: two transactions
    merged = store.get("cmpl-1-0")
    rows = store.query(group_by=())
    store.close()
    assert merged is not None, "one record"
    assert (merged.output_tokens, merged.outcome, merged.delivered) == (4, Outcome.CANCELLED, True), \
        f"what the client received, read back from the row: {merged}"
    assert merged.device_s == pytest.approx(0.5), f"the replica's device time: {merged}"
    assert rows[0]["requests"] == 1, f"one request in the sums: {rows}"
    assert rows[0]["output_tokens"] == 4, f"the sums follow the record: {rows}"


def test_a_store_file_from_before_the_flag_gets_its_column(tmp_path):
    path = tmp_path / "usage.db"
    store = UsageStore(path)
    store.record([rec(request_id="old")])
    store.close()
    with sqlite3.connect(path) as conn:  # the file as a release without the column wrote it
        conn.execute("ALTER TABLE usage_requests DROP COLUMN delivered")
    store = UsageStore(path)
    old = store.get("old")
    store.record([rec(output_tokens=12), delivered()])
    merged = store.get("cmpl-1-0")
    store.close()
    assert old is not None and old.delivered is False, f"an old row reads as not delivered: {old}"
    assert merged is not None and merged.output_tokens == 4, f"a new record merges as before: {merged}"


def test_the_spool_keeps_the_flag_and_reads_an_older_line_as_not_delivered():
    part = delivered()
    older = encode(rec()).replace(b',"delivered":false', b"")
    assert decode(encode(part)) == part, "a spooled delivered part reads back the same"
    assert b"delivered" not in older, "precondition: a line as an older release wrote it"
    assert decode(older).delivered is False, "an older spooled line reads as not delivered"

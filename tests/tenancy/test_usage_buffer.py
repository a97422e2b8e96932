"""A replica's buffer of usage records (`tenancy.usage_buffer`): one entry per request id, merged;
bounded; a failed batch put back before later parts."""

from __future__ import annotations

from lora_cluster.tenancy.usage_buffer import UsageBuffer
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord


def rec(rid: str, device_s: float = 0.5, output_tokens: int = 5, **kw) -> UsageRecord:
    base = dict(request_id=rid, tenant="acme", adapter="a1", version=1, sla_class="standard",
                base_model="demo", replica="r0", prompt_tokens=10, cached_tokens=0,
                output_tokens=output_tokens, device_s=device_s, queue_s=0.1, outcome=Outcome.COMPLETED,
                ended_at=1_795_995_601.0)
    return UsageRecord(**{**base, **kw})


def test_two_parts_of_a_request_are_one_entry_with_their_device_time_summed():
    buf = UsageBuffer()
    buf.add(rec("r1", device_s=0.5))
    buf.add(rec("r1", device_s=0.25, output_tokens=7))
    batch = buf.take()
    assert len(batch) == 1, "two parts of one request are one entry"
    assert batch[0].device_s == 0.75, "device-seconds of the parts add up"
    assert batch[0].output_tokens == 7, "tokens are the latest part's"
    assert len(buf) == 0, "take empties the buffer"


def test_a_full_buffer_drops_and_counts_new_requests_but_merges_known_ones():
    buf = UsageBuffer(max_records=2)
    assert buf.add(rec("r1")) and buf.add(rec("r2")), "records within the bound are kept"
    assert not buf.add(rec("r3")), "a third request is dropped"
    assert buf.add(rec("r1", device_s=1.0)), "a part of a request already held is merged, not dropped"
    assert buf.dropped == 1, "the dropped record is counted"
    assert len(buf) == 2, "the buffer holds at most max_records requests"

"""A replica's usage records waiting to be sent to the store: bounded, one entry per request id.

Records are added as requests end and taken in one batch per flush (`serve.ops.usage_shipper`). Two
parts of the same request in the buffer are merged (`tenancy.usage_record.merge`), so a batch never
holds a request twice. A batch the store did not acknowledge is never put back: the shipper sends it
again unchanged, under its id, so that the store can take it exactly once. When the buffer is full
a new request's record is dropped and counted in `dropped` (the store's sums then miss it; the
owner logs the count).
"""

from __future__ import annotations

from lora_cluster.tenancy.usage_record import UsageRecord, merge

DEFAULT_MAX_RECORDS = 10_000


class UsageBuffer:
    """Records by request id, at most `max_records` requests (see the module docstring)."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS):
        self.max_records = max_records
        self._records: dict[str, UsageRecord] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: UsageRecord) -> bool:
        """Keep `record` (merged into an earlier part of its request); False if it was dropped."""
        before = self._records.get(record.request_id)
        if before is not None:
            self._records[record.request_id] = merge(before, record)
            return True
        return self._insert(record)

    def take(self) -> list[UsageRecord]:
        """Every record held, oldest first; the buffer is empty after."""
        batch = list(self._records.values())
        self._records.clear()
        return batch

    def _insert(self, record: UsageRecord) -> bool:
        if len(self._records) >= self.max_records:
            self.dropped += 1
            return False
        self._records[record.request_id] = record
        return True


__all__ = ["DEFAULT_MAX_RECORDS", "UsageBuffer"]

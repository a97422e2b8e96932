"""A usage record: what one accepted request used, for chargeback, and how its parts merge.

One record per request id. A request may reach the store in parts (a retry on another replica, a
re-dispatch, a preemption with recompute reported before the request ends): `merge` folds a part into
the record so far, and the store keeps exactly one record per request id:

* `device_s` and `queue_s` add up: every attempt's real cost is charged, on whichever replica it ran;
* tokens are what the client received: `prompt_tokens`, `cached_tokens` and `output_tokens` are those
  of the latest part (an attempt that was retried delivered nothing the client kept, a resumed one
  reports its cumulative count);
* the outcome is the latest part's, except that a record once preempted and then completed reads
  `preempted_resumed`; `ended_at` is the latest part's.

Outcomes: `completed`, `cancelled` (the client went away or aborted), `refused` (accepted, then
refused before running: a budget, a quota, an overload; no device time), `preempted_resumed`
(completed after at least one preemption with recompute), `failed` (ended by an engine error).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from lora_cluster.errors import RequestError

MAX_FIELD_CHARS = 256  # tenant, adapter, class and model names are bounded before they are stored


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    PREEMPTED_RESUMED = "preempted_resumed"
    FAILED = "failed"


@dataclass(frozen=True)
class UsageRecord:
    """What one request used (see the module docstring); `ended_at` is Unix seconds."""

    request_id: str
    tenant: str
    adapter: str  # "" for the base model
    version: int  # the adapter version it ran with; 0 for the base model
    sla_class: str
    base_model: str
    replica: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    device_s: float
    queue_s: float
    outcome: Outcome
    ended_at: float
    preempted: bool = False  # some attempt of it was preempted and recomputed

    def __post_init__(self) -> None:
        for name in ("request_id", "tenant", "adapter", "sla_class", "base_model", "replica"):
            if len(getattr(self, name)) > MAX_FIELD_CHARS:
                raise RequestError(f"usage record {name} longer than {MAX_FIELD_CHARS} characters")
        for name in ("prompt_tokens", "cached_tokens", "output_tokens", "version"):
            if getattr(self, name) < 0:
                raise RequestError(f"usage record {name} must be >= 0")
        if self.device_s < 0 or self.queue_s < 0:
            raise RequestError("usage record device_s and queue_s must be >= 0")

    @property
    def minute(self) -> int:
        """The Unix minute the request ended in: the store's aggregation bucket."""
        return int(self.ended_at // 60)


def merge(before: UsageRecord, part: UsageRecord) -> UsageRecord:
    """`before` with a later part of the same request folded in (see the module docstring)."""
    if before.request_id != part.request_id:
        raise RequestError(f"cannot merge usage of {part.request_id!r} into {before.request_id!r}")
    preempted = before.preempted or part.preempted
    outcome = part.outcome
    if preempted and outcome is Outcome.COMPLETED:
        outcome = Outcome.PREEMPTED_RESUMED
    return replace(part, device_s=before.device_s + part.device_s, queue_s=before.queue_s + part.queue_s,
                   preempted=preempted, outcome=outcome)


def final_outcome(finish_reason: str | None, cancelled: bool, preempted: bool) -> Outcome:
    """The outcome of a request that ran: from its finish reason and whether the client went away."""
    if cancelled or finish_reason == "abort":
        return Outcome.CANCELLED
    if finish_reason == "error":
        return Outcome.FAILED
    return Outcome.PREEMPTED_RESUMED if preempted else Outcome.COMPLETED


__all__ = ["MAX_FIELD_CHARS", "Outcome", "UsageRecord", "final_outcome", "merge"]

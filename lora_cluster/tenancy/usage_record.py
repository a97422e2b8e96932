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

A `lost` part is the ingress's account of a request whose replica was lost (killed or unreachable)
before the request ended: its tokens are those the ingress sent the client, its device-seconds the
last cumulative charge the replica reported on the wire. It wins whatever the order of arrival: a
record with a `lost` part keeps that part's tokens, outcome and end, and its device- and
queue-seconds are the larger of the two sides' (the replica's own record of the same attempt, if it
ever comes, reports at least what it had put on the wire), so the merge of the two is the same in
either order and counts the attempt once.

A `delivered` part is the ingress's account of a request whose client went away (its request task
was cancelled before the first item, or its stream closed by the client): outcome `cancelled`, the
output tokens the ingress handed on to the client (0 before the first item), no device- or
queue-seconds, and `delivered` set. Its output tokens and outcome win over every other part's,
whatever the order of arrival, because only the ingress knows what reached the client: a replica
counts what it produced before it saw the cancellation, and a replica killed meanwhile records
nothing. The merged record keeps `delivered` set (the store merges parts across flushes, so the
stored row must say that its tokens are final); its device- and queue-seconds still add up from the
replica's parts (under the `lost` rule if a `lost` part is in it), its prompt and cached tokens are
the larger side's (the delivered part may know none), its end the later one. A `lost` and a
`delivered` part of one request do not arise together (a stream ended by its replica's loss is
finished before its client can leave, and a client that leaves after a try was lost gets a
`delivered` part only); should they meet, the delivered part wins as above.

Outcomes: `completed`, `cancelled` (the client went away or aborted), `refused` (refused before
running, by the ingress or the replica: a budget, a quota, an overload; no device time), `preempted_resumed`
(completed after at least one preemption with recompute), `failed` (ended by an engine error), `lost`
(its replica was lost mid-request; recorded by the ingress).

Records travel in a `UsageBatch`: a sender's id (`source`, unique per sending process) and its
sequence number (`seq`, from 1, one more per new batch). A sender sends its next batch only once the
previous one is acknowledged, and sends an unacknowledged one again unchanged, under the same id: so
the store takes a batch exactly once by keeping, per source, the highest `seq` it took. A batch also
carries the sender's adapter residency since its previous batch (`Residency`: slot-seconds and load
seconds per adapter, from the engine's `StepMeter`), taken once with it.
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
    LOST = "lost"


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
    delivered: bool = False  # its output tokens and outcome are the ingress's: what its client received

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


@dataclass(frozen=True)
class Residency:
    """One adapter's slot-seconds and load seconds on one replica, taken in Unix minute `minute`."""

    minute: int
    adapter: str  # the adapter id as the engine holds it (`name@N`)
    replica: str
    slot_s: float
    load_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("adapter", "replica"):
            if len(getattr(self, name)) > MAX_FIELD_CHARS:
                raise RequestError(f"usage residency {name} longer than {MAX_FIELD_CHARS} characters")
        if self.slot_s < 0 or self.load_s < 0:
            raise RequestError("usage residency slot_s and load_s must be >= 0")


@dataclass(frozen=True)
class UsageBatch:
    """Records sent in one call, with the id the store takes them once by (see the module docstring)."""

    source: str
    seq: int
    records: tuple[UsageRecord, ...]
    residency: tuple[Residency, ...] = ()

    def __post_init__(self) -> None:
        if len(self.source) > MAX_FIELD_CHARS:
            raise RequestError(f"usage batch source longer than {MAX_FIELD_CHARS} characters")
        if self.seq < 1:
            raise RequestError("usage batch seq must be >= 1")

    @property
    def seen_at(self) -> float:
        """The latest end time among its records (Unix seconds): when its source was last heard of."""
        return max([*(r.ended_at for r in self.records), *(60.0 * r.minute for r in self.residency)],
                   default=0.0)


def merge(before: UsageRecord, part: UsageRecord) -> UsageRecord:
    """`before` with a later part of the same request folded in (see the module docstring)."""
    if before.request_id != part.request_id:
        raise RequestError(f"cannot merge usage of {part.request_id!r} into {before.request_id!r}")
    preempted = before.preempted or part.preempted
    if before.delivered or part.delivered:
        return _with_delivered(before, part, preempted)
    if Outcome.LOST in (before.outcome, part.outcome):
        told = part if part.outcome is Outcome.LOST else before
        return replace(told, device_s=max(before.device_s, part.device_s),
                       queue_s=max(before.queue_s, part.queue_s), preempted=preempted)
    outcome = part.outcome
    if preempted and outcome is Outcome.COMPLETED:
        outcome = Outcome.PREEMPTED_RESUMED
    return replace(part, device_s=before.device_s + part.device_s, queue_s=before.queue_s + part.queue_s,
                   preempted=preempted, outcome=outcome)


def _with_delivered(before: UsageRecord, part: UsageRecord, preempted: bool) -> UsageRecord:
    """`merge` when a side holds a delivered part: its output tokens and outcome win, in either order."""
    told, other = (part, before) if part.delivered else (before, part)
    ran = told if other.delivered else other  # the side whose replica and names stand
    if Outcome.LOST in (before.outcome, part.outcome):  # the lost attempt counts once (module docstring)
        device_s, queue_s = max(before.device_s, part.device_s), max(before.queue_s, part.queue_s)
    else:
        device_s, queue_s = before.device_s + part.device_s, before.queue_s + part.queue_s
    return replace(ran, replica=ran.replica or told.replica, output_tokens=told.output_tokens,
                   outcome=told.outcome, prompt_tokens=max(before.prompt_tokens, part.prompt_tokens),
                   cached_tokens=max(before.cached_tokens, part.cached_tokens), device_s=device_s,
                   queue_s=queue_s, ended_at=max(before.ended_at, part.ended_at), preempted=preempted,
                   delivered=True)


def adapter_version(adapter_id: str | None) -> tuple[str, int]:
    """(name, version) of an adapter id `name@N`; version 0 when the id names none (or no adapter)."""
    if not adapter_id:
        return "", 0
    name, _, version = adapter_id.rpartition("@")
    return (name, int(version)) if name and version.isdigit() else (adapter_id, 0)


def final_outcome(finish_reason: str | None, cancelled: bool, preempted: bool) -> Outcome:
    """The outcome of a request that ran: from its finish reason and whether the client went away."""
    if cancelled or finish_reason == "abort":
        return Outcome.CANCELLED
    if finish_reason == "error":
        return Outcome.FAILED
    return Outcome.PREEMPTED_RESUMED if preempted else Outcome.COMPLETED


__all__ = ["MAX_FIELD_CHARS", "Outcome", "Residency", "UsageBatch", "UsageRecord", "adapter_version",
           "final_outcome", "merge"]

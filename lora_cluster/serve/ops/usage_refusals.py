"""The ingress's own usage records: the requests it refuses itself, those whose replica was lost, and
what a client that went away received.

A request refused at the ingress never reaches a LoRA replica, so no replica records it. The routes
run the part of a request that can refuse it (the tenant's quota, the cluster queue's admission and
its wait, a tenant's budget) inside `RefusalMeter.watch`: when one of `REFUSALS` leaves it, one
record is added to the ingress's `UsageShipper` with the request's tenant, adapter (and version), SLA
class and base model, zero tokens and device-seconds, and `queue_s` the time spent inside `watch`
(for a request given up in the cluster queue: its wait). Its id is the request's id (`refused-<hex>`
when the route had none yet), never one of a job that reached a replica. The exception goes on to
the HTTP layer unchanged. Without a usage store the meter records nothing; the refusal is counted
in the usage counters (`usage_metrics`, outcome `refused`) either way.

A request whose replica was lost (killed or unreachable: a routing error mid-stream, or on every try
before its first item) has no replica left to record it. `lost` adds its `lost` part under the job's
own request id: the tokens the ingress sent the client (the last item it passed on; none before the
first), the last device-seconds the replica reported, and the replica's id. If the replica did record
the request after all, the store merges both into one record that keeps what the client received
(`tenancy.usage_record.merge`).

A request whose client went away (the ingress's request task cancelled before the first item, or a
stream the client closed) may have no replica record at all (its replica never ran it, or was killed
before it recorded the cancellation), and a replica's record counts what it produced, not what the
client received. `delivered` adds the request's `delivered` part under the job's id: outcome
`cancelled`, the tokens of the last item the ingress handed on (none before the first), no device- or
queue-seconds; it wins the record's output tokens and outcome in the store, whatever the order.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from lora_cluster import errors as e
from lora_cluster.serve.ops import usage_metrics
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.tenancy.usage_record import MAX_FIELD_CHARS, Outcome, UsageRecord, adapter_version

REFUSALS: tuple[type[BaseException], ...] = (
    e.QuotaExceededError, e.BudgetExceededError, e.ClusterOverloadedError, e.ClusterQueueTimeoutError)


class RefusalMeter:
    """Records the ingress's refusals (see the module docstring). `clock` gives Unix seconds (a
    record's end time), `timer` a monotonic one (its queue time)."""

    def __init__(self, shipper: UsageShipper | None, base_model: str, ingress: str = "",
                 clock: Callable[[], float] = time.time, timer: Callable[[], float] = time.monotonic):
        self.shipper, self.base_model, self.ingress = shipper, base_model, ingress
        self._clock, self._timer = clock, timer

    @classmethod
    def to_sink(cls, sink: Any | None, flush_s: float, base_model: str, ingress: str,
                spool_dir: str | None = None) -> RefusalMeter:
        """A meter whose shipper sends to the `UsageSink` deployment's handle `sink` every `flush_s`
        (None: usage is not recorded; the meter only counts), spooled in `spool_dir` (`usage_shipper`)."""
        shipper = None if sink is None else UsageShipper(
            lambda batch: sink.record.remote(batch), flush_s, owner=ingress, spool_dir=spool_dir)
        return cls(shipper, base_model, ingress)

    async def close(self) -> None:
        """Send what the shipper still holds (graceful shutdown)."""
        if self.shipper is not None:
            await self.shipper.close()

    @contextlib.contextmanager
    def watch(self, *, tenant: str | None, adapter_id: str | None, sla_class: str,
              base: str | None = None, request_id: str | None = None) -> Iterator[None]:
        """Run the block; a refusal leaving it is recorded (once), then raised on."""
        started = self._timer()
        try:
            yield
        except REFUSALS:
            self.refused(tenant=tenant, adapter_id=adapter_id, sla_class=sla_class, base=base,
                         request_id=request_id, queue_s=max(0.0, self._timer() - started))
            raise

    def lost(self, *, request_id: str, tenant: str | None, adapter_id: str | None, sla_class: str,
             queued_s: float, replica: str, item: dict[str, Any] | None, base: str | None = None) -> None:
        """Add the `lost` part of a job (its id, tenant, adapter, class and wait for its grant), whose
        replica `replica` went away after the ingress passed on `item` (its last item; None: nothing
        reached the client). See the module docstring."""
        item = item or {}
        self._part(request_id=request_id, tenant=tenant, adapter_id=adapter_id, sla_class=sla_class,
                   replica=replica, item=item, base=base, device_s=float(item.get("device_s") or 0.0),
                   queue_s=queued_s, outcome=Outcome.LOST)

    def parts(self, base: str) -> dict[str, Callable[..., None]]:
        """`lost` and `delivered` for requests on base model `base`: a `Dispatcher`'s keywords."""
        return {"lost": functools.partial(self.lost, base=base),
                "delivered": functools.partial(self.delivered, base=base)}

    def delivered(self, *, request_id: str, tenant: str | None, adapter_id: str | None, sla_class: str,
                  replica: str, item: dict[str, Any] | None, base: str | None = None, **_: Any) -> None:
        """Add the `delivered` part of a job whose client went away after the ingress handed on `item`
        (its last item; None: nothing), on replica `replica` ("" if none ran it). See the module
        docstring; the dispatcher's other keywords (`queued_s`) are taken and not used."""
        self._part(request_id=request_id, tenant=tenant, adapter_id=adapter_id, sla_class=sla_class,
                   replica=replica, item=item or {}, base=base, device_s=0.0, queue_s=0.0,
                   outcome=Outcome.CANCELLED, delivered=True)

    def _part(self, *, request_id: str, tenant: str | None, adapter_id: str | None, sla_class: str,
              replica: str, item: dict[str, Any], base: str | None, device_s: float, queue_s: float,
              outcome: Outcome, delivered: bool = False) -> None:
        """Add one part of a job's record with the tokens of `item` (the last item handed on)."""
        if self.shipper is None:
            return
        adapter, version = adapter_version(adapter_id)
        cut = MAX_FIELD_CHARS
        self.shipper.add(UsageRecord(
            request_id=request_id[:cut], tenant=(tenant or "")[:cut], adapter=adapter[:cut],
            version=version, sla_class=sla_class[:cut], base_model=(base or self.base_model)[:cut],
            replica=replica[:cut], prompt_tokens=int(item.get("prompt_tokens") or 0),
            cached_tokens=int(item.get("cached_tokens") or 0),
            output_tokens=int(item.get("completion_tokens") or 0), device_s=device_s,
            queue_s=queue_s, outcome=outcome, ended_at=self._clock(), delivered=delivered))

    def refused(self, *, tenant: str | None, adapter_id: str | None, sla_class: str,
                base: str | None = None, request_id: str | None = None, queue_s: float = 0.0) -> None:
        """Count one refused request (`usage_metrics`) and add its record to the shipper (if any)."""
        usage_metrics.count(tenant=tenant, sla_class=sla_class, outcome="refused")
        if self.shipper is None:
            return
        adapter, version = adapter_version(adapter_id)
        cut = MAX_FIELD_CHARS  # names past the store's bound are cut, never a failed request
        self.shipper.add(UsageRecord(
            request_id=(request_id or f"refused-{uuid.uuid4().hex}")[:cut], tenant=(tenant or "")[:cut],
            adapter=adapter[:cut], version=version, sla_class=sla_class[:cut],
            base_model=(base or self.base_model)[:cut], replica=self.ingress[:cut], prompt_tokens=0,
            cached_tokens=0, output_tokens=0, device_s=0.0, queue_s=queue_s, outcome=Outcome.REFUSED,
            ended_at=self._clock()))


__all__ = ["REFUSALS", "RefusalMeter"]

"""One /metrics for several ingress replicas: the `MetricsHub` deployment and each ingress's side.

Each ingress measures its own requests (`serve.ops.metrics`), and Serve's proxy hands a scrape to
any one of them. With several ingress replicas (`ingress_num_replicas` > 1, or
`ingress_autoscaling_config`), a one-replica `MetricsHub` (like the adapter registry and the quota
ledger) keeps each ingress's latest request metrics and sums them (`metrics_merge.MetricsBook`:
counters never go backwards, an ingress gone for good stays counted, label values bounded).

Each ingress (`SharedMetrics`) sends its cumulative request metrics every `PUSH_S` from a
background task, and again at each scrape, whose answer is the hub's sum over every ingress (each
other ingress's figures at most `PUSH_S` old) with this ingress's replica metrics once. A hub that
does not answer within `CALL_TIMEOUT_S` never fails a scrape: the ingress answers its own request
metrics, with `lora_cluster_metrics_hub_up` 0, and logs it once per outage. Snapshots are taken
and rendered on a worker thread, never on the event loop; a push in flight is never waited for by
a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ray import serve

from lora_cluster.serve.ops import metrics_exposition
from lora_cluster.serve.ops.background import keep_running, within
from lora_cluster.serve.ops.metrics_merge import MetricsBook, Snapshot

log = logging.getLogger(__name__)

PUSH_S = 5.0  # each ingress sends its request metrics this often
CALL_TIMEOUT_S = 2.0  # a hub call not answered within this long: the ingress's own figures
INGRESS_TTL_S = 12 * PUSH_S  # an ingress not heard for this long is gone for good


@serve.deployment(name="MetricsHub", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000, health_check_period_s=2.0)
class MetricsHub:
    """Every ingress's latest request metrics and their sum (one replica; each call runs between
    two awaits of its event loop, so the book needs no lock)."""

    def __init__(self, max_adapter_labels: int = 50, max_tenant_labels: int = 50, retain_s: float = 300.0):
        """The sum keeps at most twice each ingress's label bound (`metrics_max_*_labels`) of distinct
        adapter and tenant values (see `metrics_merge`); `retain_s`: how long a sample no ingress
        reports is still answered (`metrics_label_window_s`)."""
        self.book = MetricsBook(max_adapter_labels=2 * max_adapter_labels,
                                max_tenant_labels=2 * max_tenant_labels,
                                ingress_ttl_s=INGRESS_TTL_S, retain_s=max(retain_s, INGRESS_TTL_S))

    async def push(self, ingress: str, snapshot: Snapshot) -> None:
        self.book.update(ingress, snapshot)

    async def exchange(self, ingress: str, snapshot: Snapshot) -> dict[str, Any]:
        """Take `ingress`'s snapshot and answer the sum: {"families": snapshot, "ingresses": n}."""
        self.book.update(ingress, snapshot)
        return {"families": self.book.merged(), "ingresses": self.book.ingresses()}


class SharedMetrics:
    """This ingress's side of the hub (module docstring): `render()` answers /metrics."""

    def __init__(self, handle: Any, ingress_id: str, push_s: float = PUSH_S,
                 timeout_s: float = CALL_TIMEOUT_S):
        self._handle, self.ingress_id = handle, ingress_id
        self.push_s, self.timeout_s = push_s, timeout_s
        self._pusher: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        """Push from now on (again if the task ended). Off an event loop it does nothing: the first
        call on one starts it."""
        self._pusher = keep_running(self._pusher, self._push_forever)

    def stop(self) -> None:
        """Stop pushing; callable from any thread (the task is cancelled on its own loop)."""
        if self._pusher is not None and not self._pusher.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: the task is gone with it
                self._pusher.get_loop().call_soon_threadsafe(self._pusher.cancel)

    async def render(self) -> bytes:
        """The exposition text: every ingress's request metrics summed, or this ingress's own when
        the hub does not answer (never an error)."""
        self.start()
        snapshot = await asyncio.to_thread(metrics_exposition.request_snapshot)
        try:
            reply = await self._call("exchange", snapshot)
        except Exception as exc:
            self._failed(exc)
            return await asyncio.to_thread(metrics_exposition.render, None, 1)
        self._answered()
        return await asyncio.to_thread(metrics_exposition.render, reply["families"], reply["ingresses"])

    async def _push_forever(self) -> None:
        while True:
            try:
                snapshot = await asyncio.to_thread(metrics_exposition.request_snapshot)
                await self._call("push", snapshot)
                self._answered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
            await asyncio.sleep(self.push_s)

    async def _call(self, method: str, snapshot: Snapshot) -> Any:
        response = getattr(self._handle, method).remote(self.ingress_id, snapshot)
        try:
            return await within(response, self.timeout_s)
        except BaseException:
            cancel = getattr(response, "cancel", None)
            if cancel is not None:
                cancel()
            raise

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            log.warning("metrics hub cannot be reached (%s): /metrics of ingress %s shows its own request "
                        "metrics until it answers again", type(exc).__name__, self.ingress_id)
        self._failing = True

    def _answered(self) -> None:
        if self._failing:
            log.info("metrics hub answers again: /metrics of ingress %s sums every ingress", self.ingress_id)
        self._failing = False

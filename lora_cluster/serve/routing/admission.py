"""The ingress's side of the cluster queue: send at once while a replica has room, else wait for a grant.

Fast path: the ingress sends a request straight to the replicas (the request router picks one) while
none of its requests waits in the cluster queue, nor, as of its last fetch of the controller's view
(every `placement_period_s`), a request of another ingress replica (a new request never overtakes a
parked one, which may be more urgent; with several ingresses a parked request of another one is seen
up to `placement_period_s` late, and after the queue empties requests park for up to that long,
each granted at once), and the replicas have room: their free slots add up to more than this ingress's
requests that are on their way (sent in the last `report_lag_s`, replica not known yet; older ones
are in the replicas' reports by then, and counting them again would close the fast path on free
slots). A replica's free slots are its admission capacity (`admission_capacity`, default
`max_num_seqs`) minus its ongoing requests, the larger of its last report (requests from every
ingress, up to `routing_stats_period_s` old) and this ingress's own requests running there (exact,
immediate). The check reads memory only: the fast path makes no actor call.

Slow path: no replica has room (or a request is parked already), so the request is parked in the cluster
queue and sent to the replica it is granted (pinned) once one frees a slot, in class-then-deadline
order. Parks are coalesced per shard (`routing.park_link`): one `ClusterController.admit_many` call in
flight, the parks that arrive meanwhile in the next (at most `controller_park_batch_max`), and one
`grants` long poll while tickets wait there, so the controller's cost per park is a share of one call,
not a call. A refusal (full queue, deadline out of reach) is a 429 with `Retry-After`; waiting past
`cluster_queue_timeout_s` a 503. A grant the ingress will not use (its client went away while parked, or
sending the request failed before the replica answered) is given back
(`ClusterController.cancel_ticket`), so its replica's room is free again at once.

Refusals at the edge: before parking, the ingress refuses a request that the controller would
refuse (queue full for its class, cold shedding, deadline out of reach), with the controller's own
error and retry-after, from the admission state the controller last sent with a reply or with
`ingress_view` (`cluster.edge`: a state older than `edge_max_age_s` refuses nothing). The
controller never sees those requests; the ingress counts them (`edge_refused`,
`lora_cluster_edge_refusals_total` by reason and class).

Placement: every `placement_period_s` the ingress fetches the controller's placement table (hot
adapter -> replicas that should hold it) and hands it to its request router (`placement_sink`),
which then spreads a hot adapter's requests over those replicas; the same call
(`ClusterController.ingress_view`) says how many requests of other ingresses wait.

Faults: if the controller dies while a request waits (a call fails, or a reply names another actor), the
request is parked again at its restarted successor (Serve starts one); if no controller answers within
`REPARK_WINDOW_S`, or the controller is off, requests go the direct way (Serve's own queue) and the
ingress stops asking for `BACKOFF_S`. No accepted request is lost to a controller failure.

A controller in shards (`cluster.sharding`; `controller` is then the list of the shards' handles): a
request parks at the shard that owns its adapter (`shard_of`), and re-parks at that shard's
successor when it dies, as above; when a shard does not answer within `REPARK_WINDOW_S`, only its
own adapters' requests go the direct way for `BACKOFF_S` (the other shards' requests still park).
The placement is the union of the shards' tables (each places its own adapters), the requests
waiting elsewhere the sum over the shards (a shard that does not answer counts none and keeps its
last table), and the cluster view one view of every shard (`merge_snapshots`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_cluster.cluster.edge import EdgeState, EdgeView
from lora_cluster.cluster.park_batch import ClaimHints
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sharding import merge_placement, merge_snapshots, shard_of
from lora_cluster.errors import (
    ClusterOverloadedError,
    ClusterQueueTimeoutError,
    ColdAdapterShedError,
    ControllerOffError,
    DeadlineOutOfReachError,
    QueueFullError,
    WaitBoundError,
)
from lora_cluster.serve.ops import metrics
from lora_cluster.serve.ops.background import keep_running
from lora_cluster.serve.routing.park_link import ShardLink

log = logging.getLogger(__name__)

REPARK_WINDOW_S = 5.0  # how long a waiting request keeps trying to reach a (restarted) controller
BACKOFF_S = 1.0  # after the controller could not be reached: direct routing for this long
RETRY_PAUSE_S = 0.2
# the controller's refusals by the class name its reply gives (`error`): the ingress raises the same class
REFUSALS: dict[str, type[ClusterOverloadedError]] = {
    c.__name__: c for c in (QueueFullError, DeadlineOutOfReachError, WaitBoundError, ColdAdapterShedError)}


def _abandon(link: ShardLink, ticket_id: str, decided: asyncio.Future[dict[str, Any]]) -> None:
    """The waiter of `ticket_id` left: its ticket is withdrawn, and a grant that reached it meanwhile
    is given back."""
    link.withdraw(ticket_id)
    if decided.done() and "replica_id" in decided.result():
        link.release(ticket_id, str(decided.result()["replica_id"]))


@dataclass(frozen=True)
class Granted:
    """A request's grant: run it on `replica_id`; the replica reports `ticket_id` when it arrives.
    `shard`: the controller shard that granted it."""

    replica_id: str
    ticket_id: str
    shard: int = 0


class ClusterAdmission:
    def __init__(self, controller: Any | None, *, capacity: int | None,
                 replica_stats: Callable[[], Mapping[str, RoutingStats] | None], timeout_s: float,
                 placement_sink: Callable[[Mapping[str, list[str]]], None] | None = None,
                 placement_period_s: float = 1.0, report_lag_s: float = 1.0, park_batch_max: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        """`controller`: a handle to the ClusterController deployment, or the list of its shards'
        handles (None: controller off); `capacity`: requests per replica before parking (None: each
        replica's max_num_seqs)."""
        self._shards = list(controller) if isinstance(controller, list | tuple) else [controller]
        self._controller = None if controller is None else self._shards[0]
        self._tables: list[Mapping[str, list[str]]] = [{} for _ in self._shards]  # each shard's placement
        self._capacity, self._stats = capacity, replica_stats
        self.timeout_s, self._clock = timeout_s, clock
        self._placement_sink, self.placement_period_s = placement_sink, placement_period_s
        self._placement_task: asyncio.Task[None] | None = None
        self.ingress_id = uuid.uuid4().hex[:12]
        self._inflight: Counter[str] = Counter()  # this ingress's requests per replica, in flight
        self._hints = ClaimHints(len(self._shards))  # what `_inflight` changed since each shard's last call
        self.report_lag_s = report_lag_s
        self._on_their_way: deque[float] = deque()  # send times of direct requests, replica not known yet
        self._down_until = [0.0] * len(self._shards)  # per shard: direct routing until then
        self._edges = [EdgeView(clock) for _ in self._shards]  # per shard: its last admission state
        self._parked = 0  # this ingress's requests waiting in the cluster queue now
        self._parked_elsewhere = 0  # other ingresses' requests waiting there, as of the last fetch
        self.counts: Counter[str] = Counter()  # fast, parked, granted, preempting, fallback, refused
        # per shard: its parks coalesced, one park call and one grants poll in flight (`park_link`)
        self._links = [ShardLink(handle, self.ingress_id, max_batch=park_batch_max, timeout_s=timeout_s,
                                 claims=functools.partial(self._claims, k),
                                 on_reply=functools.partial(self._edge_state, k), clock=clock,
                                 retry_pause_s=RETRY_PAUSE_S, repark_window_s=REPARK_WINDOW_S)
                       for k, handle in enumerate(self._shards)]

    @property
    def enabled(self) -> bool:
        return self._controller is not None

    def has_room(self) -> bool:
        """The replicas take one more request now and none of this ingress's requests is parked (see
        the module docstring). A replica without a report yet counts as having room."""
        if self._parked or self._parked_elsewhere:
            return False
        stats = self._stats()
        if not stats:
            return True
        free = 0
        for rid, report in stats.items():
            if report.max_num_seqs is None:  # not reported yet (every report carries it)
                return True
            capacity = self._capacity or report.max_num_seqs
            free += max(0, capacity - max(report.ongoing, self._inflight[rid]))
        return free > self.unassigned()

    async def admit(self, *, sla_class: str, adapter_id: str | None, arrived_at: float,
                    prefix_of: Callable[[], Sequence[str]] = tuple) -> Granted | None:
        """The replica to pin the request to, or None to send it the direct way (fast path, or no
        controller). `prefix_of()`: the routing keys of its prompt (`GenerateJob.routing_prefix`),
        which the controller's grant weighs; read only when the request parks (the fast path leaves
        them to the request router, off this loop). Raises ClusterOverloadedError (429) or
        ClusterQueueTimeoutError (503). The caller then reports `started` (first item) or
        `not_started`, and `finished`."""
        self._sync_placement()
        shard = shard_of(adapter_id, len(self._shards))
        if self._controller is None or self._clock() < self._down_until[shard] or self.has_room():
            self.counts["fast"] += 1
            self._on_their_way.append(self._clock())
            return None
        ticket_id = uuid.uuid4().hex
        self._refuse_at_edge(shard, ticket_id, sla_class, adapter_id, arrived_at)
        self.counts["parked"] += 1
        self._parked += 1
        try:
            return await self._wait_for_grant(shard, ticket_id, sla_class, adapter_id, arrived_at,
                                              tuple(prefix_of()))
        finally:
            self._parked -= 1

    def _refuse_at_edge(self, shard: int, ticket_id: str, sla_class: str, adapter_id: str | None,
                        arrived_at: float) -> None:
        """Raise the refusal that `shard` would make, as its last published admission state shows it
        (`cluster.edge`; none from a state older than `edge_max_age_s`): the request is not parked,
        and is counted here (`edge_refused`, `lora_cluster_edge_refusals_total`), not by the shard."""
        edge = self._edges[shard]
        ticket = edge.ticket(ticket_id, self.ingress_id, sla_class, adapter_id, arrived_at)
        found = None if ticket is None else edge.refusal(ticket, arrived_at)
        if found is not None:
            reason, error = found
            self.counts["edge_refused"] += 1
            metrics.EDGE_REFUSALS.labels(reason, sla_class).inc()
            raise error

    def _edge_state(self, shard: int, reply: Mapping[str, Any]) -> None:
        """A reply of `shard` that carries its admission state (`edge`): the edge's view of it."""
        wire = reply.get("edge")
        if wire is not None:
            self._edges[shard].offer(EdgeState.from_wire(wire))

    async def _wait_for_grant(self, shard: int, ticket_id: str, sla_class: str, adapter_id: str | None,
                              arrived_at: float, prefix: tuple[str, ...] = ()) -> Granted | None:
        """Park the request at `shard`, its adapter's, until it is granted a replica (see `admit`)."""
        remaining = self.timeout_s - (self._clock() - arrived_at)
        if remaining <= 0:
            raise ClusterQueueTimeoutError(
                f"the request waited {self.timeout_s:g} s in the cluster queue (cluster_queue_timeout_s)")
        ticket = {"ticket_id": ticket_id, "sla_class": sla_class, "adapter_id": adapter_id,
                  "prefix": list(prefix)}
        link = self._links[shard]
        decided = link.park(ticket, arrived_at)
        try:
            reply = await asyncio.wait_for(asyncio.shield(decided), remaining)
        except TimeoutError:
            _abandon(link, ticket_id, decided)
            raise ClusterQueueTimeoutError(
                f"the request waited {self.timeout_s:g} s in the cluster queue (cluster_queue_timeout_s)"
            ) from None
        except asyncio.CancelledError:  # the client went away
            _abandon(link, ticket_id, decided)
            raise
        if "unreachable" in reply:
            log.warning("cluster controller shard %d unreachable (%s); routing its adapters directly "
                        "for %.0f s", shard, reply["unreachable"], BACKOFF_S)
            self._down_until[shard] = self._clock() + BACKOFF_S
            self.counts["fallback"] += 1
            self._on_their_way.append(self._clock())
            return None
        if "replica_id" in reply:
            self.counts["preempting" if reply.get("preempt") else "granted"] += 1
            return Granted(str(reply["replica_id"]), ticket_id, shard)
        self.counts["refused"] += 1
        refusal = REFUSALS.get(str(reply.get("error")), ClusterOverloadedError)
        raise refusal(str(reply.get("overloaded")), float(reply.get("retry_after_s", 1.0)))

    def _claims(self, shard: int) -> dict[str, Any]:
        """This ingress's requests in flight, for a park call to `shard` (`ClusterView.claim`), with
        the replicas they changed at since the previous call there (`park_batch.ClaimHints`)."""
        return self._hints.stamp(shard, {"inflight": dict(self._inflight), "unassigned": self.unassigned()})

    def _sync_placement(self) -> None:
        """Start the placement fetch loop (once, on the serving event loop)."""
        if self._controller is None or self._placement_sink is None:
            return
        self._placement_task = keep_running(self._placement_task, self._placement_loop)

    async def _placement_loop(self) -> None:
        while True:
            calls = [shard.ingress_view.remote(self.ingress_id) for shard in self._shards]
            views = await asyncio.gather(*calls, return_exceptions=True)
            elsewhere = 0
            for k, view in enumerate(views):
                if isinstance(view, asyncio.CancelledError):
                    raise view
                if isinstance(view, BaseException):  # the shard restarts: keep its last table meanwhile
                    log.debug("placement not fetched: %s", view)
                    continue
                elsewhere += int(view["queued_elsewhere"])
                self._tables[k] = view["placement"]
                self._edge_state(k, view)
            self._parked_elsewhere = elsewhere
            if len(self._shards) == 1:
                if not isinstance(views[0], BaseException):
                    self._placement_sink(views[0]["placement"])
            elif any(not isinstance(v, BaseException) for v in views):
                self._placement_sink(merge_placement(self._tables))
            await asyncio.sleep(self.placement_period_s)

    async def cluster_view(self) -> dict[str, Any]:
        """The controller's cluster view plus this ingress's admission counts (for GET /v1/cluster).
        Raises ControllerOffError when there is no controller; a failed call raises its error."""
        if self._controller is None:
            raise ControllerOffError("the cluster controller is off (controller: false)")
        if len(self._shards) == 1:
            view = await self._controller.snapshot.remote()
        else:
            views = await asyncio.gather(*(shard.snapshot.remote() for shard in self._shards),
                                         return_exceptions=True)
            view = merge_snapshots(views)
        view["ingress"] = {"id": self.ingress_id, "admission": dict(self.counts),
                           "in_flight": dict(self._inflight)}
        return view

    def started(self, replica_id: str, *, granted: bool) -> None:
        """The request's first item came from `replica_id` (`granted`: it was pinned there)."""
        if not granted and self._on_their_way:
            self._on_their_way.popleft()
        self._inflight[replica_id] += 1
        self._hints.changed(replica_id)

    def not_started(self, grant: Granted | None = None) -> None:
        """The request failed before any replica answered (`grant`: the grant it was pinned by, None
        for the direct way). A grant's controller shard is told to release the room it reserved
        (`cancel_ticket`): the request may never have reached the replica, which would then never
        report it (if it did, the release only counts it a report period early)."""
        if grant is not None:
            self._links[grant.shard].release(grant.ticket_id, grant.replica_id)
        elif self._on_their_way:
            self._on_their_way.popleft()

    def unassigned(self) -> int:
        """Direct requests sent in the last `report_lag_s` that no replica has answered yet."""
        horizon = self._clock() - self.report_lag_s
        return sum(1 for sent in self._on_their_way if sent > horizon)

    def finished(self, replica_id: str, *, granted: bool = False) -> None:
        """The request ended at `replica_id` (`granted`: the controller pinned it there, and this
        ingress's next park call to each shard says it ended: the claims' `ended`,
        `park_batch.ClaimHints`)."""
        self._inflight[replica_id] -= 1
        self._hints.changed(replica_id, ended=granted)
        if self._inflight[replica_id] <= 0:
            del self._inflight[replica_id]

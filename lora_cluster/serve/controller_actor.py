"""The controller's Ray edge: a one-replica Ray Serve deployment wrapping `controller.Controller`.

It is part of the application graph (started with it; if its actor dies, Serve starts a new one,
which rebuilds its view from the next replica reports, see `controller`). Calls:

* `report(report)` from each LoRA replica, every `controller_report_period_s` and when a request
  finishes while requests are queued or the replica was full (`cluster.report_rules.report_on_finish`,
  at most one per `controller_report_coalesce_s`); a full report or a delta
  (`cluster.report_delta`); the reply says how many are queued, what to prefetch, and `resync` when
  a delta's base is not held (a restarted actor), so that the replica sends its full report; the
  room it reports is granted when its batch window is sent (`serve.batch_window`);
* `admit(ticket, timeout_s)` from an ingress whose replicas are all busy: parks a ticket (with the
  other parks of its `controller_batch_window_s` window, `serve.batch_window`) and returns when it is
  granted (`{"replica_id", "preempt"}`), refused (`{"overloaded", "retry_after_s"}`, and `error`,
  the refusal's class, when refused at once; later, when more urgent tickets bump it out of a full
  queue) or timed out (`{"timeout": true}`); a grant or refusal also carries `edge`, the admission
  state the ingress refuses by before it parks (`cluster.edge`, computed once per batch window);
  a cancelled call (client gone) drops its ticket, or the room its grant
  took if one was decided;
* `admit_many(ingress_id, tickets, claims)` from an ingress's park batcher (`cluster.park_batch`:
  one call in flight per ingress and shard, the parks that arrive meanwhile in the next): parks the
  batch in one call (the same batch window) and answers at once with what is decided now:
  `{"outcomes": {ticket: grant or refusal}, "epoch", "edge"}` (a ticket that waits is not in
  `outcomes`; a ticket already parked here, a re-park, still waits, and a call of re-parks only
  still counts its claims' ends, `Controller.ended`); its outcome comes later in the
  reply of a `grants` poll or of a later `admit_many` of the same ingress (`serve.park_mailbox`).
  `epoch` names this actor: a restarted one has a new one, and the ingress parks its tickets again;
* `grants(ingress_id, timeout_s, epoch)`: the ingress's long poll, one per ingress and shard while it
  has tickets parked here; answers as soon as any of them has an outcome (all of them then), after
  `timeout_s` (none), or at once if `epoch` is not this actor's. A ticket is known for its
  `ttl_s` (the ingress's remaining wait) plus `EXPIRY_GRACE_S`: past it (an ingress that stopped
  polling) it is cancelled at the controller, and a grant nobody took gives its room back;
* `cancel_ticket(ticket_id, replica_id=None)` from an ingress that will not use a grant (its client
  went away while the grant was on its way, or sending the request to the replica failed): the
  room the grant reserved is free again at once, not after `grant_ttl_s`;
* `hot_adapters(k)` from each replica's demand prefetch, every `prefetch_hot_period_s`;
* `snapshot()` for `GET /v1/cluster` (with the ingresses' calls by method, `calls`), `placement()`
  for the ingress's request router;
  `ingress_view(ingress_id)`: the placement and how many tickets of *other* ingresses wait, which
  closes an ingress's fast path while any ingress has a request parked (`routing.admission`), and
  the edge's admission state with the adapters the replicas hold.

Everything here runs on the deployment's one event loop, so the controller needs no locks. A
ticker lets time pass for the controller (stale replicas, preemption of long-waiting tickets).

With `controller_shards` > 1 this deployment runs once per shard (`shard`, of `shards`; see
`cluster.sharding`): it is sent only the tickets of its own adapters, sees every replica (each
report caps its room there), and places and prefetches only its own adapters, so that the shards'
placement tables, united, are the one table of the cluster.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import TICK_S, Controller, ControllerSettings, Grant, Refusal
from lora_cluster.cluster.prefix_keys import GRAIN, MAX_DEPTH
from lora_cluster.cluster.process_gc import set_young_threshold
from lora_cluster.cluster.report_delta import parse_report
from lora_cluster.cluster.sharding import owns
from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.errors import ClusterOverloadedError, LoraClusterError
from lora_cluster.serve.batch_window import BatchWindow
from lora_cluster.serve.park_mailbox import ParkMailboxes

log = logging.getLogger(__name__)

EXPIRY_GRACE_S = 2.0  # a ticket is known past its ingress's wait this long (the ingress cancels first)
MAX_POLL_S = 30.0  # the longest a grants poll is held open


def outcome_wire(grant: Grant | Refusal) -> dict[str, Any]:
    """A grant or a refusal decided after its park, as a reply carries it."""
    if isinstance(grant, Refusal):  # bumped out of the full queue by more urgent requests
        return {"overloaded": grant.reason, "retry_after_s": grant.retry_after_s}
    return {"replica_id": grant.replica_id, "preempt": grant.preempt}


@serve.deployment(name="ClusterController", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=100_000, health_check_period_s=2.0)
class ClusterController:
    def __init__(self, config: dict[str, Any], shard: int = 0, shards: int = 1):
        cfg = ServeConfig(**config)  # the app's resolved fields (the environment was applied there)
        set_young_threshold(cfg.controller.controller_gc_threshold)  # this process runs the controller only
        settings = ControllerSettings.from_config(cfg.controller)
        self.core = Controller(build_sla_classes(cfg), settings, clock=time.monotonic)
        self._prefix_aware = cfg.router.prefix_aware_routing  # off: grants ignore prompt prefixes
        self._waiters: dict[str, asyncio.Future[Grant | Refusal]] = {}
        self._parked_by: collections.Counter[str] = collections.Counter()  # ingress -> its waiting tickets
        self._ticker: asyncio.Task[None] | None = None
        self._window = BatchWindow(self.core.park_many, self.core.dispatch,
                                   cfg.controller.controller_batch_window_s,
                                   after=self._deliver)
        self.shard, self.shards = shard, shards
        self._edge: dict[str, Any] | None = None  # `edge_state` for the replies until the state changes
        self._mail = ParkMailboxes(time.monotonic)  # the tickets of `admit_many` and their outcomes
        self.epoch = uuid.uuid4().hex[:12]  # this actor: a restarted one has another
        self.calls: collections.Counter[str] = collections.Counter()  # the ingresses' calls, by method

    def _own(self, adapter_id: str) -> bool:
        return self.shards <= 1 or owns(adapter_id, self.shard, self.shards)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.core.tick()
                self._deliver()
                for ticket_id, replica_id in self._mail.expired():  # nobody waits for them any more
                    self.core.cancel(ticket_id, replica_id)
            except Exception:
                log.exception("controller tick failed")

    def _deliver(self) -> None:
        self._edge = None  # a window or a tick went by: the admission state may have changed
        for ticket_id, grant in self.core.take_grants().items():
            waiter = self._waiters.get(ticket_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(grant)
            elif waiter is None:
                self._mail.decided(ticket_id, outcome_wire(grant))

    async def report(self, report: dict[str, Any]) -> dict[str, Any]:
        self._ensure_ticker()
        reply = self.core.report(parse_report(report), dispatch=False)
        await self._window.dispatched()  # its room granted with the window's other inputs
        reply["queue_depth"] = len(self.core.queue)  # what is left queued after those grants
        if self.shards > 1:  # another shard places (and has prefetched) the other adapters
            reply["prefetch"] = [a for a in reply.get("prefetch", ()) if self._own(a)]
        return reply

    def _ticket(self, request: Mapping[str, Any], ingress_id: str) -> Ticket:
        """The queue's ticket for an ingress's park `request` (see `admit`)."""
        sla = self.core.classes.get(request["sla_class"])
        enqueued = time.monotonic() - max(0.0, float(request.get("waited_s", 0.0)))
        return Ticket(
            ticket_id=str(request["ticket_id"]), ingress_id=ingress_id, sla_class=sla.name,
            priority=sla.priority, adapter_id=request.get("adapter_id"), enqueued_at=enqueued,
            deadline=None if sla.ttft_s is None else enqueued + sla.ttft_s, ttft_s=sla.ttft_s,
            prefix=tuple(str(k) for k in list(request.get("prefix") or ())[:MAX_DEPTH // GRAIN])
            if self._prefix_aware else (),
        )

    async def admit_many(self, ingress_id: str, tickets: list[dict[str, Any]],
                         claims: dict[str, Any] | None = None) -> dict[str, Any]:
        """Park a batch of one ingress's tickets (each as `admit`'s request, plus `ttl_s`: how long
        the ingress still waits) and answer at once (see the module docstring)."""
        self.calls["admit_many"] += 1
        self._ensure_ticker()
        parks: list[tuple[Ticket, Mapping[str, Any] | None]] = []
        for request in tickets:
            ticket = self._ticket(request, str(ingress_id))
            if self._mail.knows(ticket.ticket_id):
                continue  # parked here already (the ingress parks again after a failed call): it waits
            ttl_s = float(request.get("ttl_s", MAX_POLL_S)) + EXPIRY_GRACE_S
            for gone, replica_id in self._mail.register(ticket.ticket_id, ticket.ingress_id, ttl_s):
                self.core.cancel(gone, replica_id)
            parks.append((ticket, claims))
        if not parks and claims and self.core.ended(claims.get("ended") or {}):
            await self._window.dispatched()  # the seats its ends freed, granted with the window's inputs
        outcomes: dict[str, dict[str, Any]] = {}
        for (ticket, _), outcome in zip(parks, await self._window.park_all(parks), strict=True):
            if outcome is None:
                continue  # it waits: its outcome goes to the mailbox
            self._mail.settled(ticket.ticket_id)
            if isinstance(outcome, Grant | Refusal):
                outcomes[ticket.ticket_id] = outcome_wire(outcome)
            else:  # refused at once (a ClusterOverloadedError), or failed
                retry_after_s = outcome.retry_after_s if isinstance(outcome, ClusterOverloadedError) else 1.0
                outcomes[ticket.ticket_id] = {"overloaded": str(outcome), "retry_after_s": retry_after_s,
                                              "error": type(outcome).__name__}
        outcomes.update(self._mail.take(str(ingress_id)))  # decided since its last poll: carried
        return {"outcomes": outcomes, "epoch": self.epoch, "edge": self._edge_state()}

    async def grants(self, ingress_id: str, timeout_s: float, epoch: str | None = None) -> dict[str, Any]:
        """The outcomes decided for `ingress_id`'s parked tickets, as soon as there are any (see the
        module docstring)."""
        self.calls["grants"] += 1
        self._ensure_ticker()
        outcomes: dict[str, dict[str, Any]] = {}
        if epoch is None or epoch == self.epoch:
            outcomes = await self._mail.wait(str(ingress_id), min(max(0.0, float(timeout_s)), MAX_POLL_S))
        return {"outcomes": outcomes, "epoch": self.epoch, "edge": self._edge_state()}

    async def admit(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Park a ticket for `request` ({ticket_id, ingress_id, sla_class, adapter_id, waited_s, and
        prefix: its prompt's routing keys, at most MAX_DEPTH / GRAIN kept, none with
        prefix_aware_routing off}) and wait for its grant (see the module docstring)."""
        self.calls["admit"] += 1
        self._ensure_ticker()
        ticket = self._ticket(request, str(request["ingress_id"]))
        waiter: asyncio.Future[Grant | Refusal] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.ticket_id] = waiter
        answered = False  # its outcome is on its way to the caller
        try:
            grant = await self._window.park(ticket, request.get("claims"))
            if isinstance(grant, ClusterOverloadedError):
                answered = True
                return {"overloaded": str(grant), "retry_after_s": grant.retry_after_s,
                        "error": type(grant).__name__, "edge": self._edge_state()}
            if isinstance(grant, LoraClusterError):
                raise grant
            if grant is None:
                self._parked_by[ticket.ingress_id] += 1
                try:
                    grant = await asyncio.wait_for(waiter, timeout_s)
                finally:
                    self._parked_by[ticket.ingress_id] -= 1
                    if self._parked_by[ticket.ingress_id] <= 0:
                        del self._parked_by[ticket.ingress_id]
            answered = True
            if isinstance(grant, Refusal):  # bumped out of the full queue by more urgent requests
                return {"overloaded": grant.reason, "retry_after_s": grant.retry_after_s,
                        "edge": self._edge_state()}
            return {"replica_id": grant.replica_id, "preempt": grant.preempt, "edge": self._edge_state()}
        except TimeoutError:
            return {"timeout": True}
        finally:
            self._waiters.pop(ticket.ticket_id, None)
            if not answered:  # timed out, or the caller went away: its ticket, or the room its grant took
                self.core.cancel(ticket.ticket_id)

    def _edge_state(self) -> dict[str, Any]:
        """The admission state the ingresses refuse by (`cluster.edge`), without the held adapters
        (those go with `ingress_view`): computed once per batch window or tick, for every reply."""
        if self._edge is None:
            self._edge = self.core.edge_state().to_wire()
        return self._edge

    async def cancel_ticket(self, ticket_id: str, replica_id: str | None = None) -> None:
        """The ingress will not use the ticket's grant, or gave up its wait (`Controller.cancel`):
        the room the grant reserved at its replica is free again at once, not after `grant_ttl_s`."""
        self.calls["cancel_ticket"] += 1
        reserved = self._mail.withdraw(str(ticket_id))
        replica_id = reserved if replica_id is None else replica_id
        self.core.cancel(str(ticket_id), None if replica_id is None else str(replica_id))

    async def snapshot(self) -> dict[str, Any]:
        """The controller's view, plus where the controller itself runs (its actor and node)."""
        view = self.core.snapshot()
        context = ray.get_runtime_context()
        view["controller"].update(actor=context.get_actor_name(), node_id=context.get_node_id(),
                                  calls=dict(self.calls), gc_threshold=list(gc.get_threshold()))
        if self.shards > 1:
            view["controller"].update(shard=self.shard, shards=self.shards)
            view["placement"] = {a: r for a, r in view["placement"].items() if self._own(a)}
        return view

    async def placement(self) -> dict[str, list[str]]:
        return {a: list(r) for a, r in self.core.placement().items() if self._own(a)}

    async def hot_adapters(self, k: int = 32) -> list[tuple[str, int]]:
        """The `k` adapters of most recent demand this shard sees, busiest first, each with its rate in
        requests per 1,000 s (`Controller.hot_adapters`; recomputed at most once a second): what each
        replica's demand prefetch polls (`serve.replica.demand_prefetch`), apart from its reports."""
        return [(a, rate) for a, rate in self.core.hot_adapters(int(k)) if self._own(a)]

    async def ingress_view(self, ingress_id: str) -> dict[str, Any]:
        """{"placement": `placement()`, "queued_elsewhere": tickets of other ingresses waiting now,
        "edge": the admission state with the adapters the replicas hold (`cluster.edge`)}."""
        elsewhere = sum(self._parked_by.values()) - self._parked_by.get(ingress_id, 0)
        elsewhere += self._mail.waiting() - self._mail.waiting(ingress_id)
        return {"placement": await self.placement(), "queued_elsewhere": elsewhere,
                "edge": self.core.edge_state(held=True).to_wire()}

    def __del__(self) -> None:
        ticker = getattr(self, "_ticker", None)
        if ticker is not None:
            with contextlib.suppress(RuntimeError):
                ticker.cancel()

"""The baselines: Ray Serve's own routing, without the cluster controller.

Both send a request to a replica with fewer than `max_ongoing_requests` ongoing requests; when no
replica has room, the request waits in Serve's queue (first come, first served; more than
`max_queued_requests` waiting are rejected) and goes to the first replica that frees room. The
replicas are the same simulated engines as for `lora-cluster` (each request keeps its class's
priority in the engine); only routing and queueing differ.

* `round-robin`: replicas in turn, skipping full ones.
* `serve-multiplex`: Ray Serve's model multiplexing as users run it: prefer a replica that holds the
  request's adapter (on its device) and has room, choosing by power of two choices among them;
  else power of two choices among all replicas with room. (Ray waits a short while for a holder
  to free room before falling back; the simulator falls back at once.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from lora_cluster.sim.context import SimContext
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest


class _ServeQueue(ABC):
    """Serve's queue in front of the replicas; subclasses choose the replica (`pick`)."""

    name = "serve"

    def __init__(self, ctx: SimContext):
        self.ctx, self.loop, self.replicas, self.metrics = ctx, ctx.loop, ctx.replicas, ctx.metrics
        self.max_ongoing = ctx.serve.admission.max_ongoing_requests
        self.max_queued = ctx.serve.admission.max_queued_requests
        self.ids = sorted(ctx.replicas)
        self.open: list[str] = list(self.ids)  # replicas with room, in no particular order
        self._pos = {rid: k for k, rid in enumerate(self.open)}
        self._queue: deque[SimRequest] = deque()
        self.queued_max = 0

    def start(self) -> None:
        return None

    @abstractmethod
    def pick(self, req: SimRequest) -> str:
        """The replica (one with room) that takes `req`."""

    def arrive(self, req: SimRequest) -> None:
        if self.open:
            self._send(req, self.pick(req))
        elif self.max_queued >= 0 and len(self._queue) >= self.max_queued:
            self.metrics.rejected(req, "serve queue full")
        else:
            self._queue.append(req)
            self.queued_max = max(self.queued_max, len(self._queue))

    def first_token(self, replica: SimReplica, req: SimRequest) -> None:
        return None

    def planned(self, replica: SimReplica) -> None:
        return None  # Serve's queue sends on finish only: no admission window

    def finished(self, replica: SimReplica, req: SimRequest) -> None:
        self.metrics.finished(req)
        self._update(replica.replica_id)
        while self._queue and self.open:
            queued = self._queue.popleft()
            self._send(queued, self.pick(queued))

    def _send(self, req: SimRequest, replica_id: str) -> None:
        self.replicas[replica_id].add(req, self.loop.now)
        self._update(replica_id)

    def _update(self, replica_id: str) -> None:
        has_room = self.replicas[replica_id].ongoing < self.max_ongoing
        k = self._pos.get(replica_id)
        if has_room and k is None:
            self._pos[replica_id] = len(self.open)
            self.open.append(replica_id)
        elif not has_room and k is not None:
            last = self.open.pop()
            if last != replica_id:
                self.open[k] = last
                self._pos[last] = k
            del self._pos[replica_id]

    def pending(self) -> list[SimRequest]:
        return list(self._queue)

    def details(self) -> dict[str, object]:
        return {"serve_queue_max": self.queued_max}


class RoundRobinPolicy(_ServeQueue):
    name = "round-robin"

    def __init__(self, ctx: SimContext):
        super().__init__(ctx)
        self._next = 0

    def pick(self, req: SimRequest) -> str:
        n = len(self.ids)
        for step in range(n):
            rid = self.ids[(self._next + step) % n]
            if rid in self._pos:
                self._next = (self._next + step + 1) % n
                return rid
        raise RuntimeError("pick() called with no replica open")


class ServeMultiplexPolicy(_ServeQueue):
    name = "serve-multiplex"

    def pick(self, req: SimRequest) -> str:
        replicas = self.replicas
        holders = [rid for rid in self.open if req.adapter in replicas[rid].adapters.refs]
        return self._two_choices(holders or self.open)

    def _two_choices(self, pool: list[str]) -> str:
        if len(pool) == 1:
            return pool[0]
        a, b = self.ctx.rng.sample(pool, 2)
        return a if self.replicas[a].ongoing <= self.replicas[b].ongoing else b

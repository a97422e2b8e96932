"""The cluster controller in shards, in one process: n `Controller`s wired as the live shards, the
replicas' reporters and the ingress wire them (`cluster.sharding`), behind the calls the simulator's
`LoraClusterPolicy` makes of one controller.

* `park` (and each ticket of `park_many`) goes to the shard that owns the ticket's adapter
  (`shard_of`), a batch split into one batch per shard; `cancel` to every shard (a
  ticket lives in one; the others look it up and find nothing); `tick` and `take_grants` to all.
* `dispatch` goes to every shard that took a report with `dispatch=False` since its last dispatch,
  and `park_many` dispatches them too, each once (as each live shard dispatches once per batch
  window, for its parks and its reports).
* `report` takes a replica's full report and runs one round of it through that replica's
  `cluster.report_round.ReportRounds`, the object the live `ControllerReporter` runs: each shard
  gets its own encoding of its part (its adapters, its share of the free room), and the replies
  merge into one; a resync from any shard is passed on (the caller reports again soon, and only
  that shard's encoder sends a full report).
* `placement` is the union of each shard's table, each keeping its own adapters.

The CPU time each shard spends in its calls is kept per shard (`cpu_s`, from `measure_from` on, by
`cpu_clock`: the simulating thread's CPU clock), so that the busiest shard's cost per simulated
second can be read (`LoraClusterPolicy.control_plane`). Pure: injected clocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from lora_cluster.cluster.cluster_queue import ClusterQueue, Ticket
from lora_cluster.cluster.controller import Controller, ControllerSettings, Grant, Refusal
from lora_cluster.cluster.report_round import ReportRounds
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.sharding import merge_placement, owns, shard_of
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.errors import LoraClusterError

T = TypeVar("T")


class ShardedController:
    def __init__(self, classes: SlaClasses, settings: ControllerSettings, *, shards: int,
                 clock: Callable[[], float], measure_from: float = 0.0,
                 cpu_clock: Callable[[], float] = time.thread_time):
        self.classes, self.settings, self._clock, self._cpu = classes, settings, clock, cpu_clock
        self.shards = [Controller(classes, settings, clock=clock) for _ in range(shards)]
        self.measure_from = measure_from
        self.cpu_s = [0.0] * shards  # CPU seconds in each shard's calls since `measure_from`
        self._rounds: dict[str, ReportRounds] = {}  # each replica's rounds: encoders, shards' depths
        self._undispatched: set[int] = set()  # shards that took a report with dispatch=False since then
        self._replying: set[str] = set()  # the replicas of those reports (their replies' depths wait)

    def timed(self, k: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, its CPU time counted to shard `k` (from `measure_from` on)."""
        t0 = self._cpu()
        try:
            return fn(*args)
        finally:
            if self._clock() >= self.measure_from:
                self.cpu_s[k] += self._cpu() - t0

    def queue_for(self, adapter_id: str | None) -> ClusterQueue:
        """The cluster queue of the shard that owns `adapter_id`."""
        return self.shards[shard_of(adapter_id, len(self.shards))].queue

    def queue_depth(self) -> int:
        return sum(len(c.queue) for c in self.shards)

    @property
    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.shards:
            for name, n in c.counts.items():
                total[name] = total.get(name, 0) + n
        return total

    def park(self, ticket: Ticket, claims: Mapping[str, Any] | None = None) -> Grant | Refusal | None:
        k = shard_of(ticket.adapter_id, len(self.shards))
        return self.timed(k, self.shards[k].park, ticket, claims)

    def park_many(self, parks: Sequence[tuple[Ticket, Mapping[str, Any] | None]]
                  ) -> list[Grant | Refusal | LoraClusterError | None]:
        """Each shard's part of the batch, as one batch to that shard; the outcomes in `parks`' order."""
        n = len(self.shards)
        by_shard: dict[int, list[int]] = {}
        for i, (ticket, _) in enumerate(parks):
            by_shard.setdefault(shard_of(ticket.adapter_id, n), []).append(i)
        outcomes: list[Grant | Refusal | LoraClusterError | None] = [None] * len(parks)
        for k, positions in by_shard.items():
            got = self.timed(k, self.shards[k].park_many, [parks[i] for i in positions])
            for i, outcome in zip(positions, got, strict=True):
                outcomes[i] = outcome
        self._undispatched -= by_shard.keys()
        self.dispatch()  # the shards without parks in this window dispatch for its reports
        return outcomes

    def cancel(self, ticket_id: str) -> None:
        for k, c in enumerate(self.shards):
            self.timed(k, c.cancel, ticket_id)

    def tick(self) -> None:
        for k, c in enumerate(self.shards):
            self.timed(k, c.tick)

    def take_grants(self) -> dict[str, Grant | Refusal]:
        grants: dict[str, Grant | Refusal] = {}
        for k, c in enumerate(self.shards):
            grants.update(self.timed(k, c.take_grants))
        return grants

    def placement(self) -> dict[str, tuple[str, ...]]:
        n = len(self.shards)
        tables = [{a: r for a, r in self.timed(k, c.placement).items() if owns(a, k, n)}
                  for k, c in enumerate(self.shards)]
        return {a: tuple(r) for a, r in merge_placement(tables).items()}

    def dispatch(self) -> None:
        """Every shard that took a report without dispatching since its last dispatch dispatches;
        then the replicas that reported since learn each shard's queue depth (their replies)."""
        for k in sorted(self._undispatched):
            self.timed(k, self.shards[k].dispatch)
        self._undispatched.clear()
        depths = [len(c.queue) for c in self.shards]
        for rid in self._replying:
            self._rounds[rid].queued[:] = depths
        self._replying.clear()

    def report(self, report: ReplicaReport, dispatch: bool = True) -> dict[str, Any]:
        """One round of a replica's reports, one to each shard, through the replica's `ReportRounds`
        (the live reporter's composition; see the module docstring)."""
        rounds = self._rounds.get(report.replica_id)
        if rounds is None:
            rounds = self._rounds[report.replica_id] = ReportRounds(len(self.shards), self._clock)
        replies = []
        for k, sent in enumerate(rounds.messages(report)):
            replies.append(self.timed(k, self.shards[k].report, sent, dispatch))
            if not dispatch:
                self._undispatched.add(k)
                self._replying.add(report.replica_id)
        merged, resync = rounds.replied(replies)  # every shard answers in one process: never None
        reply = merged or {"queue_depth": 0, "prefetch": []}
        return {**reply, "resync": True} if resync else reply

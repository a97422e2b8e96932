"""The cluster controller in shards, in one process: n `Controller`s, as the live deployment runs
them (`cluster.sharding`), each reached by the simulator's ingress and replicas through its own
actor loop (`sim.control_inbox.ShardPlane`, wired by `sim.cluster_policy`: parks batched per shard
at the shard that owns the ticket's adapter, a report round to every shard through each replica's
`cluster.report_round.ReportRounds`, ticks and placement fetches to each, a cancel to its ticket's
shard).

This object holds the shards and what is read of them as one: the counts summed, the queue depth
summed, the placement the union of each shard's table (each keeping its own adapters). The CPU time
each shard spends in its calls is kept per shard (`timed`, into `cpu_s`, from `measure_from` on, by
`cpu_clock`: the simulating thread's CPU clock), so that the busiest shard's cost per simulated
second can be read (`LoraClusterPolicy.control_plane`). Pure: injected clocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.sharding import merge_placement, owns
from lora_cluster.cluster.sla import SlaClasses

T = TypeVar("T")


class ShardedController:
    def __init__(self, classes: SlaClasses, settings: ControllerSettings, *, shards: int,
                 clock: Callable[[], float], measure_from: float = 0.0,
                 cpu_clock: Callable[[], float] = time.thread_time):
        self.classes, self.settings, self._clock, self._cpu = classes, settings, clock, cpu_clock
        self.shards = [Controller(classes, settings, clock=clock) for _ in range(shards)]
        self.measure_from = measure_from
        self.cpu_s = [0.0] * shards  # CPU seconds in each shard's calls since `measure_from`

    def timed(self, k: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, its CPU time counted to shard `k` (from `measure_from` on)."""
        t0 = self._cpu()
        try:
            return fn(*args)
        finally:
            if self._clock() >= self.measure_from:
                self.cpu_s[k] += self._cpu() - t0

    def queue_depth(self) -> int:
        return sum(len(c.queue) for c in self.shards)

    @property
    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.shards:
            for name, n in c.counts.items():
                total[name] = total.get(name, 0) + n
        return total

    def placement(self) -> dict[str, tuple[str, ...]]:
        n = len(self.shards)
        tables = [{a: r for a, r in self.timed(k, c.placement).items() if owns(a, k, n)}
                  for k, c in enumerate(self.shards)]
        return {a: tuple(r) for a, r in merge_placement(tables).items()}

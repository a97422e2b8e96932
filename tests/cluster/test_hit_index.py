"""The kept hits (`cluster.hit_index.HitIndex`) answer exactly as the walk they spare
(`scheduling.affinity_hit` and `affinity_hit_in`), through parks, removals, bumps and reports that
change the replicas' adapters, over random workloads."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
from helpers import FakeClock
from tickets import report, ticket

from lora_cluster.cluster.cluster_queue import ClusterQueue
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.hit_index import HitIndex
from lora_cluster.cluster.scheduling import affinity_hit, affinity_hit_in
from lora_cluster.errors import ClusterOverloadedError

NAMES = {0: "interactive", 1: "standard", 2: "batch"}


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_hits_answer_as_the_walk_through_parks_removals_and_reports(seed):
    rng = random.Random(seed)
    clock = FakeClock(100.0)
    queue = ClusterQueue(max_size=rng.choice([8, 30, 80]), aging_s=10.0, clock=clock, top_priority=0)
    view = ClusterView(stale_after_s=1e9, clock=clock)
    hits = HitIndex(queue, view)
    adapters = [f"a{i}" for i in range(rng.randint(3, 12))]
    replicas = [f"r{i}" for i in range(rng.randint(1, 7))]
    for rid in replicas:
        view.update(report(rid, resident=tuple(rng.sample(adapters, rng.randint(0, 3)))))
    for step in range(600):
        clock.now += rng.choice([0.0, 0.01, 0.3])
        roll = rng.random()
        if roll < 0.5:
            t = ticket(f"t{step}", NAMES[rng.randint(0, 2)], clock.now - rng.uniform(0, 0.5),
                       rng.choice([*adapters, None]))
            with contextlib.suppress(ClusterOverloadedError):  # full, and nothing less urgent to bump
                queue.park(t)
                hits.parked(t)
        elif roll < 0.8:
            queued = list(queue.in_order())
            if queued:
                queue.remove(rng.choice(queued).ticket_id)
        else:
            rid = rng.choice(replicas)
            view.update(report(rid, resident=tuple(rng.sample(adapters, rng.randint(0, 4)))))
        for priority in NAMES:
            room = set(rng.sample(replicas, rng.randint(0, len(replicas))))
            latest = rng.choice([math.inf, clock.now - rng.uniform(0, 0.6)])
            queued = queue.queued_adapters(priority)
            walked = affinity_hit_in(priority, queue.best_for, queue.sort_key, view, room, latest, queued)
            assert hits.hit(priority, room, latest) == walked, f"step {step}, priority {priority}: the hit"
            order = rng.sample(replicas, len(replicas))
            assert hits.best_in(priority, order) == affinity_hit(
                priority, queue.best_for, queue.sort_key, view, order, queued=queued), (
                f"step {step}, priority {priority}: the hit among replicas in a given order")
            assert hits.best_of(priority, order) == affinity_hit(
                priority, queue.best_for, queue.sort_key, view, sorted(order), queued=queued), (
                f"step {step}, priority {priority}: the hit among replicas in any order, ties by id")


def test_a_ticket_parked_for_a_held_adapter_becomes_the_kept_hit_at_once():
    clock = FakeClock(100.0)
    queue = ClusterQueue(max_size=10, aging_s=10.0, clock=clock, top_priority=0)
    view = ClusterView(stale_after_s=1e9, clock=clock)
    hits = HitIndex(queue, view)
    view.update(report("r1", resident=("x",)))
    assert hits.best_in(1, ["r1"]) is None, "nothing is queued: no hit"
    t = ticket("t1", "standard", 100.0, "x")
    queue.park(t)
    hits.parked(t)
    assert hits.best_in(1, ["r1"]) == (t, "r1"), "the new ticket is r1's hit"
    queue.remove("t1")
    assert hits.best_in(1, ["r1"]) is None, "a ticket that left the queue is never offered"

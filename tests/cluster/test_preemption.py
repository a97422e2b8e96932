"""`cluster.preemption`: which watched urgent tickets go over capacity, when, and where, driven
directly (a queue, a view and a recording grant), as the controller wires it."""

from __future__ import annotations

from helpers import FakeClock
from tickets import CLASSES, report, ticket

from lora_cluster.cluster.cluster_queue import ClusterQueue, Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.controller_settings import ControllerSettings
from lora_cluster.cluster.hit_index import HitIndex
from lora_cluster.cluster.preemption import Preemption
from lora_cluster.cluster.scheduling import preemption_target

URGENT = frozenset(c.priority for c in CLASSES.classes if c.ttft_s is not None)


class Wired:
    """A queue, a view, its kept hits and a `Preemption` whose grants take the ticket out of the
    queue and are kept."""

    def __init__(self, settings: ControllerSettings | None = None):
        self.clock = FakeClock(100.0)
        self.queue = ClusterQueue(max_size=64, aging_s=10.0, clock=self.clock, top_priority=0)
        self.view = ClusterView(stale_after_s=5.0, clock=self.clock)
        self.granted: list[tuple[str, str]] = []
        self.hits = HitIndex(self.queue, self.view)
        self.preemption = Preemption(self.queue, self.view, settings or ControllerSettings(), URGENT,
                                     self.clock, self._grant, self.hits)

    def _grant(self, t: Ticket, replica_id: str) -> None:
        self.queue.remove(t.ticket_id)
        self.view.granted(replica_id, t.ticket_id, preempting=True)
        self.granted.append((t.ticket_id, replica_id))

    def park(self, t: Ticket) -> None:
        self.queue.park(t)
        self.hits.parked(t)
        if t.ttft_s is not None:
            self.preemption.watch(t)


def test_a_miss_waits_its_share_of_the_ttft_target_then_preempts_less_urgent_work():
    w = Wired(ControllerSettings(preempt_after_fraction=0.5, top_class_preempt_after_fraction=0.5))
    w.view.update(report("r1", capacity=2, running=2, by_priority={2: 2}))
    w.park(ticket("i", "interactive", 100.0, "cold"))
    w.preemption.run()
    assert w.granted == [], "before half of its 1 s target the ticket waits for room"
    w.clock.now = 100.5
    w.preemption.run()
    assert w.granted == [("i", "r1")], "at half of its target it preempts the batch work on r1"
    assert "i" not in w.queue, "the grant took it out of the queue"


def test_work_as_urgent_as_the_ticket_is_never_preempted():
    w = Wired(ControllerSettings(preempt_after_fraction=0.0, top_class_preempt_after_fraction=0.0))
    w.view.update(report("r1", capacity=2, running=2, by_priority={1: 2}))
    w.park(ticket("s", "standard", 100.0, "a"))
    w.park(ticket("b", "batch", 100.0, "a"))
    w.clock.now = 101.0
    w.preemption.run()
    assert w.granted == [], "standard work is not less urgent than a standard ticket; batch never preempts"


def test_a_holder_running_less_urgent_work_takes_the_ticket_at_once():
    w = Wired(ControllerSettings(preempt_after_fraction=0.9))
    w.view.update(report("r1", capacity=2, running=2, by_priority={2: 2}))
    w.view.update(report("r2", capacity=2, running=2, by_priority={2: 2}, resident=("hot",)))
    w.park(ticket("s", "standard", 100.0, "hot"))
    w.preemption.run()
    assert w.granted == [("s", "r2")], "a hit by preemption does not wait for the ticket's preemption share"


def test_a_replica_that_reports_holding_a_queued_adapter_takes_its_most_urgent_ticket():
    w = Wired(ControllerSettings(preempt_after_fraction=0.9))
    w.view.update(report("r1", capacity=2, running=2, by_priority={2: 2}))
    w.park(ticket("s-old", "standard", 100.0, "late"))
    w.park(ticket("s-new", "standard", 100.1, "late"))
    w.preemption.run()
    assert w.granted == [], "no replica holds the adapter: the tickets wait"
    w.clock.now = 100.2
    w.view.update(report("r1", capacity=2, running=2, by_priority={2: 2}, resident=("late",)))
    w.preemption.reported("r1")
    w.preemption.run()
    assert w.granted[0] == ("s-old", "r1"), "the replica now holding the adapter takes the older ticket first"


def test_a_due_miss_waits_for_the_holder_of_its_adapter_until_its_holder_wait():
    settings = ControllerSettings(preempt_after_fraction=0.2, holder_wait_fraction=0.8)
    w = Wired(settings)
    w.view.update(report("r1", capacity=2, running=2, by_priority={2: 2}))
    w.view.update(report("r2", capacity=2, running=2, by_priority={1: 2}, resident=("a",)))
    w.park(ticket("s", "standard", 100.0, "a"))
    w.clock.now = 101.0
    w.preemption.run()
    assert w.granted == [], "r2 holds the adapter (running standard work): the ticket waits for it"
    w.clock.now = 104.0
    w.preemption.run()
    assert w.granted == [("s", "r1")], "after 0.8 of its 5 s target it preempts where it can"


def test_hits_by_preemption_are_spread_over_the_holders_of_their_adapter():
    w = Wired(ControllerSettings(preempt_after_fraction=0.9))
    for rid in ("r1", "r2"):
        w.view.update(report(rid, capacity=4, running=4, by_priority={2: 4}, resident=("hot",)))
    for i in range(4):
        w.park(ticket(f"s{i}", "standard", 100.0 + i / 100, "hot"))
    w.clock.now = 100.1
    w.preemption.run()
    taken = sorted(rid for _, rid in w.granted)
    assert len(taken) == 4, f"each ticket preempts batch work at a holder of its adapter: {w.granted}"
    assert taken == ["r1", "r1", "r2", "r2"], (
        f"the grants wait for seats at both holders, not piled on one (where they would recompute its "
        f"batch work): {w.granted}")


def test_a_holder_without_less_urgent_work_is_no_target_however_few_grants_it_has():
    w = Wired()
    w.view.update(report("r1", capacity=2, running=2, by_priority={0: 2}, resident=("hot",)))
    w.view.update(report("r2", capacity=2, running=2, by_priority={2: 2}, resident=("hot",)))
    w.view.granted("r2", "earlier", preempting=True)
    t = ticket("s", "standard", 100.0, "hot")
    assert preemption_target(t, w.view, ["r1", "r2"]) == "r2", (
        "r1 runs only more urgent work: r2 is the target though a preempting grant is on its way there")

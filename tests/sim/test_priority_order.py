"""Priority order over random workloads: a more urgent request never waits behind a less urgent one
that arrived after it, except where a documented rule says so (`sim.cluster_policy`, "Priority
order").

The definition checked: for requests U and L, U more urgent (lower `sla.priority`) and L arriving
strictly after U, L must not enter a running batch (`SimRequest.admitted_at`) while U still waits
for its first admission (in the cluster queue, or in a replica's waiting queue). Every such
overtake is seen as it happens, at the step that admits L (`Simulation.on_plan`), and explained by
the rule that allows it, or counted as a defect:

* U in the cluster queue: grants go most urgent first (`cluster.cluster_queue`: aging never lifts
  a later, less urgent ticket above an earlier, more urgent one, since its key is fixed at park
  time and a later arrival of a less urgent class ranks after), so only an overdue ticket of a
  class without a TTFT target may pass U (the starvation guard), or, with controller shards, a
  ticket another shard owns (each shard grants its own tickets from its share of the room:
  `cluster.sharding`); anything else is a defect;
* U in L's replica's waiting queue: the engine admits by (priority, arrival), so only U's adapter
  not being on the device (loading, or waiting for a slot that requests at least as urgent as U
  want, L's adapter's among them: `sim.replica`, step 3) lets L, whose adapter is there, go first;
  so does a slot U could take only by preempting the running requests of L's adapter while U is
  still within its preemption patience (`EngineConfig.preempt_patience`: `SimRequest.preempt_at`);
  anything else is a defect;
* U in another replica's waiting queue: a request does not move once sent (`sim.cluster_policy`), so L
  may start first where there was room; counted, not a defect.

A request refused or timed out stops waiting then, and a preempted request already entered a batch:
neither can be overtaken afterwards. Plain pytest, no Ray: a few simulated seconds per example.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_cluster.cluster.cluster_queue import OVERDUE_SHARE
from lora_cluster.cluster.sharding import shard_of
from lora_cluster.sim import SimConfig, Simulation
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

QUEUE_DEFECT = "cluster queue: a less urgent ticket granted first"
REPLICA_DEFECT = "replica: a less urgent request admitted first, U's adapter ready"
DEFECTS = (QUEUE_DEFECT, REPLICA_DEFECT)


class PriorityOrder:
    """Counts the overtakes of a run by the rule that explains them (see the module docstring): pairs
    (U, L) in `pairs`, the overtaken requests in `overtaken`, the comparisons made in `compared`."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.pairs: Counter[str] = Counter()
        self.overtaken: dict[str, set[int]] = {}
        self.compared = 0  # (U still waiting, L admitted) pairs looked at, overtakes or not
        self.examples: dict[str, tuple[object, ...]] = {}
        bound = sim.config.serve.controller.cluster_queue_max_wait_s
        self.overdue_s = OVERDUE_SHARE * bound if bound else None
        self.shards = sim.config.serve.controller.controller_shards
        self._seen: set[int] = set()
        sim.on_plan = self.planned

    def planned(self, replica: SimReplica) -> None:
        now = self.sim.loop.now
        admitted = [r for r in replica.running.values() if r.admitted_at == now and r.rid not in self._seen]
        if not admitted:
            return
        self._seen.update(r.rid for r in admitted)
        least = max(r.priority for r in admitted)
        waiting: list[tuple[SimRequest, SimReplica | None]] = [
            (u, None) for u in self.sim.policy.pending() if u.priority < least]
        for other in self.sim.replicas.values():
            waiting.extend((u, other) for u in other.waiting if u.admitted_at is None and u.priority < least)
        for late in admitted:
            for u, at in waiting:
                if u.priority < late.priority:
                    self.compared += 1
                    if u.arrival < late.arrival:
                        self._count(self.rule(u, at, late, replica), u, late)

    def _count(self, rule: str, u: SimRequest, late: SimRequest) -> None:
        self.pairs[rule] += 1
        self.overtaken.setdefault(rule, set()).add(u.rid)
        self.examples.setdefault(rule, (self.sim.loop.now, u.rid, u.sla.name, u.arrival, u.replica, u.ticket,
                                        late.rid, late.sla.name, late.arrival, late.replica, late.ticket))

    def rule(self, u: SimRequest, at: SimReplica | None, late: SimRequest, replica: SimReplica) -> str:
        """The rule that lets `late` enter `replica`'s batch while `u` waits at `at` (None: the queue)."""
        if at is None:
            waited = late.reached_at - late.arrival
            if late.sla.ttft_s is None and self.overdue_s is not None and waited >= self.overdue_s:
                return "cluster queue: L overdue (starvation guard)"
            shards = self.shards
            if late.ticket is not None and shard_of(late.adapter, shards) != shard_of(u.adapter, shards):
                return "cluster queue: L granted by another shard"
            return QUEUE_DEFECT
        adapters = at.adapters
        if u.adapter not in adapters.fetched and u.adapter not in adapters.refs:
            return "replica: U's adapter loading"
        if u.adapter not in adapters.refs:  # fetched, no device slot free for it
            if at is replica and min(adapters.wanted[late.adapter]) > u.priority:
                if self.sim.loop.now < u.preempt_at:  # taking that slot preempts: not before its patience
                    return "replica: U's slot needs a preemption, U within its patience"
                return REPLICA_DEFECT  # U should have taken L's adapter's slot (`slot_to_preempt`)
            return "replica: U's adapter waiting for a slot"
        if at is replica:
            return REPLICA_DEFECT
        return "another replica: U waits where it was sent"

    def defects(self) -> dict[str, object]:
        return {rule: (self.pairs[rule], self.examples[rule]) for rule in DEFECTS if self.pairs[rule]}


DEFAULT_SERVE = ServeSections()
# the controller as deployed, and as configured otherwise: shards, a batch window, and a wait bound short
# enough for a few simulated seconds to reach its starvation guard
SERVES = (DEFAULT_SERVE, DEFAULT_SERVE.with_fields(controller_shards=2),
          DEFAULT_SERVE.with_fields(controller_batch_window_s=0.002),
          DEFAULT_SERVE.with_fields(cluster_queue_max_wait_s=4.0))


def describe(config: SimConfig) -> str:
    fields = [f"{name} {getattr(config, name)}"
              for name in ("nodes", "adapters", "load", "zipf", "seed", "preload", "duration")]
    default = DEFAULT_SERVE.controller.model_dump()
    fields += [f"{k} {v}" for k, v in config.serve.controller.model_dump().items() if default[k] != v]
    return ", ".join(fields)


def observed(config: SimConfig) -> PriorityOrder:
    sim = Simulation(config)
    order = PriorityOrder(sim)
    sim.finish()
    return order


CONFIGS = st.builds(SimConfig, nodes=st.integers(2, 6), adapters=st.integers(20, 200),
                    load=st.floats(0.5, 3.0), zipf=st.floats(0.6, 1.4), seed=st.integers(0, 10**6),
                    preload=st.sampled_from((0, 10, 50)), duration=st.floats(2.0, 8.0), warmup=st.just(1.0),
                    serve=st.sampled_from(SERVES))


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(config=CONFIGS)
def test_no_request_overtaken_by_a_later_less_urgent_one_without_a_rule(config: SimConfig) -> None:
    order = observed(config)
    assert not order.pairs[QUEUE_DEFECT], (
        f"{describe(config)}: later, less urgent tickets were granted and admitted while a more urgent "
        f"one waited in the cluster queue: {order.defects()}")
    assert not order.pairs[REPLICA_DEFECT], (
        f"{describe(config)}: a replica admitted later, less urgent requests while a more urgent one "
        f"with its adapter on the device waited there: {order.defects()}")


def test_an_overloaded_run_compares_waiting_urgent_requests_with_admissions() -> None:
    order = observed(SimConfig(nodes=3, adapters=60, load=2.0, duration=4.0, warmup=1.0, seed=7))
    assert order.compared > 0, "at 2x load, less urgent requests were admitted while urgent ones waited"

"""Coalesced parks, live (`serve.routing.park_link`, `ClusterController.admit_many` and `grants`): the
ingress's real admission against a fake shard handle that runs the real controller actor's methods on
this loop. Parks that arrive while a park call is in flight go together in the next call (one in
flight); grants decided later come through the grants poll; a request that leaves (in the batch,
during its call, or parked) or times out leaves no ticket or reservation behind; a restarted shard gets
the waiting tickets again; an unreachable one is bypassed; an ingress that stops polling has its
tickets and grants expire at the shard."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.errors import ClusterQueueTimeoutError
from lora_cluster.serve import controller_actor
from lora_cluster.serve.controller_actor import ClusterController
from lora_cluster.serve.routing import admission as admission_module
from lora_cluster.serve.routing.admission import ClusterAdmission


def batch_work(capacity: int, running: int) -> dict[str, Any]:
    """Replica r1's report: `capacity` slots, `running` of them taken by batch work (priority 2)."""
    return ReplicaReport("r1", "n1", capacity=capacity, max_num_seqs=capacity, max_loras=4, running=running,
                         waiting=0, free_adapter_slots=2, running_by_priority={2: running}).to_dict()


METHODS = ("admit_many", "grants", "cancel_ticket", "ingress_view", "snapshot")


class ActorShard:
    """A shard's deployment handle over a real `ClusterController` on this loop: `.remote` runs the
    actor's method as a task, counted per method (and the most in flight at once). `hold`: park
    calls wait until it is set. `kill()`: calls in flight and every later call fail, as a dead
    actor's; `restart()`: a new actor (a new epoch, nothing parked) answers from then on."""

    def __init__(self) -> None:
        self.actor = self._new()
        self.calls: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.most_in_flight: Counter[str] = Counter()
        self.hold = asyncio.Event()
        self.hold.set()
        self.died = asyncio.Event()
        for name in METHODS:
            setattr(self, name, SimpleNamespace(remote=lambda *args, _n=name: self._call(_n, args)))

    @staticmethod
    def _new() -> ClusterController:
        return ClusterController.func_or_class(ServeConfig().model_dump())

    def _call(self, name: str, args: tuple) -> asyncio.Future:
        self.calls[name] += 1
        return asyncio.ensure_future(self._run(name, args))

    async def _run(self, name: str, args: tuple) -> Any:
        if self.died.is_set():
            raise RuntimeError("actor died")
        self.in_flight[name] += 1
        self.most_in_flight[name] = max(self.most_in_flight[name], self.in_flight[name])
        try:
            if name == "admit_many":
                await self.hold.wait()
            call = asyncio.ensure_future(getattr(self.actor, name)(*args))
            death = asyncio.ensure_future(self.died.wait())
            await asyncio.wait({call, death}, return_when=asyncio.FIRST_COMPLETED)
            death.cancel()
            if not call.done():
                call.cancel()
                raise RuntimeError("actor died")
            return call.result()
        finally:
            self.in_flight[name] -= 1

    def kill(self) -> None:
        self.died.set()

    def restart(self) -> None:
        self.actor, self.died = self._new(), asyncio.Event()


def full() -> dict[str, RoutingStats]:
    return {"r1": RoutingStats(num_running=2, num_waiting=0, max_num_seqs=2)}


def ingress(shard: ActorShard, timeout_s: float = 30.0) -> ClusterAdmission:
    return ClusterAdmission(shard, capacity=None, replica_stats=full, timeout_s=timeout_s)


async def park(a: ClusterAdmission, sla_class: str = "standard") -> Any:
    return await a.admit(sla_class=sla_class, adapter_id="a1", arrived_at=time.monotonic())


async def until(predicate: Any, what: str, bound_s: float = 5.0) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < deadline, f"waited {bound_s} s for: {what}"
        await asyncio.sleep(0.005)


async def full_replica(shard: ActorShard, running: int = 2) -> None:
    await shard.actor.report(batch_work(2, running))


async def recording_claims() -> tuple[ActorShard, ClusterAdmission, list[dict[str, Any]]]:
    """A shard whose replica is full, an ingress of it, and the claims of each park call it sends."""
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard)
    sent: list[dict[str, Any]] = []
    send = shard.admit_many.remote
    shard.admit_many = SimpleNamespace(remote=lambda *args: (sent.append(args[2]), send(*args))[1])
    return shard, a, sent


async def test_parks_that_arrive_during_a_call_go_together_and_their_grants_come_by_poll():
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard)
    shard.hold.clear()
    requests = [asyncio.create_task(park(a)) for _ in range(20)]
    await until(lambda: shard.in_flight["admit_many"] == 1, "the first park call")
    shard.hold.set()
    await until(lambda: len(shard.actor.core.queue) == 20, "all 20 parked")
    assert shard.calls["admit_many"] == 2, (
        f"the first park goes alone, the 19 that arrived during its call in one more: {shard.calls}")
    assert shard.most_in_flight["admit_many"] == 1, "never more than one park call in flight"
    await shard.actor.report(batch_work(22, 2))
    granted = await asyncio.wait_for(asyncio.gather(*requests), 5.0)
    assert all(g is not None and g.replica_id == "r1" for g in granted), "each is granted the freed room"
    assert shard.calls["admit_many"] == 2, "the grants decided later came without another park call"
    assert 1 <= shard.calls["grants"] <= 3, f"they came by the grants poll: {shard.calls}"
    assert shard.most_in_flight["grants"] == 1, "one grants poll in flight"
    assert a.counts["granted"] == 20, f"each grant counted once: {dict(a.counts)}"


async def test_each_park_call_names_the_replicas_its_claims_changed_at_since_the_previous_one():
    """A park call's claims carry, numbered, the replicas where this ingress's requests in flight
    changed since its previous call to that shard (`park_batch.ClaimHints`): the shard touches those,
    and compares no mappings, while the claims it holds are that previous call's."""
    shard, a, sent = await recording_claims()
    a.started("r1", granted=False)
    requests = [asyncio.create_task(park(a))]
    await until(lambda: len(shard.actor.core.queue) == 1, "the first parked")
    a.started("r2", granted=False)
    a.finished("r1")
    requests.append(asyncio.create_task(park(a)))
    await until(lambda: len(shard.actor.core.queue) == 2, "the second parked")
    assert [(c["seq"], c["base"], c["changed"]) for c in sent] == [(1, 0, ["r1"]), (2, 1, ["r1", "r2"])], (
        "each call numbered after the previous one, with the replicas changed since it")
    assert [c["inflight"] for c in sent] == [{"r1": 1}, {"r2": 1}], "and the counts themselves, whole"
    await shard.actor.report(batch_work(22, 2))
    granted = await asyncio.wait_for(asyncio.gather(*requests), 5.0)
    assert all(g is not None for g in granted), "both granted as without the hints"


async def test_a_request_that_leaves_while_in_the_batch_never_reaches_the_shard():
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard)
    shard.hold.clear()
    first = asyncio.create_task(park(a))
    await until(lambda: shard.in_flight["admit_many"] == 1, "the first park call")
    second = asyncio.create_task(park(a))
    await asyncio.sleep(0.01)
    second.cancel()  # its client went away while it waited for the next call
    await asyncio.gather(second, return_exceptions=True)
    shard.hold.set()
    await until(lambda: len(shard.actor.core.queue) == 1, "the first parked")
    await asyncio.sleep(0.05)
    assert shard.calls["admit_many"] == 1, "no call carried the request that left"
    assert shard.actor.core.counts["parked"] == 1, "the shard never saw it"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_a_request_that_leaves_during_its_call_or_parked_is_dropped_at_the_shard():
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard)
    shard.hold.clear()
    during = asyncio.create_task(park(a))
    await until(lambda: shard.in_flight["admit_many"] == 1, "its park call")
    during.cancel()  # the call is on its way: the ticket is released when it answers
    await asyncio.gather(during, return_exceptions=True)
    shard.hold.set()
    await until(lambda: shard.actor.core.counts["cancelled"] == 1, "the released ticket")
    assert len(shard.actor.core.queue) == 0, "no ticket of a request that left during its call stays"
    parked = asyncio.create_task(park(a))
    await until(lambda: len(shard.actor.core.queue) == 1, "the next one parked")
    parked.cancel()
    await asyncio.gather(parked, return_exceptions=True)
    await until(lambda: len(shard.actor.core.queue) == 0, "the parked ticket dropped")
    assert shard.actor.core.counts["cancelled"] == 2, "each counted as cancelled at the shard"


async def test_a_request_that_waits_past_the_timeout_is_refused_and_dropped_at_the_shard():
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard, timeout_s=0.2)
    with pytest.raises(ClusterQueueTimeoutError, match="cluster_queue_timeout_s"):
        await park(a)
    await until(lambda: len(shard.actor.core.queue) == 0, "the timed-out ticket dropped")
    assert shard.actor.core.counts["cancelled"] == 1, "its ticket is cancelled at the shard"


async def test_a_restarted_shard_gets_the_waiting_tickets_again_and_grants_them(monkeypatch):
    monkeypatch.setattr(admission_module, "RETRY_PAUSE_S", 0.01)
    shard = ActorShard()
    await full_replica(shard)
    a = ingress(shard)
    waiting = [asyncio.create_task(park(a)) for _ in range(3)]
    await until(lambda: len(shard.actor.core.queue) == 3 and shard.in_flight["grants"] == 1,
                "three parked, the poll waiting")
    old = shard.actor
    shard.kill()
    shard.restart()
    await until(lambda: len(shard.actor.core.queue) == 3, "the three parked again at the new actor")
    assert shard.actor is not old and shard.actor.epoch != old.epoch, "a new actor answers"
    await shard.actor.report(batch_work(5, 2))
    granted = await asyncio.wait_for(asyncio.gather(*waiting), 5.0)
    assert all(g is not None and g.replica_id == "r1" for g in granted), "the new actor grants them"
    assert a.counts["fallback"] == 0, "none went the direct way"


async def test_a_shard_that_stays_down_past_the_window_is_bypassed(monkeypatch):
    monkeypatch.setattr(admission_module, "RETRY_PAUSE_S", 0.01)
    monkeypatch.setattr(admission_module, "REPARK_WINDOW_S", 0.1)
    shard = ActorShard()
    shard.kill()
    a = ingress(shard)
    assert await park(a) is None, "no shard answers within the window: the request goes the direct way"
    assert a.counts["fallback"] == 1, f"counted as a fallback: {dict(a.counts)}"
    calls = shard.calls["admit_many"]
    assert await park(a) is None, "during the backoff: direct at once"
    assert shard.calls["admit_many"] == calls, "without asking the dead shard"


async def test_tickets_and_grants_of_an_ingress_that_stops_polling_expire_at_the_shard(monkeypatch):
    monkeypatch.setattr(controller_actor, "EXPIRY_GRACE_S", 0.0)
    actor = ClusterController.func_or_class(ServeConfig().model_dump())
    await actor.report(batch_work(2, 1))
    tickets = [{"ticket_id": t, "sla_class": "batch", "adapter_id": "a1", "waited_s": 0.0, "ttl_s": 0.2}
               for t in ("t1", "t2")]
    reply = await actor.admit_many("gone", tickets, None)
    assert set(reply["outcomes"]) == {"t1"}, f"the free slot is granted at once, the other waits: {reply}"
    assert len(actor.core.queue) == 1, "t2 waits"
    await actor.report(batch_work(3, 1))
    assert actor.core.view.free("r1") == 0, "t2 is granted the new slot, in the mailbox nobody polls"
    await until(lambda: actor.core.view.free("r1") == 1, "t2's grant expired", bound_s=3.0)
    assert actor.core.counts["cancelled"] == 1, "the expired ticket is cancelled at the controller"


async def test_a_poll_answers_at_once_when_its_epoch_is_another_actors():
    actor = ClusterController.func_or_class(ServeConfig().model_dump())
    reply = await asyncio.wait_for(actor.grants("i1", 30.0, "another-actor"), 1.0)
    assert reply["epoch"] == actor.epoch and reply["outcomes"] == {}, (
        "a poll meant for a previous actor is answered at once, naming this one")


async def test_a_granted_request_that_ended_frees_its_seat_with_the_next_park_call_before_any_report():
    """Replicas report seconds apart in a large cluster (paced to the report budget): a park call
    tells the shard which granted requests ended since the previous one (`ClaimHints` `ended`), so a
    ticket waiting for that replica is granted the seat at once, not at the replica's next report. A
    request sent the direct way is not counted: the report's own count is the truth for those."""
    shard, a, sent = await recording_claims()
    for _ in range(2):
        a.started("r1", granted=True)  # the two requests the report shows, pinned there earlier
    waiting = asyncio.create_task(park(a))
    await until(lambda: len(shard.actor.core.queue) == 1, "the first parked")
    a.finished("r1", granted=False)
    a.finished("r1", granted=True)
    second = asyncio.create_task(park(a))
    granted = await asyncio.wait_for(waiting, 5.0)
    assert granted is not None and granted.replica_id == "r1", "the waiting ticket took the freed seat"
    assert [c["ended"] for c in sent] == [{}, {"r1": 1}], (
        f"the second call carried the one granted request that ended, not the direct one: {sent}")
    assert len(shard.actor.core.queue) == 1, "one seat freed: the second ticket waits for the next"
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)


async def test_the_ends_of_a_call_whose_tickets_were_all_parked_already_still_free_their_seats():
    """An ingress parks its tickets again after a call that failed on its side but reached the shard:
    the shard knows them all and parks none, yet the call's claims tell ends that no later call
    repeats (`ClaimHints` hands each end to one call), so the seat they free goes to the waiting
    ticket at once, not at the replica's next report."""
    actor = ActorShard().actor
    await actor.report(batch_work(2, 2))
    ticket = {"ticket_id": "t1", "sla_class": "standard", "adapter_id": "a1", "ttl_s": 30.0}
    claims = {"inflight": {}, "unassigned": 0, "seq": 1, "base": 0, "changed": [], "ended": {}}
    first = await actor.admit_many("i1", [ticket], claims)
    assert first["outcomes"] == {}, "the replica is full: the ticket waits"
    again = await actor.admit_many("i1", [ticket], {**claims, "seq": 2, "base": 1, "ended": {"r1": 1}})
    grant = again["outcomes"].get("t1")
    assert grant is not None and grant.get("replica_id") == "r1", (
        f"the re-park call's end freed a seat at r1 and the waiting ticket took it: {again['outcomes']}")

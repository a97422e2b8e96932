"""The cluster view's kept indexes and the policies that read them choose what a scan of every
replica chooses: the preemption target through each adapter's home ranking (`homes.HomeRanks`),
on random cluster states, with replicas joining and going away."""

from __future__ import annotations

import contextlib
import random

from helpers import FakeClock
from tickets import ticket

from lora_cluster.cluster.cluster_queue import ClusterQueue
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.homes import HomeRanks, home_score
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.scheduling import (
    QUEUED_PER_ROOM,
    affinity_hit_in,
    choose_replica,
    holder_can_preempt,
    holder_preemption_target,
    preemption_target,
    primary_holder,
)
from lora_cluster.errors import ClusterOverloadedError

ADAPTERS = [f"a{i}" for i in range(30)]


def random_report(rng: random.Random, rid: str) -> ReplicaReport:
    running = {p: rng.choice((0, 0, 1, 3)) for p in (0, 1, 2)}
    return ReplicaReport(rid, "n1", capacity=8, max_num_seqs=8, max_loras=4, running=sum(running.values()),
                         waiting=rng.randrange(3), free_adapter_slots=rng.choice((0, 0, 1, 2)),
                         resident=tuple(rng.sample(ADAPTERS, rng.randrange(4))),
                         running_by_priority=running)


def scan_target(view: ClusterView, adapter: str, priority: int, free_slot_first: bool) -> str | None:
    """The preemption target by scoring every replica (ties to the first id): a holder of the adapter,
    the fewest preempting grants on their way first among holders, then a free slot, then the home score."""
    best, most = None, (False, 0, False, 0)
    for rid in sorted(view.ids()):
        if view.preemptible(rid, priority) <= 0:
            continue
        report = view.get(rid)
        held = adapter in report.held
        score = (held, -view.preempting(rid) if held else 0,
                 free_slot_first and report.free_adapter_slots > 0, home_score(adapter, rid))
        if score > most:
            best, most = rid, score
    return best


def test_the_preemption_target_walks_the_home_ranking_to_what_a_full_scan_chooses():
    rng = random.Random(7)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=5.0, clock=clock)
    ids = [f"r{i:02d}" for i in range(40)]
    checked = 0
    for step in range(400):
        rid = rng.choice(ids)
        if step % 37 == 36:
            view.forget(rid)  # a replica goes away: every ranking is rebuilt
        else:
            view.update(random_report(rng, rid))
        if rng.random() < 0.2 and len(view):  # a preempting grant takes away preemptible work
            view.granted(rng.choice(list(view.ids())), f"t{step}", preempting=True)
        for cls in ("interactive", "standard"):
            t = ticket(f"q{step}", cls, 100.0, rng.choice(ADAPTERS))
            for top in (False, True):
                want = scan_target(view, t.adapter_id, t.priority, top)
                got = preemption_target(t, view, free_slot_first=top)
                assert got == want, f"step {step}, {cls}, {t.adapter_id}, slot first {top}: {got} != {want}"
                checked += want is not None
            held = any(t.adapter_id in view.get(r).held for r in view.preemptible_ids(t.priority))
            assert holder_can_preempt(t, view) is held, f"step {step}, {cls}: a holder runs less urgent work"
            assert (holder_preemption_target(t, view) is not None) is held, (
                f"step {step}, {cls}: the holder's target exists exactly then")
    assert checked > 500, f"most states have a target to compare: {checked}"


def test_home_ranks_order_by_score_then_id_and_stay_bounded():
    ids = [f"r{i}" for i in range(10)]
    ranks = HomeRanks(lambda: ids, max_ids=25)
    ranking = ranks.ranking("a")
    assert ranking == sorted(ids, key=lambda rid: (-home_score("a", rid), rid)), "descending score, then id"
    for adapter in ("b", "c", "d"):
        ranks.ranking(adapter)
    assert len(ranks) == 2, "at most 25 ids kept: the least recently used rankings are dropped"
    ids.append("r10")
    ranks.reset()
    assert "r10" in ranks.ranking("a"), "after a reset, a ranking covers the replicas now present"


def test_the_replicas_with_room_are_kept_exactly_through_reports_grants_and_claims():
    rng = random.Random(11)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=5.0, clock=clock, claim_ttl_s=1.0, claim_superseded_after_s=0.1)
    ids = [f"r{i:02d}" for i in range(24)]
    inflight: dict[str, dict[str, int]] = {"i1": {}, "i2": {}}
    renewed = 0
    for step in range(1500):
        clock.now += rng.choice((0.0, 0.01, 0.05, 0.2))
        action = rng.random()
        rid = rng.choice(ids)
        if action < 0.35:
            view.update(random_report(rng, rid))
        elif action < 0.7:  # an ingress parks: its claim, often the same counts renewed
            ingress = rng.choice(("i1", "i2"))
            if rng.random() < 0.5:  # new counts: a new mapping (the view keeps the one it was given)
                inflight[ingress] = {**inflight[ingress], rid: rng.randrange(10)}
            renewed += 1
            view.claim(ingress, inflight[ingress], 0)
        elif action < 0.85 and len(view):
            view.granted(rng.choice(list(view.ids())), f"t{step}", preempting=rng.random() < 0.3)
        elif action < 0.97 and view.get(rid) is not None:
            view.arrived(rid, [t for t in (f"t{step - k}" for k in range(1, 30))])
        else:
            view.forget(rid)
        want = {r for r in view.ids() if view.free(r) > 0}
        assert view.free_ids() == want, f"step {step}: the replicas with room, as free() says"
        assert view.total_free() == sum(view.free(r) for r in want), (
            f"step {step}: the room summed over the replicas with room, as free() says")
        assert view.with_room() == sorted(want), f"step {step}: with_room, as free() says"
        slots = {r for r in view.ids() if view.get(r).free_adapter_slots > 0}
        assert view.slot_ids() == slots, f"step {step}: the replicas with a free adapter slot, as reported"
    assert renewed > 400, "claims were renewed often"


def test_the_claimed_and_preemptible_replicas_are_kept_exactly_through_every_update_path():
    """`claimed_less_urgent_ids` and `preemptible_ids`, kept incrementally, equal the walk of every
    replica they replace, after random reports, preempting grants, arrivals, releases, forgotten
    and pruned replicas; `prune` forgets exactly the replicas silent for `stale_after_s`."""
    rng = random.Random(23)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=2.0, clock=clock, grant_ttl_s=1.0)
    ids = [f"r{i:02d}" for i in range(20)]
    seen_claimed = 0
    for step in range(2000):
        clock.now += rng.choice((0.0, 0.01, 0.1, 0.3))
        action = rng.random()
        rid = rng.choice(ids)
        if action < 0.4:
            view.update(random_report(rng, rid))
        elif action < 0.75 and len(view):
            view.granted(rng.choice(list(view.ids())), f"t{step}", preempting=rng.random() < 0.7)
        elif action < 0.85 and view.get(rid) is not None:
            view.arrived(rid, [f"t{step - k}" for k in range(1, 8)])
        elif action < 0.92:
            view.release(f"t{step - rng.randrange(1, 10)}", rid if rng.random() < 0.5 else None)
        elif action < 0.95:
            view.forget(rid)
        else:
            silent = {r for r in view.ids() if view.age_s(r) > 2.0}
            assert set(view.prune()) == silent, f"step {step}: prune forgets exactly the silent replicas"
        for priority in (0, 1):
            claimed = {r for r in view.ids() if view.get(r).less_urgent_running(priority) > 0
                       and view.preemptible(r, priority) <= 0}
            assert view.claimed_less_urgent_ids(priority) == claimed, (
                f"step {step}, priority {priority}: the claimed replicas, as a walk finds them")
            preemptible = {r for r in view.ids() if view.preemptible(r, priority) > 0}
            assert view.preemptible_ids(priority) == preemptible, (
                f"step {step}, priority {priority}: the preemptible replicas, as a walk finds them")
            seen_claimed += len(claimed)
    assert seen_claimed > 200, f"states with claimed replicas were compared: {seen_claimed}"


def scan_choice(view: ClusterView, t, placement: dict[str, tuple[str, ...]]) -> str | None:
    """The replica with room for `t` by scoring every replica with room (the reference)."""
    scored = []
    for rid in view.ids():
        if view.free(rid) <= 0:
            continue
        report = view.get(rid)
        held = t.adapter_id in report.held
        scored.append((not held, held and not primary_holder(view, rid, t.adapter_id, placement),
                       rid not in placement.get(t.adapter_id, ()),
                       report.free_adapter_slots <= 0, -home_score(t.adapter_id, rid), rid))
    return min(scored)[-1] if scored else None


def scan_hit(view: ClusterView, queue: ClusterQueue, priority: int, latest: float) -> tuple[str, str] | None:
    """The most urgent queued ticket of `priority` whose adapter a replica with room holds, at the
    lowest such replica id, by looking at every queued ticket (the reference)."""
    best = None
    for rid in sorted(r for r in view.ids() if view.free(r) > 0):
        for aid in view.get(rid).held:
            t = queue.best_for(aid, priority)
            if t is None or t.enqueued_at > latest:
                continue
            if best is None or queue.sort_key(t.ticket_id) < best[0]:
                best = (queue.sort_key(t.ticket_id), t.ticket_id, rid)
    return None if best is None else (best[1], best[2])


def test_grants_through_the_indexes_choose_what_a_scan_of_every_replica_chooses():
    """`choose_replica` (holders, then placed replicas, then a miss) and `affinity_hit_in` (from the
    replicas' side or the queued adapters' side) equal a scan of every replica with room."""
    rng = random.Random(31)
    clock = FakeClock(100.0)
    view = ClusterView(stale_after_s=50.0, clock=clock)
    queue = ClusterQueue(max_size=400, aging_s=10.0, clock=clock)
    ids = [f"r{i:02d}" for i in range(24)]
    sides = set()
    for step in range(1500):
        clock.now += 0.01
        rid = rng.choice(ids)
        action = rng.random()
        if action < 0.4:
            view.update(random_report(rng, rid))
        elif action < 0.6 and len(view):
            view.granted(rng.choice(list(view.ids())), f"g{step}")
        elif action < 0.9:
            with contextlib.suppress(ClusterOverloadedError):
                queue.park(ticket(f"q{step}", rng.choice(("interactive", "standard", "batch")), clock.now,
                                  rng.choice(ADAPTERS)), deadline_at_risk=False)
        else:
            queue.pop()
        placement = {a: tuple(rng.sample(ids, 2)) for a in rng.sample(ADAPTERS, 5)}
        t = ticket(f"c{step}", "standard", clock.now, rng.choice(ADAPTERS))
        assert choose_replica(t, view, placement) == scan_choice(view, t, placement), (
            f"step {step}: the replica chosen through the indexes, as a scan chooses")
        for priority in (0, 1, 2):
            latest = clock.now - rng.choice((0.0, 0.5, 2.0))
            queued = queue.queued_adapters(priority)
            room = view.free_ids()
            hit = affinity_hit_in(priority, queue.best_for, queue.sort_key, view, room, latest, queued)
            got = None if hit is None else (hit[0].ticket_id, hit[1])
            assert got == scan_hit(view, queue, priority, latest), (
                f"step {step}, priority {priority}: the hit found through the indexes, as a scan finds it")
            sides.add(len(queued) >= QUEUED_PER_ROOM * len(room))
    assert sides == {True, False}, "both sides of the hit's walk were compared"

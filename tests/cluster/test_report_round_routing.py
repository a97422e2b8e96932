"""Report rounds routed to the shards they concern (issue 45, item 4): `split_room`'s held shares move
as few slots as they can, and `ReportRounds` sends a round only to a shard whose room share, adapters
or arrived tickets changed, that is owed a full report, or whose heartbeat is due."""

from __future__ import annotations

import dataclasses
import random

from helpers import FakeClock

from lora_cluster.cluster.report_delta import ReportDelta
from lora_cluster.cluster.report_round import MAX_TICKETS_KEPT, SHARD_HEARTBEAT_S, ReportRounds
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.sharding import shard_of, split_room

IDS = [f"adapter-{i}" for i in range(200)]
OWN = {k: [a for a in IDS if shard_of(a, 4) == k] for k in range(4)}


def report(*, capacity: int = 8, running: int = 8, **fields: object) -> ReplicaReport:
    base = ReplicaReport("r1", "n1", capacity=capacity, max_num_seqs=capacity, max_loras=4, running=running,
                         waiting=0, free_adapter_slots=4)
    return dataclasses.replace(base, **fields)


def sent_to(messages: list[ReplicaReport | ReportDelta | None]) -> list[int]:
    return [k for k, m in enumerate(messages) if m is not None]


def answer(rounds: ReportRounds, messages: list[ReplicaReport | ReportDelta | None],
           queued: list[int]) -> None:
    rounds.replied([None if m is None else {"queue_depth": q, "prefetch": [], "replicas": 1}
                    for m, q in zip(messages, queued, strict=True)])


def settled(clock: FakeClock, queued: list[int], running: int = 8) -> ReportRounds:
    """Rounds of a replica (`running` of 8) whose four shards queue `queued` tickets, past their first
    reports."""
    rounds = ReportRounds(4, clock)
    answer(rounds, rounds.messages(report(running=running)), queued)
    answer(rounds, rounds.messages(report(running=running)), queued)
    return rounds


# ----- the room split with held shares ---------------------------------------------------------


def test_held_shares_add_up_to_the_room_and_never_pass_a_shards_queue():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(2, 6)
        queued = [rng.randint(0, 20) for _ in range(n)]
        held = [rng.randint(0, 20) for _ in range(n)]
        free = rng.randint(0, 30)
        shares = split_room(free, queued, turn=rng.randint(0, 9), held=held)
        if sum(queued) > free:
            assert sum(shares) == free, f"every free slot goes to a shard: {free} {queued} {held} {shares}"
            assert all(s <= q for s, q in zip(shares, queued, strict=True)), f"none past its queue: {shares}"
        else:
            assert shares == split_room(free, queued), "room for every ticket: held shares change nothing"


def test_a_freed_slot_changes_one_shards_share():
    held = split_room(4, [10, 10, 10, 10])
    after = split_room(5, [10, 10, 10, 10], held=held)
    changed = [k for k in range(4) if after[k] != held[k]]
    assert len(changed) == 1, f"one slot more: one shard's share grows ({held} -> {after})"


def test_a_slot_taken_comes_from_the_shard_furthest_above_its_part():
    assert split_room(3, [10, 10, 10], held=[2, 1, 1]) == [1, 1, 1], "the shard holding two gives one back"


def test_a_shard_with_nothing_queued_keeps_no_share_while_others_wait():
    assert split_room(2, [0, 10], held=[2, 0]) == [0, 2], "room held by an idle shard moves to the queue"


def test_without_held_shares_the_split_is_the_proportional_one():
    assert split_room(4, [3, 1]) == split_room(4, [3, 1], held=None) == [3, 1], "no held: as before"


# ----- which shards a round goes to -----------------------------------------------------------


def test_the_first_round_goes_to_every_shard():
    rounds = ReportRounds(4, FakeClock())
    assert sent_to(rounds.messages(report())) == [0, 1, 2, 3], "each shard needs a first, full report"


def test_a_round_that_changes_nothing_goes_to_no_shard():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    messages = rounds.messages(report())
    assert sent_to(messages) == [], "no room share, adapter or ticket changed: no shard is told"
    reply, resync = rounds.replied([None] * 4)
    assert reply is not None and reply["queue_depth"] == 20, "the depths known stand for a round sent nowhere"
    assert not resync, "no shard asked for a full report"


def test_an_adapter_loaded_is_told_to_its_shard_alone():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    messages = rounds.messages(report(resident=(OWN[2][0],)))
    assert sent_to(messages) == [2], "the adapter's owner alone hears of it"


def test_requests_of_an_adapter_wait_for_its_shards_next_report_summed():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    adapter = OWN[1][0]
    assert sent_to(rounds.messages(report(adapter_requests={adapter: 3}))) == [], "demand alone: no round"
    assert sent_to(rounds.messages(report(adapter_requests={adapter: 2}))) == [], "nor a second time"
    messages = rounds.messages(report(resident=(adapter,)))
    sent = messages[1]
    assert isinstance(sent, ReportDelta), "the adapter's load goes to its shard"
    assert dict(sent.adapter_requests) == {adapter: 5}, "with the requests of the rounds it missed, summed"


def test_an_arrived_ticket_waits_for_the_shard_that_granted_it_and_takes_its_slot():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5], running=4)
    assert rounds.rooms == [1, 1, 1, 1], "four free slots, four shards queueing alike: one each"
    rounds.arrived("t1", OWN[3][0])
    messages = rounds.messages(report(running=5, arrived_tickets=("t1",)))
    assert sent_to(messages) == [], "its grant took its own slot: every shard may still grant what it may"
    messages = rounds.messages(report(running=4))  # a request of another shard's finished
    assert sent_to(messages) == [3], "the freed slot goes to the shard that used its own"
    sent = messages[3]
    assert isinstance(sent, ReportDelta), "a delta against that shard's own base"
    assert sent.arrived_tickets == ("t1",), "with the ticket it granted, listed"
    assert rounds.rooms == [1, 1, 1, 1], "the shares as before the grant"


def test_a_ticket_of_an_unknown_shard_goes_to_every_shard():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    messages = rounds.messages(report(arrived_tickets=("lost",)))
    assert sent_to(messages) == [0, 1, 2, 3], "whoever granted it must hear of it"


def test_tickets_no_report_listed_do_not_keep_a_new_arrival_from_its_shard():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5], running=4)
    for i in range(MAX_TICKETS_KEPT):  # arrivals that left the replica's list before any report listed them
        rounds.arrived(f"unlisted-{i}", OWN[0][0])
    rounds.arrived("t1", OWN[3][0])
    rounds.messages(report(running=5, arrived_tickets=("t1",)))
    messages = rounds.messages(report(running=4))
    assert sent_to(messages) == [3], "the new ticket is still known as shard 3's: told to it alone"


def test_a_freed_slot_is_told_to_the_shard_whose_share_grew():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    messages = rounds.messages(report(running=7))
    assert len(sent_to(messages)) == 1, "one slot more: one shard's share, one report"
    assert sum(rounds.rooms) == 1, "the slot is that shard's to grant"


def test_every_shard_hears_from_the_replica_each_heartbeat():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    clock.advance(SHARD_HEARTBEAT_S)
    assert sent_to(rounds.messages(report())) == [0, 1, 2, 3], "a heartbeat reaches each shard"
    assert sent_to(rounds.messages(report())) == [], "and not again until the next one"


def test_a_shard_that_asks_for_a_resync_gets_the_next_round():
    clock = FakeClock()
    rounds = settled(clock, [5, 5, 5, 5])
    rounds.messages(report(resident=(OWN[0][0],)))
    rounds.replied([{"queue_depth": 5, "prefetch": [], "resync": True}, None, None, None])
    messages = rounds.messages(report(resident=(OWN[0][0],)))
    assert sent_to(messages) == [0], "the shard that lost its state, alone"
    assert isinstance(messages[0], ReplicaReport), "a full report"


def test_one_shard_gets_every_round():
    rounds = ReportRounds(1, FakeClock())
    answer(rounds, rounds.messages(report()), [0])
    assert sent_to(rounds.messages(report())) == [0], "one controller: every round, as before"

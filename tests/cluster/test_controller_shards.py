"""The cluster controller in shards (`cluster.sharding`), without Ray: the owner of an adapter is stable
and spread, the replicas' room is split between the shards without idling a slot while a ticket
waits, the shards' answers merge into one, and the replica's reporter and the ingress's admission
talk to the right shard. The sharded cluster for real: tests/serve/test_controller_shards_e2e.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections import Counter
from typing import Any

from helpers import CoalescedShard, FakeClock, FakeResponse
from tickets import CLASSES, ticket

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.report_round import SHARD_HEARTBEAT_S, ReportRounds
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sharding import (
    merge_placement,
    merge_replies,
    merge_snapshots,
    shard_deployment,
    shard_of,
    shard_report,
    split_room,
)
from lora_cluster.serve.replica.reporter import ControllerReporter
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.simulation import SimConfig, run

IDS = [f"adapter-{i}" for i in range(2000)]


def report(rid: str = "r1", *, capacity: int = 4, running: int = 0, room: int | None = None) -> ReplicaReport:
    return ReplicaReport(rid, "n1", capacity=capacity, max_num_seqs=capacity, max_loras=4, running=running,
                         waiting=0, free_adapter_slots=4, room=room)


# ----- ownership ------------------------------------------------------------------------------


def test_the_shard_of_an_adapter_is_the_same_in_every_process():
    code = ("from lora_cluster.cluster.sharding import shard_of;"
            f"print([shard_of(a, 7) for a in {IDS[:50]!r}])")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    here = str([shard_of(a, 7) for a in IDS[:50]])
    assert runs[0].strip() == runs[1].strip() == here, "a salted hash would differ between processes"


def test_adapters_spread_evenly_over_the_shards():
    for shards in (2, 3, 8):
        ids = [f"tenant-{i}/adapter" for i in range(20_000)]
        counts = Counter(shard_of(a, shards) for a in ids)
        assert set(counts) == set(range(shards)), f"every one of {shards} shards owns adapters"
        even = len(ids) / shards
        assert all(abs(n - even) < 0.1 * even for n in counts.values()), f"{shards} shards: {counts}"


def test_the_base_model_and_a_single_shard_belong_to_shard_zero():
    assert shard_of(None, 4) == 0, "requests without an adapter go to shard 0"
    assert {shard_of(a, 1) for a in IDS} == {0}, "one shard owns everything"


def test_shard_zero_keeps_the_controllers_deployment_name():
    assert shard_deployment("ClusterController", 0) == "ClusterController", "shard 0: the historical name"
    assert shard_deployment("ClusterController-ops", 2) == "ClusterController-ops-shard2", "others: a suffix"


# ----- the room split -------------------------------------------------------------------------


def test_room_beyond_the_demand_is_offered_to_every_shard():
    assert split_room(4, [0, 0]) == [4, 4], "nothing queued: any shard may grant every free slot"
    assert split_room(5, [1, 2]) == [3, 4], "each shard: its queued tickets plus the whole surplus"


def test_room_below_the_demand_is_split_by_queued_tickets_and_never_granted_twice():
    shares = split_room(4, [6, 2])
    assert shares == [3, 1], "in proportion to the queued tickets"
    for free, queued in [(7, [5, 5, 5]), (1, [3, 3]), (10, [100, 1, 0]), (3, [0, 9])]:
        shares = split_room(free, queued)
        assert sum(shares) == free, f"{free} slots, {queued} queued: every slot goes to one shard: {shares}"
        idle = [s for s, q in zip(shares, queued, strict=True) if q == 0]
        assert not any(idle), f"none to a shard without tickets: {shares}"


def test_a_remainder_slot_goes_round_the_shards():
    winners = {split_room(1, [2, 2], turn=t).index(1) for t in range(4)}
    assert winners == {0, 1}, "one free slot and equal queues: each shard gets it in turn"


def test_a_full_replica_offers_no_room():
    assert split_room(-2, [3, 1]) == [0, 0], "over capacity: nothing to grant"


def test_a_shard_grants_at_most_its_room():
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, clock=clock)
    ctl.report(report(capacity=4, running=0, room=1))
    at_once = [ctl.park(ticket(f"t{i}", "batch", 100.0)) for i in range(3)]
    granted = [g for g in at_once if g is not None] + list(ctl.take_grants().values())
    assert len(granted) == 1, "four free slots, one of them this shard's: one grant"


def test_two_shards_on_their_shares_fill_the_replica_exactly():
    clock = FakeClock(100.0)
    shards = [Controller(CLASSES, clock=clock) for _ in range(2)]
    queued = [3, 1]
    for k, ctl in enumerate(shards):  # tickets waiting before the replica had room
        ctl.report(report(capacity=4, running=4, room=0))
        for i in range(queued[k]):
            ctl.park(ticket(f"s{k}-{i}", "batch", 100.0))
    rooms = split_room(4, queued)
    for ctl, room in zip(shards, rooms, strict=True):  # the replica's next report round: 4 slots freed
        ctl.report(report(capacity=4, running=0, room=room))
    granted = [len(ctl.take_grants()) for ctl in shards]
    assert granted == [3, 1], "every waiting ticket granted, and no slot twice"


def test_a_shard_is_told_of_its_own_adapters_only():
    ids = IDS[:40]
    full = dataclasses.replace(report(), resident=tuple(ids[:20]), loading=tuple(ids[20:24]),
                               adapter_requests={a: 1 for a in ids})
    parts = [shard_report(full, k, 2, room=1) for k in range(2)]
    for k, part in enumerate(parts):
        listed = {*part.resident, *part.loading, *part.adapter_requests}
        assert listed and all(shard_of(a, 2) == k for a in listed), f"shard {k} hears of its adapters only"
        assert part.room == 1 and part.capacity == full.capacity, "with its room, and the rest as built"
    assert sorted(parts[0].resident + parts[1].resident) == sorted(full.resident), "together: every adapter"
    assert shard_report(full, 0, 1, None) is full, "one shard: the report as built"


# ----- merges ---------------------------------------------------------------------------------


def test_replies_merge_into_one_queue_depth_and_prefetch_list():
    merged = merge_replies([{"queue_depth": 2, "prefetch": ["b"], "replicas": 7},
                            {"queue_depth": 3, "prefetch": ["a", "b"], "replicas": 8}])
    assert merged == {"queue_depth": 5, "prefetch": ["a", "b"], "replicas": 8}, (
        "depths summed, prefetch united, the replicas the most any shard sees (they pace the reports)")


def test_placement_tables_unite():
    assert merge_placement([{"a": ("r1",)}, {"b": ["r1", "r2"]}]) == {"a": ["r1"], "b": ["r1", "r2"]}, \
        "each shard's adapters in the one table"


def snapshot(shard: int, depth: int, placement: dict[str, list[str]]) -> dict[str, Any]:
    return {"controller": {"actor": f"shard{shard}", "shard": shard, "counts": {"granted": 2 + shard}},
            "queue": {"depth": depth, "size": 10, "by_class": {"batch": depth},
                      "oldest_wait_s": float(depth)},
            "nodes": {"n1": {"replicas": {"r1": {"adapters": {"resident": [f"own{shard}"], "loading": []}}}}},
            "placement": placement}


def test_snapshots_merge_into_one_view_listing_every_shard():
    view = merge_snapshots([snapshot(0, 1, {"a": ["r1"]}), snapshot(1, 2, {"b": ["r2"]})])
    assert view["queue"]["depth"] == 3 and view["queue"]["by_class"] == {"batch": 3}, "queue depths summed"
    assert view["queue"]["oldest_wait_s"] == 2.0, "the oldest wait of any shard"
    assert view["controller"]["counts"] == {"granted": 5}, "counts summed"
    assert [s["actor"] for s in view["controller"]["shards"]] == ["shard0", "shard1"], "every shard listed"
    assert view["controller"]["actor"] == "shard0", "the controller's own fields: shard 0's"
    assert view["placement"] == {"a": ["r1"], "b": ["r2"]}, "placement united"
    assert view["nodes"]["n1"]["replicas"]["r1"]["adapters"]["resident"] == ["own0", "own1"], \
        "each replica's adapters: what every shard was told"


def test_a_shard_that_does_not_answer_is_listed_with_its_error():
    view = merge_snapshots([snapshot(0, 1, {}), RuntimeError("actor died")])
    assert view["controller"]["shards"][1] == {"shard": 1, "error": "actor died"}, "its error is shown"
    assert view["queue"]["depth"] == 1, "the view of the shards that answered"


# ----- the replica's reports and the ingress's admission, with fake shards ----------------------


class FakeShard:
    """One shard's handle: `report`, `admit`, `ingress_view` and `snapshot` answer from its fields."""

    def __init__(self, k: int, queue_depth: int, placement: dict[str, list[str]], elsewhere: int = 0):
        self.k, self.queue_depth, self.placement, self.elsewhere = k, queue_depth, placement, elsewhere
        self.reports: list[dict] = []
        self.tickets: list[dict] = []
        self.resync = self.dead = False
        self.report, self.admit = self._method(self._report), self._method(self._admit)
        self.ingress_view = self._method(lambda _ingress: {"placement": self.placement,
                                                           "queued_elsewhere": self.elsewhere})
        self.snapshot = self._method(lambda: snapshot(self.k, self.queue_depth, self.placement))

    @staticmethod
    def _method(fn: Any) -> Any:
        return type("Method", (), {"remote": staticmethod(lambda *a: FakeResponse(fn(*a)))})()

    def _report(self, payload: dict) -> dict:
        if self.dead:
            raise RuntimeError("actor died")
        self.reports.append(payload)
        return {"queue_depth": self.queue_depth, "prefetch": [f"p{self.k}"], "resync": self.resync}

    def _admit(self, request: dict, _timeout_s: float) -> dict | BaseException:
        if self.dead:
            self.on_dead_call()
            return RuntimeError("actor died")  # raised where the caller awaits the reply
        self.tickets.append(request)
        return {"replica_id": f"r{self.k}"}

    def on_dead_call(self) -> None:
        """What a call to this shard while dead does besides failing (a test moves its clock here)."""


async def test_the_reporter_tells_each_shard_its_room_and_merges_their_replies():
    shards = [FakeShard(0, 3, {}), FakeShard(1, 1, {})]
    replies: list[dict] = []

    async def build() -> ReplicaReport:
        return report(capacity=4, running=0)

    async def on_reply(reply: dict) -> None:
        replies.append(reply)

    reporter = ControllerReporter(shards, build, on_reply, period_s=60.0)
    await reporter.report_once()  # learns the queued counts: 3 and 1
    assert [s.reports[0]["room"] for s in shards] == [4, 4], "nothing known queued yet: all room to each"
    assert reporter.queue_depth == 4, "the queue depth the replica acts on is the shards' sum"
    assert replies[-1]["prefetch"] == ["p0", "p1"], "both shards' prefetch lists"
    await reporter.report_once()
    rooms = [s.reports[1]["changed"]["room"] for s in shards]
    assert rooms == [3, 1], "then the room split by the queued tickets"
    assert all(s.reports[1].get("delta") for s in shards), "each shard gets deltas against its own base"


async def test_a_shard_that_asks_for_a_resync_alone_gets_a_full_report():
    shards = [FakeShard(0, 0, {}), FakeShard(1, 0, {})]

    async def build() -> ReplicaReport:
        return dataclasses.replace(report(), sent_at=1.0)

    async def on_reply(_reply: dict) -> None:
        return None

    reporter = ControllerReporter(shards, build, on_reply, period_s=60.0, heartbeat_s=0.0)  # all, each round
    await reporter.report_once()
    shards[1].resync = True  # shard 1 restarted
    await reporter.report_once()
    shards[1].resync = False
    await reporter.report_once()
    assert shards[0].reports[2].get("delta"), "the shard that kept its state still gets deltas"
    assert not shards[1].reports[2].get("delta"), "the restarted shard gets a full report"


async def test_no_room_is_held_back_for_a_shard_that_does_not_answer():
    shards = [FakeShard(0, 6, {}), FakeShard(1, 6, {})]

    async def build() -> ReplicaReport:
        return report(capacity=4, running=0)

    async def on_reply(_reply: dict) -> None:
        return None

    clock = FakeClock()
    reporter = ControllerReporter(shards, build, on_reply, period_s=60.0, clock=clock)
    await reporter.report_once()  # both queue 6
    await reporter.report_once()
    assert shards[0].reports[-1]["changed"]["room"] == 2, "two shards queueing alike: half the room each"
    shards[1].dead = True
    await reporter.report_once()
    assert shards[0].reports[-1]["changed"]["room"] == 2, "nothing changed: no round, the dead shard unseen"
    clock.advance(SHARD_HEARTBEAT_S)  # the heartbeat reaches both: shard 1 does not answer
    await reporter.report_once()
    await reporter.report_once()
    assert shards[0].reports[-1]["changed"]["room"] == 4, "none held back for a dead shard after a heartbeat"


def full() -> dict[str, RoutingStats]:
    return {"r1": RoutingStats(num_running=2, num_waiting=0, max_num_seqs=2)}


async def test_a_request_parks_at_its_adapters_shard():
    shards = [FakeShard(0, 0, {}), FakeShard(1, 0, {})]
    admission = ClusterAdmission([CoalescedShard(s) for s in shards], capacity=None, replica_stats=full,
                                 timeout_s=30.0, clock=lambda: 0.0)
    adapters = IDS[:20]
    for a in adapters:
        granted = await admission.admit(sla_class="standard", adapter_id=a, arrived_at=0.0)
        assert granted is not None and granted.replica_id == f"r{shard_of(a, 2)}", f"{a} parks at its shard"
    assert {t["adapter_id"] for t in shards[1].tickets} == {a for a in adapters if shard_of(a, 2) == 1}, \
        "shard 1 saw exactly its own adapters' tickets"


async def test_an_unreachable_shard_sends_only_its_own_adapters_the_direct_way():
    clock = FakeClock()
    shards = [FakeShard(0, 0, {}), FakeShard(1, 0, {})]
    shards[1].dead = True
    shards[1].on_dead_call = lambda: clock.advance(3.0)  # each failed call takes 3 s
    admission = ClusterAdmission([CoalescedShard(s) for s in shards], capacity=None, replica_stats=full,
                                 timeout_s=60.0, clock=clock)
    mine = {k: next(a for a in IDS if shard_of(a, 2) == k) for k in (0, 1)}
    assert await admission.admit(sla_class="standard", adapter_id=mine[1], arrived_at=clock()) is None, \
        "shard 1 unreachable past the re-park window: its adapter's request goes the direct way"
    granted = await admission.admit(sla_class="standard", adapter_id=mine[0], arrived_at=clock())
    assert granted is not None and granted.replica_id == "r0", \
        "shard 0 still answers: its adapter's request still parks there and is granted"
    calls = len(shards[0].tickets)
    assert await admission.admit(sla_class="standard", adapter_id=mine[1], arrived_at=clock()) is None, \
        "shard 1 backs off: direct at once"
    assert len(shards[0].tickets) == calls, "a request of shard 1's adapter never parks at shard 0"


async def test_the_ingress_unites_the_shards_placement_and_counts_their_waiting_requests():
    shards = [FakeShard(0, 0, {"a": ["r1"]}, elsewhere=2), FakeShard(1, 0, {"b": ["r2"]}, elsewhere=3)]
    tables: list[dict] = []
    admission = ClusterAdmission(shards, capacity=None, replica_stats=lambda: {}, timeout_s=30.0,
                                 placement_sink=tables.append, placement_period_s=60.0)
    assert await admission.admit(sla_class="standard", adapter_id="a", arrived_at=0.0) is None, \
        "before the first fetch: the replicas have room"
    for _ in range(20):
        await asyncio.sleep(0)
    assert tables and tables[-1] == {"a": ["r1"], "b": ["r2"]}, "the router gets both shards' adapters"
    assert not admission.has_room(), "requests parked at either shard close the fast path"
    view = await admission.cluster_view()
    assert len(view["controller"]["shards"]) == 2, "GET /v1/cluster lists both shards"


# ----- the simulator --------------------------------------------------------------------------


def test_the_simulator_runs_the_shards_and_accounts_every_request():
    config = SimConfig(nodes=6, adapters=60, load=2.0, duration=15, warmup=0, seed=1, max_loras=4,
                       policy="lora-cluster", serve=ServeSections().with_fields(controller_shards=3))
    result = run(config)
    d = result.details
    assert result.completed + result.rejected == d["arrivals"], "every request completed or was refused"
    assert d["parked"] > 0 and d["controller_counts"]["granted"] > 0, "requests parked at the shards, granted"
    plane = result.to_json()["control_plane"]
    assert plane["shards"] == 3, "the control plane names the shards"
    assert 0 < plane["busiest_shard_cpu_s_per_sim_s"] <= plane["controller_cpu_s_per_sim_s"], \
        "the busiest shard's CPU is part of the controller's"


def _owned(shard: int, n: int = 2) -> list[str]:
    return [a for a in (f"a{i}" for i in range(40)) if shard_of(a, n) == shard]


def test_a_report_round_sends_each_shard_its_adapters_and_its_share_of_the_room():
    rounds = ReportRounds(2, FakeClock())
    rounds.queued[:] = [3, 1]  # the shards' last replies: 3 and 1 tickets queued, 2 free slots
    full = dataclasses.replace(report(capacity=4, running=2), resident=(*_owned(0)[:2], *_owned(1)[:2]))
    sent = rounds.messages(full)
    assert [set(m.resident) for m in sent] == [set(_owned(0)[:2]), set(_owned(1)[:2])], (
        "each shard is told of its own adapters only")
    assert sum(m.room for m in sent) == 2, "the free room is split, never granted twice"


def test_a_report_round_merges_the_answers_and_a_silent_shard_queues_nothing():
    rounds = ReportRounds(2, FakeClock())
    rounds.messages(report())
    mine, theirs = _owned(0)[0], _owned(1)[0]
    reply, resync = rounds.replied([{"queue_depth": 2, "prefetch": [mine, theirs], "resync": True}, None])
    assert reply == {"queue_depth": 2, "prefetch": [mine], "replicas": 0}, (
        "a shard's prefetch is cut to its own adapters")
    assert resync, "a shard asking for a full report is passed on"
    assert rounds.queued == [2, 0], "the silent shard counts as queueing nothing"
    assert rounds.replied([None, None]) == (None, False), "no answer, no reply"


def test_one_shard_gets_the_report_as_built_and_its_reply_as_given():
    rounds = ReportRounds(1, FakeClock())
    (sent,) = rounds.messages(report())
    assert sent.room is None, "one shard: no room is split"
    reply, _ = rounds.replied([{"queue_depth": 1, "prefetch": ["x"]}])
    assert reply == {"queue_depth": 1, "prefetch": ["x"]}, "the reply as the controller gave it"

"""Prefix-aware routing: the routing keys of prompt prefixes, a replica's bounded summary of them, the
score that weighs a cached prefix with adapter residency and load, and the live router's choice.

The live router is the real `LoraAffinityRouter`, built with the arguments Serve's handle router
passes (no Ray started); replicas are `RunningReplica`-shaped fakes whose reports carry `prefixes`
as `record_routing_stats` sends them; queue lengths go through the router's real Serve cache.
A request parked in the cluster queue is granted by the controller's `scheduling.choose_replica`,
which weighs the same keys among the replicas with room.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import CoalescedShard, FakeClock

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.prefix_keys import GRAIN, MAX_DEPTH, PrefixSummary, routing_keys, summary_keys
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_score import (
    PREFIX_SHARE,
    ReplicaView,
    cached_tokens,
    prefix_bonus,
    rank_replicas,
)
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.scheduling import choose_replica
from lora_cluster.config import ServeConfig
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.app import replica_options
from lora_cluster.serve.ops.ray_internals import offline_replica_id, offline_router
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.request_router import LoraAffinityRouter

MISS_COST = 4.0
SYSTEM = list(range(1000, 1450))  # a 450-token system prompt
CHAT = SYSTEM + list(range(5000, 5070))  # one chat's first turn on top of it (520 tokens)


# ----- keys and the summary ---------------------------------------------------------------------


def test_prompts_sharing_a_prefix_share_its_keys_and_no_deeper_ones() -> None:
    a = routing_keys("sql", SYSTEM + [1, 2, 3] * 100)
    b = routing_keys("sql", SYSTEM + [4, 5, 6] * 100)
    shared = len(SYSTEM) // GRAIN
    assert len(a) == (len(SYSTEM) + 300) // GRAIN, f"one key per {GRAIN} tokens of the prompt"
    assert a[:shared] == b[:shared], "the depths within the shared system prompt have the same keys"
    assert not set(a[shared:]) & set(b[shared:]), "the depths past the shared part differ"


def test_keys_name_the_adapter_and_ignore_nothing_else() -> None:
    assert routing_keys("sql", SYSTEM) != routing_keys("chat", SYSTEM), "two adapters never share keys"
    assert routing_keys(None, SYSTEM) != routing_keys("sql", SYSTEM), "the base model has keys of its own"
    assert routing_keys("sql", SYSTEM) == routing_keys("sql", list(SYSTEM)), "keys are deterministic"
    assert routing_keys("sql", list(range(GRAIN - 1))) == (), "a prompt shorter than a step has no key"
    assert len(routing_keys("sql", [7] * 100_000)) == MAX_DEPTH // GRAIN, f"no key past {MAX_DEPTH} tokens"
    assert routing_keys("sql", [-1] * 64) == (), "ids that are no token ids give no key (never an error)"


def test_a_replica_keeps_a_prompts_ladder_keys_and_its_deepest_key() -> None:
    keys = [f"k{i + 1}" for i in range(11)]  # depths 1..11 GRAINs
    assert summary_keys(keys) == ["k1", "k2", "k4", "k8", "k11"], "depths 1, 2, 4, 8 GRAINs and the deepest"
    assert summary_keys(keys[:8]) == ["k1", "k2", "k4", "k8"], "the deepest once when it is on the ladder"


def test_a_summary_keeps_the_most_recently_used_keys_up_to_its_bound() -> None:
    summary = PrefixSummary(capacity=4)
    summary.record(["a", "b", "c"])  # keeps a, b, c
    summary.record(["d", "e"])
    summary.record(["c"])
    assert len(summary) == 4, "the summary holds at most its capacity"
    assert summary.keys() == ("b", "d", "e", "c"), "the least recently used key left first; a reuse refreshes"


def test_a_report_carries_its_prefixes_and_a_parsed_report_keeps_at_most_the_bound() -> None:
    stats = RoutingStats(prefixes=("k1", "k2"))
    assert RoutingStats.from_dict(stats.to_dict()).prefixes == ("k1", "k2"), "prefixes survive the wire form"
    huge = RoutingStats.from_dict({"prefixes": [str(i) for i in range(10_000)]})
    assert len(huge.prefixes) == 256, "a report's prefix list is cut to the summary's bound"
    assert RoutingStats.from_dict({}).prefixes == (), "a replica that has not reported caches nothing known"


def test_a_job_computes_its_prefix_keys_once_and_carries_them() -> None:
    job = GenerateJob(request_id="r", prompt=CHAT, adapter_id="sql", sampling=SamplingParams())
    assert job.routing_prefix == routing_keys("sql", CHAT), "the job's keys are its prompt's"
    assert pickle.loads(pickle.dumps(job)).routing_prefix == job.routing_prefix, (
        "the keys travel with the job")
    text = GenerateJob(request_id="r", prompt="hello", adapter_id="sql", sampling=SamplingParams())
    assert text.routing_prefix == (), "a text prompt (not tokenized) has no keys"


# ----- the score --------------------------------------------------------------------------------


def view(rid: str, ongoing: int = 0, adapters: tuple[str, ...] = ("sql",), prefixes: tuple[str, ...] = ()):
    return ReplicaView(replica_id=rid, ongoing=ongoing, max_num_seqs=4, empty_adapter_slots=1,
                       adapters=frozenset(adapters), confirmed=frozenset(adapters), max_loras=4,
                       prefixes=frozenset(prefixes))


def test_the_replica_caching_the_prefix_wins_at_equal_load_and_the_deeper_prefix_wins_over_the_shallower():
    keys = routing_keys("sql", CHAT)
    system = summary_keys(routing_keys("sql", SYSTEM))
    replicas = [view("r0"), view("r1", prefixes=system), view("r2", prefixes=summary_keys(keys))]
    assert cached_tokens(keys, replicas[2]) == len(CHAT) // GRAIN * GRAIN, "r2 caches the whole chat"
    assert cached_tokens(keys, replicas[1]) == len(SYSTEM) // GRAIN * GRAIN, "r1 caches the system prompt"
    assert rank_replicas("sql", replicas, MISS_COST, keys) == ["r2", "r1", "r0"], (
        "the deeper the cached prefix, the better, at equal load")
    assert rank_replicas("sql", replicas, MISS_COST) == ["r0", "r1", "r2"], "without a prefix: by id"


def test_a_cached_prefix_never_keeps_a_request_on_an_overloaded_replica():
    keys = routing_keys("sql", CHAT)
    bound = PREFIX_SHARE * MISS_COST
    assert prefix_bonus(10 * MAX_DEPTH, MISS_COST) == bound, "the bonus is at most a share of a miss"
    # 4 batch slots: ongoing 4 is one request of queue excess, 4 + k is 1 + k; the chat's 512 cached
    # tokens are a bonus of 1.05, less the batch's occupancy (ongoing / 4, at most 1)
    half = [view("r0", ongoing=0), view("r1", ongoing=2, prefixes=keys)]
    assert rank_replicas("sql", half, MISS_COST, keys)[0] == "r1", (
        "a half-full batch (a discount of 0.5) leaves the cached prefix worth more than an idle replica")
    slightly = [view("r0", ongoing=0), view("r1", ongoing=4, prefixes=keys)]
    assert rank_replicas("sql", slightly, MISS_COST, keys)[0] == "r0", (
        "a full batch and one queued request (1 + a discount of 1) outweigh a 512-token cached prefix")
    overloaded = [view("r0", ongoing=0), view("r1", ongoing=3 + int(bound) + 1, prefixes=keys)]
    assert rank_replicas("sql", overloaded, MISS_COST, keys)[0] == "r0", (
        f"a queue excess above {bound} outweighs any cached prefix")
    missing = [view("r0"), view("r1", adapters=(), prefixes=keys)]
    assert rank_replicas("sql", missing, MISS_COST, keys)[0] == "r0", (
        "a cached prefix never outweighs loading the adapter on a replica that lacks it")


def test_the_configured_share_bounds_the_bonus_and_zero_turns_it_off():
    keys = routing_keys("sql", CHAT)
    assert ServeConfig().router.prefix_routing_share == PREFIX_SHARE, (
        "the score's default share is the config's")
    assert prefix_bonus(10 * MAX_DEPTH, MISS_COST, 0.25) == 0.25 * MISS_COST, "the bonus is at most the share"
    # r1 caches the chat (512 tokens: a bonus of share x 2.1 requests, less its full batch's discount of
    # 1) with a queue excess of 1
    replicas = [view("r0", ongoing=0), view("r1", ongoing=4, prefixes=keys)]
    assert rank_replicas("sql", replicas, MISS_COST, keys, prefix_share=0.5)[0] == "r0", (
        "at the default share (a bonus of 1.05 - 1), a queue excess of 1 outweighs the cached prefix")
    assert rank_replicas("sql", replicas, MISS_COST, keys, prefix_share=1.0)[0] == "r1", (
        "at share 1 (a bonus of 2.1 - 1), the cached prefix outweighs a queue excess of 1")
    equal = [view("r0"), view("r1", prefixes=keys)]
    assert rank_replicas("sql", equal, MISS_COST, keys, prefix_share=0.0) == ["r0", "r1"], (
        "at share 0 a cached prefix weighs nothing: by id at equal load")


def test_the_share_is_a_validated_setting_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_PREFIX_ROUTING_SHARE", "0.8")
    monkeypatch.setenv("LORA_CLUSTER_PREFIX_AWARE_ROUTING", "false")
    config = ServeConfig()
    assert config.router.prefix_routing_share == 0.8, "LORA_CLUSTER_PREFIX_ROUTING_SHARE sets the share"
    assert config.router.prefix_aware_routing is False, "LORA_CLUSTER_PREFIX_AWARE_ROUTING=false turns it off"
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="prefix_routing_share"):
            ServeConfig(prefix_routing_share=bad)


# ----- the live router --------------------------------------------------------------------------

APP = "prefix-routing-app"


def replica(rid: str, prefixes: tuple[str, ...] = ()) -> SimpleNamespace:
    """A `RunningReplica` as the router reads it: 4 seqs, 4 adapter slots, `sql` resident."""
    return SimpleNamespace(replica_id=offline_replica_id(rid, APP),
                           max_ongoing_requests=48,
                           routing_stats={"resident": ["sql"], "max_loras": 4, "empty_adapter_slots": 3,
                                          "free_adapter_slots": 4, "max_num_seqs": 4, "num_running": 0,
                                          "num_waiting": 0, "prefixes": list(prefixes)})


def pending(prompt: list[int]) -> SimpleNamespace:
    job = GenerateJob(request_id="r", prompt=prompt, adapter_id="sql", sampling=SamplingParams())
    return SimpleNamespace(args=(job,), routing_context=SimpleNamespace(should_backoff=False))


async def test_the_live_router_sends_a_turn_where_its_prefix_is_cached_unless_that_replica_is_overloaded():
    def ran(*prompts: list[int]) -> tuple[str, ...]:
        summary = PrefixSummary()
        for prompt in prompts:
            summary.record(routing_keys("sql", prompt))
        return summary.keys()

    others = [SYSTEM + [i] * 70 for i in range(3)]  # other chats with the same system prompt
    replicas = [replica("r0", ran(others[0])), replica("r1", ran(others[1])),
                replica("r2", ran(others[2], CHAT)), replica("r3")]  # r2 ran the chat's earlier turn
    router = offline_router(LoraAffinityRouter, APP)
    router.initialize_state(router={"router_miss_cost": MISS_COST, "router_placement_ttl_s": 5.0},
                            clock=FakeClock(0.0))
    router.update_replicas(replicas)
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, 2)
    next_turn = CHAT + list(range(9000, 9040))
    ranks = await router.choose_replicas(replicas, pending(next_turn))
    assert ranks[0][0].replica_id.unique_id == "r2", "the next turn goes where its earlier turns are cached"
    other = await router.choose_replicas(replicas, pending(list(range(20000, 20400))))
    assert other[0][0].replica_id.unique_id == "r0", "a prompt nobody caches goes by load and id"
    new_chat = await router.choose_replicas(replicas, pending(SYSTEM + [99] * 70))
    assert new_chat[0][0].replica_id.unique_id == "r0", (
        "a new chat goes to the first of the replicas caching its system prompt, not to r3")

    router.on_new_queue_len_info(replicas[2].replica_id, 12)  # 9 requests beyond its 4 batch slots
    busy = await router.choose_replicas(replicas, pending(next_turn))
    assert busy[0][0].replica_id.unique_id != "r2", "an overloaded replica loses the turn despite its cache"


def live_router(replicas: list[SimpleNamespace], **settings: Any) -> LoraAffinityRouter:
    """The live router over `replicas` (2 requests on each), built with Serve's `request_router_kwargs`
    (`settings`: fields of the router section)."""
    router = offline_router(LoraAffinityRouter, APP)
    section = {"router_miss_cost": MISS_COST, "router_placement_ttl_s": 5.0, **settings}
    router.initialize_state(router=section, clock=FakeClock(0.0))
    router.update_replicas(replicas)
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, 2)
    return router


async def test_with_prefix_aware_routing_off_the_live_router_ignores_the_cached_prefixes():
    chat = summary_keys(routing_keys("sql", CHAT))
    replicas = [replica("r0"), replica("r1"), replica("r2", chat)]
    next_turn = CHAT + list(range(9000, 9040))
    app_kwargs = replica_options(ServeConfig(prefix_aware_routing=False))["request_router_config"]
    router = live_router(replicas, **{k: v for k, v in app_kwargs.request_router_kwargs["router"].items()
                                      if k not in ("router_miss_cost", "router_placement_ttl_s")})
    ranks = await router.choose_replicas(replicas, pending(next_turn))
    assert ranks[0][0].replica_id.unique_id == "r0", (
        "adapter-only routing: the turn goes by load and id, not to r2 which caches its chat")
    aware = await live_router(replicas).choose_replicas(replicas, pending(next_turn))
    assert aware[0][0].replica_id.unique_id == "r2", "with the default (on) it goes where its chat is cached"


async def test_the_live_router_honours_the_configured_share():
    chat = summary_keys(routing_keys("sql", CHAT))
    replicas = [replica("r0"), replica("r1", chat)]
    next_turn = CHAT + list(range(9000, 9040))
    for share, expected in ((0.5, "r0"), (1.0, "r1")):
        router = live_router(replicas, prefix_routing_share=share)
        router.on_new_queue_len_info(replicas[1].replica_id, 4)  # its 4 batch slots full: 1 beyond
        ranks = await router.choose_replicas(replicas, pending(next_turn))
        assert ranks[0][0].replica_id.unique_id == expected, (
            f"share {share}: a queue excess of 1 against the cached chat sends the turn to {expected}")


# ----- the controller's grant -------------------------------------------------------------------


def grant_report(rid: str, running: int, prefixes: tuple[str, ...] = (), capacity: int = 4) -> ReplicaReport:
    return ReplicaReport(rid, "n1", capacity=capacity, max_num_seqs=capacity, max_loras=4, running=running,
                         waiting=0, free_adapter_slots=2, resident=("sql",), prefixes=prefixes)


def grant_ticket(prompt: list[int], adapter: str | None = "sql") -> Ticket:
    return Ticket(ticket_id="t", ingress_id="i", sla_class="standard", priority=1, adapter_id=adapter,
                  enqueued_at=100.0, prefix=routing_keys(adapter, prompt))


def test_a_parked_turn_is_granted_where_its_chat_is_cached_among_the_replicas_with_room():
    chat = summary_keys(routing_keys("sql", CHAT))
    view = ClusterView(stale_after_s=5, clock=FakeClock(100.0))
    for rid, running, prefixes in (("r1", 0, ()), ("r2", 3, chat), ("r3", 1, ())):
        view.update(ReplicaReport.from_dict(grant_report(rid, running, prefixes).to_dict()))  # over the wire
    next_turn = CHAT + [7] * 40
    assert choose_replica(grant_ticket(next_turn), view, {}) == "r2", (
        "the holder caching the chat's prefix gets the turn while it has room")
    assert choose_replica(grant_ticket(next_turn, adapter=None), view, {}) == "r1", (
        "a base-model turn does not match an adapter's cached prefix: the replica with the most room")
    view.update(grant_report("r2", 4, chat))
    assert choose_replica(grant_ticket(next_turn), view, {}) != "r2", (
        "a replica without room is never granted the turn, whatever it caches")


async def test_a_parked_request_carries_its_prompts_keys_to_the_controller():
    from lora_cluster.serve.routing.admission import ClusterAdmission

    calls: list[dict] = []

    class Controller:
        """`admit.remote(ticket, timeout)`: records the ticket, grants r2."""

        def __init__(self) -> None:
            self.admit = self

        def remote(self, ticket: dict, timeout_s: float) -> Any:
            calls.append(ticket)

            async def reply() -> dict:
                return {"replica_id": "r2", "preempt": False}
            return reply()

    full = {rid: RoutingStats(num_running=4, max_num_seqs=4) for rid in ("r1", "r2")}
    admission = ClusterAdmission(CoalescedShard(Controller()), capacity=None, replica_stats=lambda: full,
                                 timeout_s=30.0, clock=lambda: 0.0)
    keys = routing_keys("sql", CHAT)
    granted = await admission.admit(sla_class="standard", adapter_id="sql", arrived_at=0.0,
                                    prefix_of=lambda: keys)
    assert granted is not None and granted.replica_id == "r2", (
        "a full cluster parks the request at the controller")
    assert calls[0]["prefix"] == list(keys), "the ticket carries the prompt's routing keys"


async def test_a_request_on_the_fast_path_leaves_its_keys_to_the_router():
    from lora_cluster.serve.routing.admission import ClusterAdmission

    def never() -> tuple[str, ...]:
        raise AssertionError("the keys were computed on the ingress's loop")

    room = {"r1": RoutingStats(num_running=0, max_num_seqs=4)}
    admission = ClusterAdmission(object(), capacity=None, replica_stats=lambda: room, timeout_s=30.0,
                                 clock=lambda: 0.0)
    assert await admission.admit(sla_class="standard", adapter_id="sql", arrived_at=0.0,
                                 prefix_of=never) is None, "a cluster with room sends it the direct way"


async def test_with_prefix_aware_routing_off_the_controllers_grant_ignores_the_prompt_prefix():
    from lora_cluster.serve.controller_actor import ClusterController

    chat = summary_keys(routing_keys("sql", CHAT))
    next_turn = routing_keys("sql", CHAT + [7] * 40)
    for aware, expected in ((True, "r2"), (False, "r1")):
        actor = ClusterController.func_or_class(ServeConfig(prefix_aware_routing=aware).model_dump())
        for rid, running, prefixes in (("r1", 0, ()), ("r2", 2, chat)):
            await actor.report(grant_report(rid, running, prefixes).to_dict())
        reply = await actor.admit({"ticket_id": f"t-{aware}", "ingress_id": "i", "sla_class": "standard",
                                   "adapter_id": "sql", "waited_s": 0.0, "prefix": list(next_turn)}, 5.0)
        assert reply.get("replica_id") == expected, (
            f"prefix_aware_routing {aware}: the parked turn is granted to {expected} ({reply})")

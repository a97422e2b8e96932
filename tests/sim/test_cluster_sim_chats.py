"""The simulator's chats and prefix cache: multi-turn chats extend their prompts, the replica's prefix
cache keys blocks by adapter and evicts the least recently used idle ones, replicas report their
prefixes as live replicas do, the router ranks with them exactly as the live policy, and prefix-aware
routing keeps more of the chats' prompts cached than adapter-only routing."""

from __future__ import annotations

import contextlib
import io
import json

from lora_cluster.cluster.prefix_keys import summary_keys
from lora_cluster.cluster.routing_score import rank_replicas
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.replica_policy.prefix_hash import chain_root, extend_keys
from lora_cluster.sim import SimConfig, Simulation, run
from lora_cluster.sim.__main__ import main
from lora_cluster.sim.chats import ChatSettings, ChatWorkload
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.prefix_cache import SimPrefixCache
from lora_cluster.sim.workload import SimRequest, Workload

CLASSES = SlaClasses()
BS = 16


def request(rid: int, adapter: str, tokens: list[int], output: int = 8) -> SimRequest:
    """A request whose prompt is `tokens`, with the engine's block keys of its prompt and answer."""
    req = SimRequest(rid, adapter, CLASSES.get("standard"), len(tokens), output, 0.0, True)
    keys: list[bytes] = []
    full = tokens + [7] * output
    extend_keys(keys, chain_root(adapter, 0), full.__getitem__, len(tokens) + output - 1, BS)
    req.blocks = tuple(keys)
    return req


def served(cache: SimPrefixCache, req: SimRequest) -> int:
    """Run `req` through the cache (admitted, prefilled, finished); returns the prompt tokens found cached."""
    cache.admit(req)
    cache.computed(req, req.prompt)
    cache.release(req, req.prompt + req.output - 1)
    return req.cached


# ----- the cache model ---------------------------------------------------------------------------

def test_two_adapters_with_the_same_prompt_never_share_a_block() -> None:
    cache, prompt = SimPrefixCache(capacity=1000, block_size=BS), list(range(100))
    assert served(cache, request(0, "a0", prompt)) == 0, "a cold cache holds nothing"
    assert served(cache, request(1, "a1", prompt)) == 0, "another adapter's blocks are not reused"
    assert served(cache, request(2, "a0", prompt)) == 96, "the same adapter reuses the prompt's full blocks"


def test_at_least_one_token_is_computed_and_only_full_blocks_are_reused() -> None:
    cache = SimPrefixCache(capacity=1000, block_size=BS)
    served(cache, request(0, "a0", list(range(64))))
    again = request(1, "a0", list(range(64)))
    cache.admit(again)
    assert again.cached == 48, "a 64-token prompt fully cached reuses 3 blocks: its last token is computed"
    assert again.prefill_left == 16, "its step computes the rest of its prompt"


def test_the_least_recently_used_idle_chain_is_evicted_first() -> None:
    cache = SimPrefixCache(capacity=10, block_size=BS)  # two idle 4-block chains and a running request
    a, b = list(range(64)), list(range(100, 164))
    served(cache, request(0, "a0", a, output=1))
    served(cache, request(1, "a0", b, output=1))
    assert served(cache, request(2, "a0", a, output=1)) == 48, "a is used again: now the most recent"
    served(cache, request(3, "a0", list(range(200, 264)), output=1))  # needs room: evicts the LRU chain
    assert cache.evictions > 0, "the pool was full"
    assert served(cache, request(4, "a0", a, output=1)) == 48, "the recently used chain stayed"
    assert served(cache, request(5, "a0", b, output=1)) < 48, "the least recently used chain lost its tail"


def test_blocks_of_running_requests_are_never_evicted() -> None:
    cache = SimPrefixCache(capacity=8, block_size=BS)
    running = request(0, "a0", list(range(64)), output=1)
    cache.admit(running)
    cache.computed(running, 64)
    served(cache, request(1, "a0", list(range(100, 164)), output=1))
    assert served(cache, request(2, "a0", list(range(64)), output=1)) == 48, (
        "the running request's blocks stay cached and shared")


# ----- the chat workload -------------------------------------------------------------------------

def test_each_turn_extends_the_previous_prompt_and_answer() -> None:
    loop, sent = EventLoop(), []
    workload = Workload(adapters=3, zipf=1.0, rate=1.0, classes=[(CLASSES.get("standard"), 1.0)],
                        adapter_sizes=(1,), seed=0, measure_from=0.0)
    chats = ChatWorkload(ChatSettings(sessions=1, turns=3, think_s=1.0, system_tokens=200), workload,
                         [(CLASSES.get("standard"), 1.0)], zipf=1.0, seed=0, block_size=BS, loop=loop,
                         end=1000.0, submit=sent.append)
    chats.start()
    for turn in range(3):
        loop.run(until=loop.now + 100.0, stop=lambda n=turn: len(sent) > n)
        assert len(sent) == turn + 1, f"turn {turn + 1} arrived"
        chats.ended(sent[-1], completed=True)
    first, second, third = sent
    assert first.adapter == second.adapter == third.adapter, "a chat stays with its adapter"
    assert second.prompt > first.prompt + first.output, "the next prompt: the previous one, its answer, more"
    assert second.prefix[:len(first.prefix)] == first.prefix, "its routing keys extend the previous prompt's"
    done = (first.prompt + first.output - 1) // BS
    assert second.blocks[:done] == first.blocks[:done], "its blocks begin with those of the previous turn"
    assert first.prompt >= 200 + 4, "turn 1 is the adapter's system prompt and a message"


# ----- replicas, router, whole runs --------------------------------------------------------------

def chat_config(aware: bool = True, **kw: object) -> SimConfig:
    base = dict(nodes=4, adapters=1, max_loras=4, duration=10, warmup=5, seed=0,
                chats=ChatSettings(sessions=150, turns=6, think_s=2.0, system_tokens=500),
                serve=ServeSections().with_fields(prefix_aware_routing=aware))
    return SimConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_replicas_report_the_summary_keys_of_the_prompts_they_ran() -> None:
    sim = Simulation(chat_config())
    sim.advance(6.0)
    for rid, replica in sim.replicas.items():
        reqs = [*replica.waiting, *replica.running.values()]
        reported = set(replica.routing_stats().prefixes)
        assert reported == set(replica.report(4, 6.0).prefixes), f"{rid}: router and controller see the same"
        for req in reqs:
            assert set(summary_keys(req.prefix)) <= reported, f"{rid}: a request's prompt it took is reported"


def test_the_router_decision_with_prefixes_is_the_live_rank_over_every_replica() -> None:
    sim = Simulation(chat_config(nodes=6, adapters=4, chats=ChatSettings(sessions=200, turns=6, think_s=2.0)))
    sim.advance(9.0)
    policy = sim.policy
    assert isinstance(policy, LoraClusterPolicy)
    for rid in sim.replicas:
        policy.refresh_stats(rid)
    asked = [r for replica in sim.replicas.values() for r in [*replica.waiting, *replica.running.values()]]
    assert len(asked) > 20, "the paused cluster runs chats"
    routing, moved = policy.routing, 0
    for req in asked:
        placed = set(routing.placement.get(req.adapter, ()))
        views = [routing.view(rid, req.adapter if rid in placed else None) for rid in sorted(sim.replicas)]
        live = rank_replicas(req.adapter, views, routing.miss_cost, req.prefix, routing.prefix_share)[0]
        moved += live != rank_replicas(req.adapter, views, routing.miss_cost)[0]
        assert routing.choose(req.adapter, req.prefix) == live, f"request {req.rid}: another replica chosen"
    assert moved > 0, "the prompts' prefixes changed some decisions (the check is not adapter-only)"


def test_prefix_aware_routing_keeps_more_of_the_chats_cached_than_adapter_only_routing() -> None:
    aware, blind = run(chat_config(aware=True)), run(chat_config(aware=False))
    assert aware.chats is not None and blind.chats is not None, "a chat run reports chat figures"
    assert aware.chats["cached_token_share"] > blind.chats["cached_token_share"] + 0.1, (
        f"prefix-aware {aware.chats['cached_token_share']:.3f} vs adapter-only "
        f"{blind.chats['cached_token_share']:.3f}")
    assert aware.chats["prefix_aware_routing"], "the run says it routed by prefix"
    assert not blind.chats["prefix_aware_routing"], "the run says it routed by adapter only"


def test_without_chats_the_replicas_report_no_prefixes() -> None:
    sim = Simulation(SimConfig(nodes=2, adapters=10, load=0.5, duration=3, warmup=1, max_loras=4))
    sim.finish()
    assert all(not r.routing_stats().prefixes for r in sim.replicas.values()), "no chats: no prefix keys"


def test_the_command_line_prints_the_chat_figures() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--nodes", "2", "--adapters", "4", "--chats", "20", "--turns", "3", "--think", "1",
              "--duration", "5", "--warmup", "1", "--max-loras", "4", "--prefix-routing", "off", "--json"])
    chats = json.loads(out.getvalue())["chats"]
    assert {"cached_token_share", "replica_load", "ttft_p50_s", "ttft_p99_s", "prefix_aware_routing",
            "sessions", "turns"} <= set(chats), f"the documented keys: {sorted(chats)}"
    assert set(chats["replica_load"]) == {"min", "mean", "max", "max_over_mean"}, "load per replica"
    assert chats["prefix_aware_routing"] is False, "--prefix-routing off is adapter-only routing"
    assert 0.0 < chats["cached_token_share"] < 1.0, "turns after the first find their chat cached"

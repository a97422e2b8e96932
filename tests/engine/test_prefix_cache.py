"""Prefix caching: the block hash chain, the cache index and the allocator's sharing, the scheduler's
use of it under memory pressure, and the real engine on the demo zoo: the same tokens and logprobs
with the cache on and off over random mixed workloads (preemptions, chunked prefill, priorities,
prompt logprobs), no block shared across adapters or across versions of one adapter."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from helpers import greedy

from lora_cluster.config import EngineConfig, build_config
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.kv_cache import BlockAllocator
from lora_cluster.engine.schedule.prefix_cache import PrefixCacheIndex
from lora_cluster.engine.schedule.scheduler import Gate, Scheduler
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.replica_policy.prefix_hash import block_key, chain_root, extend_keys

# ----------------------------------------------------------------------------- hash chain


def _keys(root: bytes, tokens: list[int], block_size: int = 4) -> list[bytes]:
    keys: list[bytes] = []
    extend_keys(keys, root, tokens.__getitem__, len(tokens), block_size)
    return keys


def test_a_block_key_depends_on_adapter_version_and_every_token_before() -> None:
    tokens = list(range(1, 13))
    a0v1 = _keys(chain_root("a0", 1), tokens)
    assert len(a0v1) == 3, "12 tokens fill 3 blocks of 4"
    assert _keys(chain_root("a0", 1), tokens) == a0v1, "the same content gives the same keys"
    assert not set(_keys(chain_root("a1", 1), tokens)) & set(a0v1), "another adapter shares no key"
    assert not set(_keys(chain_root("a0", 2), tokens)) & set(a0v1), "another version shares no key"
    assert not set(_keys(chain_root(None, 1), tokens)) & set(a0v1), "the base model shares no key"
    assert chain_root(None, 1) == chain_root(None, 7), "the base model has one root whatever the version"
    changed = _keys(chain_root("a0", 1), [99, *tokens[1:]])
    assert not set(changed) & set(a0v1), "a changed first token changes every later block's key"
    assert _keys(chain_root("a0", 1), [*tokens, 50, 51])[:3] == a0v1, "a longer prompt extends the chain"
    assert len(_keys(chain_root("a0", 1), tokens[:11])) == 2, "a partial block has no key"
    assert block_key(b"r", [1, 2]) != block_key(b"r", [2, 1]), "token order matters"


# ----------------------------------------------------------------------------- allocator


ROOT = chain_root("a0", 1)


def _alloc(num_blocks: int = 8, slots: int = 3) -> BlockAllocator:
    return BlockAllocator(num_blocks=num_blocks, block_size=4, num_slots=slots,
                          prefix_cache=PrefixCacheIndex())


def _fill(alloc: BlockAllocator, slot: int, tokens: list[int], root: bytes = ROOT) -> int:
    """Admit `tokens` into `slot` as the scheduler does, compute them all; returns the tokens reused."""
    hit = alloc.reuse(slot, root, tokens.__getitem__, len(tokens))
    assert alloc.grow(slot, len(tokens)), "the test's pool has room"
    alloc.commit(slot, tokens.__getitem__, len(tokens))
    return hit


def test_a_new_sequence_reuses_the_longest_cached_chain_and_computes_at_least_one_token() -> None:
    alloc = _alloc()
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    assert _fill(alloc, 0, prompt) == 0, "nothing is cached at first"
    assert _fill(alloc, 1, prompt) == 8, "the same prompt reuses its 2 full blocks, not the partial one"
    assert alloc.table(1)[:2] == alloc.table(0)[:2], "the reused blocks are the first sequence's"
    assert alloc.table(1)[2] != alloc.table(0)[2], "the partial block is the sequence's own"
    exact = list(range(1, 9))  # exactly the 2 cached blocks
    assert _fill(alloc, 2, exact) == 4, "a fully cached prompt still computes its last block"
    other = [*range(1, 5), 77, 78, 79, 80, 81]
    alloc.free(2)
    assert _fill(alloc, 2, other) == 4, "a prompt that diverges in block 2 reuses block 1 only"


def test_shared_blocks_stay_with_their_other_holder_and_idle_ones_are_evicted_last() -> None:
    alloc = _alloc(num_blocks=4, slots=2)
    prompt = list(range(1, 9))
    _fill(alloc, 0, [*prompt, 9])  # 3 blocks, 2 of them full and cached
    _fill(alloc, 1, [*prompt, 10])  # shares the 2 full ones, takes 1
    assert alloc.num_free_blocks == 0, "4 blocks: 2 shared, one partial each"
    alloc.free(0)
    assert alloc.num_free_blocks == 1, "the freed slot's shared blocks stay held by the other slot"
    alloc.free(1)
    assert alloc.num_free_blocks == 4, "idle cached blocks count as free"
    assert alloc.prefix_cache.num_cached == 2, "the 2 full blocks keep their content while idle"
    assert alloc.grow(0, 8) and alloc.prefix_cache.num_cached == 2, "blocks without content go first"
    assert alloc.grow(0, 12) and alloc.prefix_cache.num_cached == 1, "then the least recently used idle one"
    assert alloc.prefix_stats()["prefix_cache_evictions"] == 1, "one eviction counted"


def test_a_duplicate_block_stays_uncached_and_goes_back_to_the_free_list() -> None:
    alloc = _alloc(num_blocks=4, slots=2)
    prompt = list(range(1, 6))
    alloc.reuse(0, ROOT, prompt.__getitem__, len(prompt))
    alloc.reuse(1, ROOT, prompt.__getitem__, len(prompt))  # admitted together: neither finds the other
    for slot in (0, 1):
        alloc.grow(slot, len(prompt))
        alloc.commit(slot, prompt.__getitem__, len(prompt))
    assert alloc.prefix_cache.num_cached == 1, "one key names one block: the duplicate is not cached"
    alloc.free(0)
    alloc.free(1)
    assert alloc.num_free_blocks == 4, "every block is free again (1 idle cached, 3 without content)"
    assert alloc.prefix_cache.num_idle == 1, "only the cached block is idle"


# ----------------------------------------------------------------------------- scheduler under pressure


def _seq(rid: str, prompt: list[int], priority: int = 0) -> Sequence:
    return Sequence(rid, "a0", prompt, greedy(), IncrementalDetokenizer(None), None, priority=priority)


def _run_to_end(s: Scheduler, seqs: list[Sequence], new_tokens: int) -> None:
    """Step as the engine does until every sequence has `new_tokens` outputs, then finish them."""
    for _ in range(500):
        out = s.schedule()
        for seq in out.decodes:
            seq.num_computed += 1
        for seq, n in out.prefills:
            seq.num_computed += n
        for seq in [*out.decodes, *(q for q, _ in out.prefills)]:
            if seq.num_computed == seq.num_tokens:
                seq.output_ids.append(7)
                if len(seq.output_ids) == new_tokens:
                    s.finish(seq)
        if all(len(q.output_ids) == new_tokens for q in seqs):
            return
    raise AssertionError("the sequences did not finish")


def test_idle_cached_blocks_are_evicted_before_any_sequence_is_preempted() -> None:
    blocks = _alloc(num_blocks=12, slots=3)
    s = Scheduler(max_num_seqs=3, max_num_batched_tokens=64, max_waiting=8,
                  acquire=lambda seq, may_claim: Gate.READY, release=lambda seq: None,
                  kv_blocks=blocks, prefix_root=lambda seq: ROOT)  # fmt: skip
    warm = [_seq(f"w{i}", [100 * i + t for t in range(1, 14)]) for i in range(3)]
    for seq in warm:
        s.add(seq)
    _run_to_end(s, warm, 3)  # 16 tokens each: 4 blocks, 3 of them full and cached
    assert blocks.prefix_cache.num_idle == 9, "the finished sequences leave 9 idle cached blocks"
    fresh = [_seq(f"f{i}", [1000 + 100 * i + t for t in range(1, 14)]) for i in range(3)]
    for seq in fresh:
        s.add(seq)
    _run_to_end(s, fresh, 3)  # all 12 blocks needed at once
    assert s.num_preemptions == 0, "no sequence is preempted while idle cached blocks can be evicted"
    evictions = blocks.prefix_stats()["prefix_cache_evictions"]
    assert evictions >= 9, "the idle cached blocks were evicted for them"


# ----------------------------------------------------------------------------- the engine


ADAPTERS = [None, "a0", "a1", "a2"]
SETTINGS = dict(max_loras=4, max_lora_rank=32, max_model_len=160, max_num_seqs=4, max_num_batched_tokens=24,
                kv_block_size=8, num_kv_blocks=24)


@pytest.fixture(scope="module")
def engines(make_engine) -> Iterator[dict[bool, Engine]]:
    """Two engines alike but for prefix caching: few blocks (preemptions) and a small step budget
    (chunked prefill)."""
    pair = {cache: make_engine(enable_prefix_caching=cache, **SETTINGS) for cache in (True, False)}
    yield pair
    for engine in pair.values():
        engine.close()


Workload = tuple[list[list[int]], list[str | None], list[SamplingParams], list[int]]


def _workload(rng: random.Random) -> Workload:
    """Requests of two "business lines" (an adapter, or the base model, with its own system prompt)
    and others of random adapters, some with another line's prompt (the same tokens under other
    weights), some unshared; random lengths and priorities; some ask for prompt logprobs."""
    prefixes = [[rng.randrange(5, 500) for _ in range(rng.randrange(10, 60))] for _ in range(2)]
    lines = list(zip(rng.sample(ADAPTERS, 2), prefixes, strict=True))
    prompts, adapters, params, priorities = [], [], [], []
    for _ in range(rng.randrange(10, 16)):
        if rng.random() < 0.7:
            adapter, head = rng.choice(lines)
        else:
            adapter, head = rng.choice(ADAPTERS), rng.choice([*prefixes, []])
        prompts.append(head + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 25))])
        adapters.append(adapter)
        params.append(greedy(rng.randrange(4, 24), logprobs=2,
                             prompt_logprobs=1 if rng.random() < 0.15 else None))
        priorities.append(rng.choice([0, 0, 1]))
    return prompts, adapters, params, priorities


LOGPROB_ROUNDING = 1e-5  # float32 rounding at logprobs of about -6 is 4.8e-7 (one unit in the last place)


def _facts(out) -> tuple:
    """What a request's output must not change with the cache: its tokens, the top-2 ids at each
    position and its prompt logprobs' ids."""
    prompt = None if out.prompt_logprobs is None else [lp and lp.token_id for lp in out.prompt_logprobs]
    return out.token_ids, [[t for t, _ in lp.top] for lp in out.logprobs], prompt


def _logprob_gap(on, off) -> float:
    """The largest difference between two outputs' logprobs (generated, their top-2, and prompt)."""
    pairs = [(a.logprob, b.logprob) for a, b in zip(on.logprobs, off.logprobs, strict=True)]
    pairs += [(x, y) for a, b in zip(on.logprobs, off.logprobs, strict=True)
              for (_, x), (_, y) in zip(a.top, b.top, strict=True)]
    if on.prompt_logprobs is not None:
        pairs += [(a.logprob, b.logprob)
                  for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:], strict=True)]
    return max((abs(x - y) for x, y in pairs), default=0.0)


def test_outputs_and_logprobs_are_the_same_with_the_cache_on_and_off(engines) -> None:
    """Tokens are equal; logprobs equal up to float32 rounding. The engine is not batch-invariant: a
    request's logits move in their last bit with the batch it shares a step with (the same happens
    between two runs without the cache whose batches differ), and the cache changes the batches."""
    rng = random.Random(2025)
    cached_requests = 0
    for round_ in range(4):
        prompts, adapters, params, priorities = _workload(rng)
        outs = {cache: engine.generate(prompts, adapters, params, priorities)
                for cache, engine in engines.items()}
        for i, (on, off) in enumerate(zip(outs[True], outs[False], strict=True)):
            where = f"round {round_}, request {i} ({adapters[i]}, {len(prompts[i])} prompt tokens, " \
                    f"{on.num_cached_tokens} cached)"
            assert _facts(on) == _facts(off), f"{where}: the cache changed its tokens or top logprob ids"
            assert _logprob_gap(on, off) <= LOGPROB_ROUNDING, f"{where}: the cache changed its logprobs"
            assert off.num_cached_tokens == 0, "without the cache nothing is reported cached"
            if params[i].prompt_logprobs is not None:
                assert on.num_cached_tokens == 0, "a request asking for prompt logprobs computes its prompt"
        cached_requests += sum(o.num_cached_tokens > 0 for o in outs[True])
    assert cached_requests >= 10, f"the workloads reuse cached prefixes ({cached_requests} requests did)"
    assert engines[True].counters_snapshot()["prefix_cache_hit_tokens"] > 0, "the engine counts hit tokens"
    assert engines[True].stats().num_preemptions > 0, "the workloads preempt sequences with the cache on"
    assert engines[True].counters_snapshot()["prefix_cache_evictions"] > 0, "and evict cached blocks"
    assert engines[False].stats().num_preemptions > 0, "and with it off"
    blocks = engines[True].scheduler.kv_blocks
    assert blocks.num_free_blocks == SETTINGS["num_kv_blocks"], "no block leaks: all free or idle cached"


def test_a_preempted_sequence_reuses_its_own_blocks_when_readmitted(make_engine) -> None:
    engine = make_engine(**{**SETTINGS, "num_kv_blocks": 12, "max_num_seqs": 2, "max_model_len": 96})
    prompts = [list(range(5, 35)), list(range(205, 235))]
    outs = engine.generate(prompts, ["a0", "a1"], greedy(50), priorities=[0, 1])
    hits = engine.counters_snapshot()["prefix_cache_hit_tokens"]
    readmitted = hits - sum(o.num_cached_tokens for o in outs)
    assert sum(o.num_preemptions for o in outs) > 0, "12 blocks of 8 cannot hold both 80-token sequences"
    assert readmitted > 0, "a preempted sequence found blocks it had computed when re-admitted"
    engine.close()


def test_two_adapters_never_share_blocks_and_one_adapters_requests_do(make_engine) -> None:
    engine = make_engine(**SETTINGS)
    prompt = list(range(10, 60))  # 6 full blocks of 8 and 2 tokens
    first = engine.generate([prompt], ["a0"], greedy(4))[0]
    assert first.num_cached_tokens == 0, "the first request finds nothing cached"
    other = engine.generate([prompt], ["a1"], greedy(4))[0]
    assert other.num_cached_tokens == 0, "another adapter with the same prompt reuses no block"
    base = engine.generate([prompt], [None], greedy(4))[0]
    assert base.num_cached_tokens == 0, "the base model reuses no adapter's block"
    again = engine.generate([prompt], ["a0"], greedy(4))[0]
    assert again.num_cached_tokens == 48, "the same adapter's request reuses its 6 full blocks"
    engine.add_request("x", prompt, "a0", greedy(20))
    engine.add_request("y", prompt, "a1", greedy(20))
    engine.add_request("z", prompt, "a0", greedy(20))
    for _ in range(8):
        engine.step()
    blocks = engine.scheduler.kv_blocks
    tables = {s.request_id: set(blocks.table(s.kv_slot)) for s in engine.scheduler.running}
    assert len(tables) == 3, "the three requests run together"
    assert not tables["x"] & tables["y"], "requests of two adapters hold no block in common"
    assert len(tables["x"] & tables["z"]) == 6, "two requests of one adapter share the prompt's full blocks"
    engine.close()


def test_requests_after_a_reload_never_reuse_the_old_versions_blocks(make_engine, demo_zoo) -> None:
    prompt = list(range(100, 150))
    reference = make_engine(**{**SETTINGS, "enable_prefix_caching": False})
    own = {a: reference.generate([prompt], [a], greedy(12))[0].token_ids for a in ("a4", "a5")}
    reference.close()
    assert own["a4"] != own["a5"], "the two adapters answer differently (else this test proves nothing)"
    engine = make_engine(**SETTINGS)
    engine.loader.register("y", str(demo_zoo.adapters_dir / "a4"))
    warm = engine.generate([prompt], ["y"], greedy(12))[0]
    assert warm.token_ids == own["a4"], "y serves a4's weights"
    engine.add_request("old", prompt, "y", greedy(40))  # runs on the old version through the reload
    for _ in range(4):
        engine.step()
    engine.loader.register("y", str(demo_zoo.adapters_dir / "a5"))
    engine.add_request("new", prompt, "y", greedy(12))
    finals = {}
    for _ in range(300):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if len(finals) == 2:
            break
    assert finals["old"].num_cached_tokens == 48, "before the reload, y's requests reuse y's blocks"
    assert finals["new"].num_cached_tokens == 0, "after the reload no old-version block is reused"
    assert finals["new"].token_ids == own["a5"], "the request after the reload gets the new weights' tokens"
    assert finals["old"].token_ids[:12] == own["a4"], "the request running through the reload keeps a4's"
    after = engine.generate([prompt], ["y"], greedy(12))[0]
    assert after.num_cached_tokens == 48, "the new version's own blocks are reused"
    assert after.token_ids == own["a5"], "and give the new weights' tokens"
    engine.close()


def test_enable_prefix_caching_is_on_by_default_and_overridable(monkeypatch) -> None:
    assert build_config(EngineConfig, model="demo").enable_prefix_caching is True, "on by default"
    monkeypatch.setenv("LORA_CLUSTER_ENABLE_PREFIX_CACHING", "false")
    off = build_config(EngineConfig, model="demo")
    assert off.enable_prefix_caching is False, "LORA_CLUSTER_ENABLE_PREFIX_CACHING=false turns it off"

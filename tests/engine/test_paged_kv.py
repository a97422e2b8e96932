"""Paged KV cache: block bookkeeping, the scheduler's block policy (preempt, never fail), the engine
with few blocks (same tokens, no leak), memory sizing from device numbers, and the LoRA fast paths
of the engine (BGMV decodes, fused shrinks) against the plain SGMV path."""

from __future__ import annotations

import pytest
import torch

from lora_cluster.config import EngineConfig, build_config
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.model.lora_layer import use_bgmv
from lora_cluster.engine.model.memory_plan import DeviceMemory, cpu_plan, plan_device_memory
from lora_cluster.engine.model.step_buffers import StepBuffers
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.kv_cache import BlockAllocator, blocks_for
from lora_cluster.engine.schedule.scheduler import Gate, Scheduler
from lora_cluster.engine.schedule.sequence import SeqStatus, Sequence
from lora_cluster.errors import ConfigError

GIB = 1 << 30


# ----------------------------------------------------------------------------- block allocator


def test_blocks_are_taken_as_a_sequence_grows_and_all_come_back() -> None:
    alloc = BlockAllocator(num_blocks=6, block_size=4, num_slots=2)
    assert alloc.grow(0, 5), "5 tokens fit in 2 free blocks"
    assert len(alloc.table(0)) == 2, "5 tokens of 4-token blocks take 2 blocks"
    assert alloc.grow(0, 8) and len(alloc.table(0)) == 2, "growing within the last block takes no block"
    assert alloc.grow(1, 16), "another slot takes the 4 remaining blocks"
    assert alloc.num_free_blocks == 0, "every block is held"
    assert not alloc.grow(0, 9), "no free block: grow fails"
    assert len(alloc.table(0)) == 2, "a failed grow takes nothing"
    assert not set(alloc.table(0)) & set(alloc.table(1)), "a block belongs to one slot"
    assert alloc.tokens_fit(0, 100) == 8, "tokens_fit is bounded by the slot's blocks plus the free ones"
    alloc.free(1)
    assert alloc.num_free_blocks == 4, "free gives back every block of the slot"
    assert alloc.table(1) == [], "a freed slot has no blocks"
    assert alloc.tokens_fit(0, 100) == 24, "after the free, 4 more blocks could be taken"


# ----------------------------------------------------------------------------- scheduler with blocks


def _seq(rid: str, prompt_len: int, priority: int = 0) -> Sequence:
    return Sequence(rid, None, list(range(1, prompt_len + 1)), SamplingParams(), IncrementalDetokenizer(None),
                    None, priority=priority)  # fmt: skip


def _scheduler(num_blocks: int, block_size: int = 4, slots: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(
        max_num_seqs=slots, max_num_batched_tokens=budget, max_waiting=16,
        acquire=lambda seq, may_claim: Gate.READY, release=lambda seq: None,
        kv_blocks=BlockAllocator(num_blocks=num_blocks, block_size=block_size, num_slots=slots),
    )  # fmt: skip


def _run(s: Scheduler) -> tuple[list[str], list[str]]:
    """One step played as the engine does; returns (ids that ran, ids preempted)."""
    out = s.schedule()
    for seq in out.decodes:
        seq.num_computed += 1
    for seq, n in out.prefills:
        seq.num_computed += n
    for seq in [*out.decodes, *(q for q, _ in out.prefills)]:
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)
    ran = [q.request_id for q in out.decodes] + [q.request_id for q, _ in out.prefills]
    return ran, [q.request_id for q in out.preempted]


def test_a_running_sequence_without_a_block_preempts_the_least_urgent_never_fails() -> None:
    s = _scheduler(num_blocks=4)
    urgent, lax = _seq("urgent", 4, priority=0), _seq("lax", 4, priority=1)
    s.add(urgent)
    s.add(lax)
    assert _run(s) == (["urgent", "lax"], []), "both prompts fit (one block each, a block left)"
    preempted: list[str] = []
    for _ in range(8):
        preempted += _run(s)[1]
    assert preempted and set(preempted) == {"lax"}, "only the less urgent sequence is preempted for blocks"
    assert urgent.status is SeqStatus.RUNNING, "the urgent sequence keeps running"
    assert lax.status is not SeqStatus.FINISHED, "a preempted sequence is not failed"
    assert len(urgent.output_ids) == 9, "the urgent sequence decoded every step"


def test_the_least_urgent_sequence_lacking_a_block_preempts_itself() -> None:
    s = _scheduler(num_blocks=3)
    a, b = _seq("a", 4), _seq("b", 4)  # equal priority: b, the later arrival, is the less urgent
    s.add(a)
    s.add(b)
    _run(s)
    assert _run(s) == (["a"], ["b"]), "a takes the last block; b, lacking one, preempts itself"
    assert b.status is SeqStatus.WAITING and b.num_computed == 0, "b waits to be recomputed"
    assert _run(s) == (["a"], []), "b is not re-admitted without a free block (no less urgent victim)"
    held = sum(len(s.kv_blocks.table(q.kv_slot)) for q in s.running)
    assert s.kv_blocks.num_free_blocks + held == 3, "free plus held blocks is the pool"


def test_admission_cuts_the_first_chunk_to_the_free_blocks() -> None:
    s = _scheduler(num_blocks=3, block_size=4)
    long = _seq("long", 20)
    s.add(long)
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.prefills] == [("long", 12)], (
        "a prompt longer than the free blocks prefills what 3 blocks of 4 hold"
    )


def test_finishing_returns_every_block() -> None:
    s = _scheduler(num_blocks=8)
    seqs = [_seq(f"r{i}", 5) for i in range(3)]
    for q in seqs:
        s.add(q)
    _run(s)
    _run(s)
    for q in seqs:
        s.finish(q)
    assert s.kv_blocks.num_free_blocks == 8, "finished sequences hold no block"


# ----------------------------------------------------------------------------- engine


PROMPTS = ["the quick brown fox", "hello there my friend", "a long story begins when the light", "we",
           "one two"]
ADAPTERS = ["a0", "a1", None, "a3", "a0"]


def _engine(make_engine, **kw) -> Engine:
    return make_engine(max_loras=4, max_lora_rank=32, max_model_len=64, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def roomy_outputs(make_engine) -> list[list[int]]:
    engine = _engine(make_engine, max_num_seqs=8, max_num_batched_tokens=64)
    outs = engine.generate(PROMPTS, ADAPTERS, SamplingParams(max_new_tokens=40, temperature=0,
                                                             ignore_eos=True))
    return [o.token_ids for o in outs]


def test_few_blocks_preempt_and_give_the_same_tokens_without_leaks(make_engine, roomy_outputs) -> None:
    # 8 blocks of 8 tokens: one 64-token sequence fits, the five together do not
    engine = _engine(make_engine, max_num_seqs=5, max_num_batched_tokens=64,
                     kv_block_size=8, num_kv_blocks=8)  # fmt: skip
    outs = engine.generate(PROMPTS, ADAPTERS, SamplingParams(max_new_tokens=40, temperature=0,
                                                             ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * 5, "every request completes, none fails"
    assert engine.stats().num_preemptions > 0, "running out of blocks preempted sequences"
    assert [o.token_ids for o in outs] == roomy_outputs, "recomputed requests give the same tokens"
    blocks = engine.scheduler.kv_blocks
    assert blocks.num_free_blocks == 8, "no block leaks once every request is done"
    assert all(not blocks.table(slot) for slot in range(5)), "no slot keeps a block table"


def test_abort_gives_back_the_blocks(make_engine) -> None:
    engine = _engine(make_engine, max_num_seqs=2, kv_block_size=8, num_kv_blocks=16)
    engine.add_request("x", "hello there my friend", "a1", SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_blocks.num_free_blocks < 16, "a running request holds blocks"
    engine.abort("x")
    assert engine.scheduler.kv_blocks.num_free_blocks == 16, "abort gives back every block"


def test_more_sequences_fit_in_the_memory_of_two_full_length_ones(make_engine) -> None:
    # KV memory of 2 sequences of max_model_len (64 tokens) = 16 blocks of 8; 8 short requests
    engine = _engine(make_engine, max_num_seqs=8, max_num_batched_tokens=64,
                     kv_block_size=8, num_kv_blocks=2 * blocks_for(64, 8))  # fmt: skip
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", "hello there", None, params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    assert peak == 8, "all 8 short sequences ran at once in the memory of 2 full-length reservations"
    assert engine.stats().num_preemptions == 0, "they fitted without preemption"


def _step_logits(engine: Engine) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    forward = engine.runner.forward

    def spy(batch):
        logits = forward(batch)
        captured.append(logits[: len(batch.sampled)].clone())
        return logits

    engine.runner.forward = spy
    engine.generate(PROMPTS, ADAPTERS, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    return captured


PATH_KW = {"max_num_seqs": 8, "max_num_batched_tokens": 24}  # chunked prefills share steps with decodes


@pytest.fixture(scope="module")
def plain_logits(make_engine) -> list[torch.Tensor]:
    """Step logits of the plain path: SGMV for every row, one shrink per projection."""
    return _step_logits(_engine(make_engine, lora_decode_kernel="sgmv",
                                lora_fused_shrink=False, **PATH_KW))  # fmt: skip


@pytest.mark.parametrize(("decode_kernel", "fused"), [("bgmv", True), ("bgmv", False), ("sgmv", True)])
def test_lora_fast_paths_give_the_plain_sgmv_logits(make_engine, plain_logits, decode_kernel, fused) -> None:
    plain = plain_logits
    fast = _step_logits(_engine(make_engine, lora_decode_kernel=decode_kernel,
                                lora_fused_shrink=fused, **PATH_KW))  # fmt: skip
    assert len(fast) == len(plain), "the same steps ran"
    for i, (a, b) in enumerate(zip(fast, plain, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, i=i: f"step {i}: logits differ: {m}")


def test_use_bgmv_policy() -> None:
    assert use_bgmv("auto", [0, 1, 2, 3], "triton"), "triton, distinct adapters (runs of 1): BGMV"
    assert not use_bgmv("auto", [0, 0, 0, 1, 1, 1], "triton"), "triton, runs of 3: SGMV"
    assert not use_bgmv("auto", [5], "triton"), "a single decode token: SGMV"
    assert not use_bgmv("auto", [], "triton"), "no decodes: nothing to gather"
    assert not use_bgmv("auto", [0, 1, 2, 3], "cpu"), "cpu ops: SGMV (their BGMV copies the weights)"
    assert use_bgmv("bgmv", [0, 0, 0], "cpu"), "forced bgmv"
    assert not use_bgmv("sgmv", [0, 1, 2], "triton"), "forced sgmv"


def test_step_buffers_pack_views() -> None:
    a, b, c = StepBuffers(torch.device("cpu")).pack([[1, 2, 3], [], [4, 5]])
    assert a.tolist() == [1, 2, 3], "first list"
    assert b.numel() == 0, "an empty list gives an empty tensor"
    assert c.tolist() == [4, 5], "last list"
    assert a.dtype == torch.int64, "int64 tensors"


# ----------------------------------------------------------------------------- memory sizing


def _plan(total: float, free: float, **kw):
    args = {"gpu_memory_utilization": 0.9, "adapter_pool_share": 0.3, "buffer_share": 0.1,
            "block_bytes": 2 << 20, "slot_bytes": 256 << 20, "max_loras": 1000, "min_kv_blocks": 128, **kw}
    return plan_device_memory(DeviceMemory(int(total * GIB), int(free * GIB)), **args)


def test_gpu_plan_follows_the_60_30_10_split() -> None:
    # 80 GiB device, 14 GiB of base weights loaded: budget 72, pool <= 21.6 (86 slots of 0.25), buffer 7.2
    plan = _plan(80, 66)
    assert plan.num_adapter_slots == 86, "the pool takes as many 256 MiB slots as 30% of the budget holds"
    assert plan.adapter_pool_bytes <= 0.3 * 0.9 * 80 * GIB, "the pool stays within its share"
    assert plan.buffer_bytes == int(0.1 * int(0.9 * 80 * GIB)), "the buffer is 10% of the budget"
    kv = int(0.9 * 80 * GIB) - 14 * GIB - plan.buffer_bytes - plan.adapter_pool_bytes
    assert plan.num_kv_blocks == kv // (2 << 20), "the KV cache gets the rest, in whole blocks"


def test_gpu_plan_gives_unneeded_pool_share_to_the_kv_cache() -> None:
    small, large = _plan(80, 66, max_loras=8), _plan(80, 66)
    assert small.num_adapter_slots == 8, "max_loras caps the slots"
    assert small.num_kv_blocks > large.num_kv_blocks, "fewer slots leave more KV blocks"


def test_gpu_plan_refuses_what_cannot_fit() -> None:
    with pytest.raises(ConfigError, match="one max_model_len sequence needs 128"):
        _plan(16, 2)  # the base model takes nearly everything
    with pytest.raises(ConfigError, match="holds no adapter slot"):
        _plan(80, 66, slot_bytes=40 * GIB)


def test_gpu_plan_with_explicit_blocks_needs_only_free_memory() -> None:
    # another engine already holds 70 of 80 GiB: the budget is spent, but 8 GiB are free
    plan = _plan(80, 8, num_kv_blocks=1000, max_loras=8)
    assert plan.num_kv_blocks == 1000, "the explicit block count is kept"
    assert plan.num_adapter_slots == 8, "the pool is sized as without it"
    with pytest.raises(ConfigError, match=r"need more than the 8\.00 GiB free"):
        _plan(80, 8, num_kv_blocks=4000, max_loras=8)  # 7.8 GiB of blocks + 2 GiB of slots


def test_cpu_plan_keeps_a_full_reservation_per_sequence() -> None:
    plan = cpu_plan(max_num_seqs=4, max_model_len=100, block_size=16, block_bytes=10, slot_bytes=7,
                    max_loras=3, num_kv_blocks=None)  # fmt: skip
    assert plan.num_kv_blocks == 4 * 7, "max_num_seqs sequences of max_model_len tokens (7 blocks each)"
    assert plan.num_adapter_slots == 3, "max_loras slots"
    given = cpu_plan(max_num_seqs=4, max_model_len=100, block_size=16, block_bytes=10, slot_bytes=7,
                     max_loras=3, num_kv_blocks=9)  # fmt: skip
    assert given.num_kv_blocks == 9, "num_kv_blocks wins"


def test_block_size_must_be_a_power_of_two() -> None:
    with pytest.raises(ConfigError, match="kv_block_size"):
        build_config(EngineConfig, model="m", kv_block_size=12)


def test_too_few_blocks_for_one_sequence_is_a_config_error(make_engine) -> None:
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        make_engine(adapter_source=None, max_model_len=64, kv_block_size=16, num_kv_blocks=3)

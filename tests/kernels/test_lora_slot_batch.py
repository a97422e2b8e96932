"""The CPU ops' slot-batched path (lora_kernels.slot_batch): the same results as the reference on
every adapter mix, batch size and rank, whichever path runs; the layout it builds; and the policy
that picks it (pinned: a decode step of many distinct adapters takes it, one adapter does not)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from lora_kernels import LoraMeta, build_lora_meta, cpu, get_lora_ops, native, slot_batch
from lora_kernels import reference as ref
from torch import Tensor

from lora_cluster.config import EngineConfig
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.model.base_model import fused_splits
from lora_cluster.engine.model.batch import StepBatch
from lora_cluster.engine.model.lora_layer import LoraLayer, fused_shrink, use_bgmv

MIXES = ("distinct", "uniform", "zipf", "identical", "skewed", "pool-rows")
N_SLOTS = 40  # the last slot is empty (rank 0)
K, N = 40, 56


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _slots(mix: str, n_tok: int, gen: torch.Generator) -> list[int]:
    """Decode-like slots (one token per sequence, sorted by slot as the engine does; -1 = base).
    `pool-rows`: what the engine passes for one projection, the pool rows of distinct adapters in
    slot order, which is not row order, and -1 for the adapters that do not target it."""
    if mix == "pool-rows":
        seq = torch.randperm(N_SLOTS - 1, generator=gen)[:n_tok]
        return torch.where(torch.rand(n_tok, generator=gen) < 0.3, -1, seq).tolist()
    if mix == "distinct":
        seq = torch.randperm(N_SLOTS - 1, generator=gen)[:n_tok].tolist()
    elif mix == "uniform":
        seq = torch.randint(0, N_SLOTS, (n_tok,), generator=gen).tolist()
    elif mix == "zipf":
        popularity = 1.0 / torch.arange(1, N_SLOTS, dtype=torch.float64) ** 1.2
        seq = torch.multinomial(popularity, n_tok, True, generator=gen).tolist()
    elif mix == "identical":
        seq = [7] * n_tok
    else:  # skewed: 90% one adapter
        spread = torch.randint(0, N_SLOTS - 1, (n_tok,), generator=gen)
        seq = torch.where(torch.rand(n_tok, generator=gen) < 0.9, 7, spread).tolist()
    if n_tok > 2:
        seq[int(torch.randint(0, n_tok, (1,), generator=gen))] = -1
    return sorted(seq)


def _ranks(max_rank: int) -> list[int]:
    cycle = [max_rank, max_rank // 2, 0, max(1, max_rank // 4)]  # 0: a projection the adapter skips
    return [cycle[s % 4] for s in range(N_SLOTS - 1)] + [0]


def _pool(max_rank: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_a [L, R, K], lora_b [L, N, R], zero beyond each slot's rank (the pool's invariant)."""
    a = torch.randn(N_SLOTS, max_rank, K, generator=gen) / K**0.5
    b = torch.randn(N_SLOTS, max_rank, N, generator=gen).mT  # stored rank-major, as the engine's pool
    for s, r in enumerate(_ranks(max_rank)):
        a[s, r:], b[s, :, r:] = 0, 0
    return a, b


def _run(
    ops_mod: ModuleType, op: str, out: Tensor, x: Tensor, y: Tensor, a: Tensor, b: Tensor, meta: LoraMeta,
    **kw: bool | None,
) -> Tensor:
    if op == "shrink":
        ops_mod.sgmv_shrink(out, x, a, meta, 0.5, **kw)
    elif op == "expand_add":
        ops_mod.sgmv_expand(out, y, b, meta, add=True, **kw)
    elif op == "expand_set":
        ops_mod.sgmv_expand(out, y, b, meta, add=False, **kw)
    elif ops_mod is cpu:  # the torch paths (lora_kernels.native has its own tests)
        ops_mod.add_lora(out, x, a, b, meta, native=False, **kw)
    else:
        ops_mod.add_lora(out, x, a, b, meta, **kw)
    return out


@pytest.mark.parametrize("op", ["shrink", "expand_add", "expand_set", "add_lora"])
@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("n_tok", [1, 5, 32])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("path", [True, False, None], ids=["batched", "loop", "policy"])
def test_cpu_paths_match_reference(mix: str, n_tok: int, max_rank: int, op: str, path: bool | None) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mix, n_tok, max_rank, op)).encode()))
    a, b = _pool(max_rank, gen)
    meta = build_lora_meta(torch.tensor(_slots(mix, n_tok, gen)), _ranks(max_rank))
    x, y = torch.randn(n_tok, K, generator=gen), torch.randn(n_tok, max_rank, generator=gen)
    width = max_rank if op == "shrink" else N
    big = torch.randn(n_tok, width + 9, generator=gen)  # out is a strided column slice of it
    want, got = big.clone(), big.clone()
    _run(ref, op, want[:, 4 : 4 + width], x, y, a, b, meta)
    _run(cpu, op, got[:, 4 : 4 + width], x, y, a, b, meta, batched=path)
    torch.testing.assert_close(
        got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"cpu {op} (batched={path}) != reference on {mix}: {m}"
    )


@pytest.mark.parametrize("op", ["shrink", "expand_add", "add_lora"])
def test_identity_layout_writes_in_place(op: str) -> None:
    """Slots lo..lo+T-1, one token each (the distinct-decode step): no index tensors; exact results."""
    gen = torch.Generator().manual_seed(3)
    a, b = _pool(8, gen)
    slots = list(range(5, 37))
    meta = build_lora_meta(torch.tensor(slots), [8] * N_SLOTS)
    sb = slot_batch.slot_batch(meta, torch.device("cpu"))
    assert sb is not None and sb.rows is None and (sb.lo, sb.span, sb.depth) == (5, 32, 1), (
        f"consecutive distinct slots lay out as the batch itself, got {sb}"
    )
    x, y = torch.randn(32, K, generator=gen), torch.randn(32, 8, generator=gen)
    width = 8 if op == "shrink" else N
    want = torch.randn(32, width, generator=gen)
    got = want.clone()
    _run(ref, op, want, x, y, a, b, meta)
    _run(cpu, op, got, x, y, a, b, meta, batched=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"identity layout {op}: {m}")


def test_layout_places_tokens_by_slot() -> None:
    meta = build_lora_meta(torch.tensor([-1, 2, 2, 4, 5, 5, 5, 2]), [8] * 6)
    sb = slot_batch.slot_batch(meta, torch.device("cpu"))
    assert (sb.lo, sb.span, sb.depth, sb.num_tokens) == (2, 4, 3, 7), f"span 2..5, slot 2 has 3 tokens: {sb}"
    assert sb.rows.tolist() == [1, 2, 3, 4, 5, 6, 7], "adapter rows, base row 0 left out"
    assert sb.pos.tolist() == [0, 1, 6, 9, 10, 11, 2], "row k of slot s sits at (s - lo) * depth + k"
    assert sb.row_range == (1, 8), "consecutive adapter rows are written through one slice"
    assert slot_batch.slot_batch(build_lora_meta(torch.tensor([-1, -1]), [8]), "cpu") is None, (
        "a batch without adapter tokens has no layout"
    )


def test_dense_layout_gathers_by_position() -> None:
    """Pool rows 3, 1, 2, 0 for batch rows 1-4 (row 0 a base token): every position of the span is
    filled, so the layout lists the batch row of each position and needs no padding."""
    meta = build_lora_meta(torch.tensor([-1, 3, 1, 2, 0]), [8] * 4)
    sb = slot_batch.slot_batch(meta, torch.device("cpu"))
    assert (sb.lo, sb.span, sb.depth) == (0, 4, 1), f"rows 0..3, one token each: {sb}"
    assert sb.pos is None and sb.rows.tolist() == [4, 2, 3, 1], "position i holds the token of pool row i"
    assert sb.row_range is None, "the rows by position are not a slice of the batch"
    gen = torch.Generator().manual_seed(5)
    a, b = _pool(8, gen)
    x, y = torch.randn(5, K, generator=gen), torch.randn(5, 8, generator=gen)
    for op in ("shrink", "expand_add", "expand_set", "add_lora"):
        want = torch.randn(5, 8 if op == "shrink" else N, generator=gen)
        got = want.clone()
        _run(ref, op, want, x, y, a, b, meta)
        _run(cpu, op, got, x, y, a, b, meta, batched=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, op=op: f"dense {op}: {m}")


def _decode_meta(slots: list[int], ranks: list[int]) -> tuple[LoraMeta, slot_batch.SlotBatch | None]:
    meta = build_lora_meta(torch.tensor(slots), ranks)
    return meta, slot_batch.slot_batch(meta, torch.device("cpu"))


def test_policy_pins_the_path_per_mix() -> None:
    """The measured choice (docs/bench_decode.md): batched for many short segments, else the loop."""
    ranks = [8] * 64
    distinct = _decode_meta(list(range(32)), ranks)
    assert slot_batch.use_slot_batch(*distinct), "32 distinct adapters in one decode batch: batched"
    sparse = _decode_meta([-1] * 8 + list(range(0, 48, 2)), ranks)
    assert slot_batch.use_slot_batch(*sparse), "24 adapters every other slot, some base rows: batched"
    pairs = _decode_meta([i // 2 for i in range(32)], ranks)
    assert slot_batch.use_slot_batch(*pairs), "runs of 2 tokens per adapter: batched"
    fours = _decode_meta([i // 4 for i in range(32)], ranks)
    assert not slot_batch.use_slot_batch(*fours), "runs of 4: the loop's matmuls amortise their calls"
    one = _decode_meta([3] * 32, ranks)
    assert not slot_batch.use_slot_batch(*one), "one adapter: one segment, the loop"
    far = _decode_meta([0, 1, 2, 3, 60, 61, 62, 63], ranks)
    assert not slot_batch.use_slot_batch(*far), "8 adapters spread over 64 slots: too many idle slots read"
    untargeted = _decode_meta(list(range(32)), [8 if s < 3 else 0 for s in range(64)])
    assert not slot_batch.use_slot_batch(*untargeted), "3 of 32 adapters target the projection: the loop"


def test_cpu_engine_defaults_take_the_sgmv_ops() -> None:
    """On CPU the engine's auto decode kernel keeps decode rows on the SGMV ops (the gathered CPU
    BGMV copies every token's weights: measured 0.3-0.7x), where the slot-batched path applies."""
    distinct = list(range(32))
    assert get_lora_ops("auto", "cpu").name == "cpu", "auto picks the cpu ops on a CPU device"
    assert not use_bgmv("auto", distinct, "cpu"), "auto: no gathered BGMV with the cpu ops"
    assert use_bgmv("auto", distinct, "triton"), "auto: BGMV with triton for distinct decode adapters"


def _step_logits(engine: Engine, layer: LoraLayer | None = None) -> tuple[list[Tensor], list[bool]]:
    """Sampled-row logits of every step of a greedy run of 8 distinct adapters (and one base
    request), and whether each step's q_proj LoRA took the slot-batched path."""
    if layer is not None:
        engine.runner.lora = layer
    forward, logits, batched = engine.runner.forward, [], []

    def spy(batch: StepBatch) -> Tensor:
        out = forward(batch)
        logits.append(out[: len(batch.sampled)].clone())
        meta = batch.lora.metas["q_proj"]
        batched.append(slot_batch.use_slot_batch(meta, slot_batch.slot_batch(meta, "cpu")))
        return out

    engine.runner.forward = spy
    prompts = [f"the story number {i} begins" for i in range(9)]
    engine.generate(prompts, [f"a{i}" for i in range(8)] + [None],
                    SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))  # fmt: skip
    return logits, batched


def test_engine_batched_decode_gives_the_loop_logits(make_engine) -> None:
    """The engine's default (decode steps of distinct adapters through the native kernel), the same
    without it (`lora_cpu_native: false`: slot-batched torch ops) and the same engine whose CPU ops
    always loop over segments: the same logits at every step."""
    def engine(**kw: bool) -> Engine:
        return make_engine(max_loras=10, max_lora_rank=32, max_num_seqs=16, device="cpu", **kw)  # fmt: skip

    default, took = _step_logits(engine())
    assert native.loaded(), f"the engine built the native kernel: {native.load_error()}"
    torch_ops, _ = _step_logits(engine(lora_cpu_native=False))
    loop_engine = engine()
    splits = fused_splits(loop_engine.model.dims)
    ops = loop_engine.runner.ops
    loop_ops = dataclasses.replace(
        ops, sgmv_shrink=functools.partial(cpu.sgmv_shrink, batched=False),
        sgmv_expand=functools.partial(cpu.sgmv_expand, batched=False),
        add_lora=functools.partial(cpu.add_lora, batched=False),
    )  # fmt: skip
    loop, _ = _step_logits(loop_engine, LoraLayer(loop_engine.pool, loop_ops, splits, fused=False))
    assert took[0] is False and all(took[1:]), f"prefill: the loop; decode steps: batched, got {took}"
    assert len(default) == len(loop), "the same steps ran"
    for i, (a, b, c) in enumerate(zip(default, loop, torch_ops, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"native, step {i}: {m}")
        torch.testing.assert_close(c, b, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"batched, step {i}: {m}")


def test_policy_counts_the_segments_of_the_op() -> None:
    """An op that 13 of 32 distinct adapters target (the demo zoo's gate/up) is still batched: runs
    are counted over the segments it computes, not over every adapter token of the batch."""
    ranks = [8 if s % 5 in (2, 4) or s == 0 else 0 for s in range(32)]
    meta, sb = _decode_meta(list(range(32)), ranks)
    assert sum(1 for r in ranks if r) == 13, "13 of 32 slots target the op"
    assert slot_batch.use_slot_batch(meta, sb), "13 runs of one token over a span of 32 slots: batched"


def test_fused_shrink_default_follows_the_ops() -> None:
    """Measured on CPU (docs/bench_decode.md): whole runs 3-5% faster unfused (decode steps equal);
    with Triton the fused shrink saves launches. The default picks per ops; a setting wins."""
    config = EngineConfig(model="demo")
    assert config.lora_fused_shrink is None, "no fixed default: chosen by the ops"
    assert fused_shrink(None, "cpu") is False, "CPU ops: one shrink per projection"
    assert fused_shrink(None, "triton") is True, "Triton: one shrink for q/k/v and one for gate/up"
    assert fused_shrink(True, "cpu") is True, "an explicit setting is kept"
    assert fused_shrink(False, "triton") is False, "an explicit setting is kept"
    assert config.lora_decode_kernel == "auto", "the decode path is chosen per device and mix"


def test_cpu_engine_runs_unfused_by_default(make_engine) -> None:
    engine = make_engine(max_loras=2, device="cpu")  # a CPU engine also on a machine with a GPU
    assert engine.runner.ops.name == "cpu", "a CPU engine uses the cpu ops"
    assert engine.runner.lora.groups == {}, "a CPU engine's LoRA layer runs one shrink per projection"


@pytest.fixture(scope="module")
def native_kernel() -> None:
    assert native.load(), f"the native CPU LoRA kernel builds here (g++ and ninja): {native.load_error()}"


@pytest.mark.parametrize("max_rank", [7, 8, 16])  # 7: ranks 7, 3, 1, rows past the kernel's blocks of 4
@pytest.mark.parametrize("n_tok", [1, 5, 32])
@pytest.mark.parametrize("mix", MIXES)
def test_native_add_lora_matches_reference(native_kernel: None, mix: str, n_tok: int, max_rank: int) -> None:
    """lora_kernels.native.add_lora against the reference, `out` a strided column slice, both straight
    and through the cpu ops' policy (which hands it decode-like batches)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("native", mix, n_tok, max_rank)).encode()))
    a, b = _pool(max_rank, gen)
    meta = build_lora_meta(torch.tensor(_slots(mix, n_tok, gen)), _ranks(max_rank))
    x = torch.randn(n_tok, K, generator=gen)
    big = torch.randn(n_tok, N + 9, generator=gen)
    want, got, via_cpu = big.clone(), big.clone(), big.clone()
    ref.add_lora(want[:, 4 : 4 + N], x, a, b, meta)
    native.add_lora(got[:, 4 : 4 + N], x, a, b, meta)
    cpu.add_lora(via_cpu[:, 4 : 4 + N], x, a, b, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"native on {mix}: {m}")
    torch.testing.assert_close(via_cpu, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"cpu ops on {mix}: {m}")


def test_native_kernel_takes_float32_with_unit_last_stride_only(native_kernel: None) -> None:
    """Other tensors stay on the torch paths (same results); the kernel itself refuses them."""
    gen = torch.Generator().manual_seed(9)
    a, b = _pool(8, gen)
    meta = build_lora_meta(torch.tensor(list(range(32))), _ranks(8))
    x = torch.randn(32, K, generator=gen)
    assert native.supports(torch.zeros(32, N), x, a, b), "float32, unit last strides: taken"
    assert not native.supports(torch.zeros(32, N, dtype=torch.bfloat16), x.bfloat16(), a.bfloat16(),
                               b.bfloat16()), "bfloat16: the torch ops"  # fmt: skip
    assert not native.supports(torch.zeros(N, 32).T, x, a, b), "a transposed out: the torch ops"
    want, got = torch.zeros(N, 32).T, torch.zeros(N, 32).T
    ref.add_lora(want, x, a, b, meta)
    cpu.add_lora(got, x, a, b, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"transposed out: {m}")
    with pytest.raises(RuntimeError, match="unit last stride"):
        native.add_lora(torch.zeros(N, 32).T, x, a, b, meta)


def test_native_kernel_takes_decode_batches_whatever_their_span(native_kernel: None) -> None:
    """It reads no padding, so 8 adapters spread over 64 slots (refused by the slot-batched path)
    still go to it; a prefill-like batch (runs of 16) keeps BLAS."""
    ranks = [8] * 64
    far = build_lora_meta(torch.tensor([0, 1, 2, 3, 60, 61, 62, 63]), ranks)
    assert slot_batch.decode_like(far), "8 one-token segments: decode-like"
    assert not slot_batch.use_slot_batch(far, slot_batch.slot_batch(far, "cpu")), "too sparse for the bmm"
    prefill = build_lora_meta(torch.tensor([i // 16 for i in range(64)]), ranks)
    assert not slot_batch.decode_like(prefill), "4 segments of 16 tokens: the segment loop"


def test_native_kernel_shares_torch_s_openmp_runtime(native_kernel: None) -> None:
    """Built with OpenMP only where torch's own libgomp.so.1 is loaded, so that it brings no second
    runtime into the process; its tokens then split over torch's threads with the same result. Copies
    other wheels vendor under a hashed name (auditwheel's `libgomp-<hash>.so`, e.g. scikit-learn's on
    the GPU machine) are theirs, not a runtime the kernel loads."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps
                if "gomp" in line and not re.search(r"libgomp-[0-9a-f]{8}\.so", line)}
    assert len(runtimes) <= 1, f"one OpenMP runtime in the process at most: {sorted(runtimes)}"
    if runtimes:
        assert native.openmp_flags() == ["-fopenmp"], "torch's libgomp.so.1 is loaded: the kernel uses it"
    gen = torch.Generator().manual_seed(5)
    a, b = _pool(8, gen)
    meta = build_lora_meta(torch.tensor(list(range(N_SLOTS - 1)) * 2), _ranks(8))
    x = torch.randn(2 * (N_SLOTS - 1), K, generator=gen)
    want = torch.zeros(x.shape[0], N)
    ref.add_lora(want, x, a, b, meta)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = torch.zeros_like(want)
            native.add_lora(got, x, a, b, meta)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=n: f"{n} threads: {m}")
    finally:
        torch.set_num_threads(threads)


def test_native_kernel_refuses_malformed_segments(native_kernel: None) -> None:
    """A bad index is a RuntimeError naming the problem, never a write out of bounds."""
    gen = torch.Generator().manual_seed(4)
    a, b = _pool(8, gen)
    meta = build_lora_meta(torch.tensor([0, 1, 2, 3]), _ranks(8))
    x, out = torch.randn(4, K, generator=gen), torch.zeros(4, N)
    far = dataclasses.replace(meta, seg_slot=torch.tensor([0, 1, 2, N_SLOTS]))
    with pytest.raises(RuntimeError, match="outside"):
        native.add_lora(out, x, a, b, far)
    short = dataclasses.replace(meta, seg_indptr=torch.tensor([0, 1, 2, 3, 3]))
    with pytest.raises(RuntimeError, match="do not cover"):
        native.add_lora(out, x, a, b, short)
    crossed = dataclasses.replace(meta, seg_indptr=torch.tensor([0, 3, 1, 2, 4]))
    with pytest.raises(RuntimeError, match="out of order"):
        native.add_lora(out, x, a, b, crossed)
    assert out.abs().sum() == 0, "a refused call writes nothing"



def _refused_inputs() -> list[tuple[str, dict[str, object], str]]:
    """(case, the argument replaced, the message expected) for every input the kernel refuses."""
    gen = torch.Generator().manual_seed(6)
    a, b = _pool(8, gen)
    meta = build_lora_meta(torch.tensor([0, 1, 2, 3]), _ranks(8))
    x, out = torch.randn(4, K, generator=gen), torch.zeros(4, N)
    seg = lambda **kw: dataclasses.replace(meta, **kw)  # noqa: E731
    return [
        ("out bfloat16", {"out": out.bfloat16()}, "out must be a float32 CPU tensor"),
        ("x float64", {"x": x.double()}, "x must be a float32 CPU tensor"),
        ("lora_a bfloat16", {"lora_a": a.bfloat16()}, "lora_a must be a float32 CPU tensor"),
        ("lora_b float16", {"lora_b": b.half()}, "lora_b.mT must be a float32 CPU tensor"),
        ("out on the meta device", {"out": out.to("meta")}, "out must be a float32 CPU tensor"),
        ("out 1-D", {"out": out.flatten()}, "out must be 2-D"),
        ("x 3-D", {"x": x[None]}, "x must be 2-D"),
        ("lora_a 2-D", {"lora_a": a[0]}, "lora_a must be 3-D"),
        ("lora_b 2-D", {"lora_b": b[0]}, "lora_b must be 3-D"),
        ("out transposed", {"out": torch.zeros(N, 4).T}, "out must have a unit last stride"),
        ("x every other column", {"x": torch.zeros(4, 2 * K)[:, ::2]}, "x must have a unit last stride"),
        ("lora_a transposed", {"lora_a": a.mT.contiguous().mT}, "lora_a must have a unit last stride"),
        ("lora_b rank-minor", {"lora_b": b.contiguous()}, "lora_b.mT must have a unit last stride"),
        ("out rows", {"out": torch.zeros(5, N)}, "shapes do not match"),
        ("out columns", {"out": torch.zeros(4, N - 1)}, "shapes do not match"),
        ("x columns", {"x": torch.zeros(4, K + 1)}, "shapes do not match"),
        ("lora_b slots", {"lora_b": b[:-1]}, "shapes do not match"),
        ("lora_b rank", {"lora_b": b[..., :-1]}, "shapes do not match"),
        ("seg_indptr int32", {"meta": seg(seg_indptr=meta.seg_indptr.int())},
         "meta.seg_indptr must be a 1-D int64"),
        ("seg_slot 2-D", {"meta": seg(seg_slot=meta.seg_slot[None])}, "meta.seg_slot must be a 1-D int64"),
        ("seg_rank on the meta device", {"meta": seg(seg_rank=meta.seg_rank.to("meta"))},
         "meta.seg_rank must be a 1-D int64 CPU"),
        ("seg_indptr size", {"meta": seg(seg_indptr=meta.seg_indptr[:-1])}, "one more entry than seg_slot"),
        ("seg_rank size", {"meta": seg(seg_rank=meta.seg_rank[:-1])}, "one more entry than seg_slot"),
        ("seg_indptr from 1", {"meta": seg(seg_indptr=torch.tensor([1, 1, 2, 3, 4]))}, "do not cover"),
        ("seg_indptr past T", {"meta": seg(seg_indptr=torch.tensor([0, 1, 2, 3, 9]))}, "do not cover"),
        ("seg_indptr crossed", {"meta": seg(seg_indptr=torch.tensor([0, 3, 1, 2, 4]))}, "out of order"),
        ("seg_indptr past T inside", {"meta": seg(seg_indptr=torch.tensor([0, 9, 2, 3, 4]))}, "out of order"),
        ("slot L", {"meta": seg(seg_slot=torch.tensor([0, 1, 2, N_SLOTS]))}, f"outside \\[-1, {N_SLOTS}\\)"),
        ("slot -2", {"meta": seg(seg_slot=torch.tensor([0, -2, 2, 3]))}, f"outside \\[-1, {N_SLOTS}\\)"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", [c for c, _, _ in _refused_inputs()])
def test_native_kernel_refuses_each_bad_input_in_python(native_kernel: None, case: str) -> None:
    """Every input the C++ kernel checks is refused before a C++ exception could be thrown (one
    crossing into Python crashed the process where the extension was built by another toolchain):
    a RuntimeError naming the tensor and the limit, raised by native.py (a TORCH_CHECK's message
    would carry the C++ source location, "cpu_native.cpp"), and nothing written."""
    gen = torch.Generator().manual_seed(6)
    a, b = _pool(8, gen)
    args: dict[str, object] = {"out": torch.zeros(4, N), "x": torch.randn(4, K, generator=gen), "lora_a": a,
                               "lora_b": b, "meta": build_lora_meta(torch.tensor([0, 1, 2, 3]), _ranks(8))}
    _, changed, message = next(c for c in _refused_inputs() if c[0] == case)
    args.update(changed)
    before = args["out"].clone() if args["out"].device.type == "cpu" else None
    with pytest.raises(RuntimeError, match=message) as raised:
        native.add_lora(**args)
    assert "cpu_native.cpp" not in str(raised.value), f"{case}: refused in Python, not by a TORCH_CHECK"
    if before is not None:
        assert torch.equal(args["out"], before), f"{case}: a refused call writes nothing"


SECOND_LINE = """
import torch
from lora_kernels import native
assert native.load(), native.load_error()
seg = torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([8])
try:
    out, x, a, b_t = torch.zeros(6, 4).T, torch.zeros(4, 5), torch.zeros(2, 8, 5), torch.zeros(2, 8, 6)
    native._module.add_lora(out, x, a, b_t, *seg)
except RuntimeError as e:
    print("RuntimeError:", str(e).splitlines()[0])
"""


def test_native_kernel_keeps_its_own_checks_as_a_second_line(native_kernel: None) -> None:
    """The extension itself still refuses a transposed `out` (its TORCH_CHECK), should a caller reach
    it without native.add_lora's checks. In a child process: where the extension's toolchain is not
    torch's, the C++ exception crashed the process (the H200 check); that is reported as a skip
    naming the signal (native.add_lora never lets it be thrown), a RuntimeError elsewhere."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, "-c", SECOND_LINE], capture_output=True, text=True, timeout=300,
                           env=env)  # fmt: skip
    if child.returncode < 0:
        pytest.skip(f"the extension's own TORCH_CHECK crashes the process here (signal {-child.returncode}): "
                    f"the toolchain issue that native.add_lora's Python checks keep it from")  # fmt: skip
    assert "RuntimeError: out must be 2-D with unit last stride" in child.stdout, (
        f"the kernel's own check refuses a transposed out: rc {child.returncode}, "
        f"{child.stdout}{child.stderr}")

HOLD_BUILD_LOCK = """
import sys, time
from pathlib import Path
from lora_kernels import native
folder = Path(sys.argv[1])
with native.build_lock(folder, 5.0):
    (folder / "lock").touch()  # torch's lock, as a build under way holds it
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    print("kept" if (folder / "lock").exists() else "removed", flush=True)
    (folder / "lock").unlink(missing_ok=True)
"""


def hold_build_lock(folder: Path, seconds: float) -> subprocess.Popen:
    """Another process that holds the build lock of `folder` for `seconds`, once it printed "held"."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_BUILD_LOCK, str(folder), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held", "the other process took the build lock"
    return holder


def test_the_build_lock_waits_a_bounded_time_for_another_process(tmp_path: Path) -> None:
    holder = hold_build_lock(tmp_path, 30.0)
    try:
        with pytest.raises(TimeoutError, match="BUILD_WAIT_S"), native.build_lock(tmp_path, 0.3):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_leaves_the_build_lock_free(tmp_path: Path) -> None:
    """The operating system releases the lock of a process killed while building."""
    holder = hold_build_lock(tmp_path, 30.0)
    holder.kill()
    holder.wait()
    with native.build_lock(tmp_path, 5.0):
        assert (tmp_path / "lock").exists(), "the killed build left torch's lock behind (the case at hand)"


LOAD = "from lora_kernels import native; print(native.load(), native.load_error())"


def test_native_load_does_not_hang_on_the_lock_of_a_killed_build(native_kernel: None) -> None:
    """A process killed while building leaves torch's lock behind, however recent; a new process
    loads the cached kernel instead of waiting for it forever (a replica that never starts)."""
    lock = native.build_folder() / "lock"
    lock.touch()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
    assert done.stdout.split() == ["True", "None"], f"the kernel loads: {done.stdout} {done.stderr[-500:]}"


def test_native_load_waits_for_a_build_under_way(native_kernel: None) -> None:
    holder = hold_build_lock(native.build_folder(), 2.0)
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
    finally:
        verdict = holder.communicate(timeout=30)[0].strip()
    assert verdict == "kept", "a build under way in another process keeps its lock until it is done"
    assert done.stdout.split() == ["True", "None"], f"then it loads: {done.stdout} {done.stderr[-500:]}"

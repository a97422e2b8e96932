"""Tests of lora_kernels: metadata, reference vs a naive loop, cpu and triton vs the reference.

Triton kernels run on CUDA when available, else on CPU tensors under the Triton interpreter.
Triton decides interpreted vs compiled when its own and our ``@triton.jit`` functions are
decorated, i.e. at import, and reads the flag again lazily while launching; so without CUDA this
module sets ``TRITON_INTERPRET=1`` (unless set) at collection, before anything imports triton, and
leaves it set for the session (on a machine without CUDA, triton can only run interpreted anyway).
If triton was nevertheless imported in compiled mode earlier in the session, the triton tests are
re-run once in a fresh subprocess with the flag set (see ``triton_env``).

The interpreter is slow, so triton uses a reduced grid; the cpu path gets the full grid.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # must precede any import of triton, see the module docstring
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lora_kernels import LoraMeta, LoraOps, build_lora_meta, get_lora_ops, with_slot_ranks
from lora_kernels import reference as ref
from torch import Tensor

MIXES = ("distinct", "uniform", "zipf", "identical", "skewed")
OPS = (
    "bgmv_shrink", "bgmv_expand_add", "bgmv_expand_set",
    "sgmv_shrink", "sgmv_expand_add", "sgmv_expand_set", "add_lora",
)  # fmt: skip
K_IN, N_OUT = 48, 80  # feature sizes that are not multiples of the kernel block sizes
N_SLOTS = 70  # >= 64 so that "distinct" can give every token its own adapter; last slot is empty
SCALE = 0.5  # shrink scale used in the tests


pytestmark = pytest.mark.usefixtures("torch_one_thread")


# ----------------------------------------------------------------------------- case generation


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _partition(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """``parts`` positive integers summing to ``total`` (random cut points)."""
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: parts - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def make_token_slots(mix: str, n_tok: int, order: str, gen: torch.Generator) -> Tensor:
    """[T] int64 slots: sequences (runs) whose adapters follow ``mix``, with some base (-1) sequences."""
    n_seq = (
        n_tok
        if mix == "distinct" or n_tok <= 3
        else int(torch.randint(2, n_tok // 2 + 2, (1,), generator=gen))
    )
    lens = _partition(n_tok, n_seq, gen)
    n_ad = N_SLOTS - 1  # adapters live in slots [0, N_SLOTS - 2]; the last slot is empty (rank 0)
    hot = int(torch.randint(0, n_ad, (1,), generator=gen))
    if mix == "distinct":
        seq = torch.randperm(n_ad, generator=gen)[:n_seq]
    elif mix == "uniform":  # may also hit the empty slot
        seq = torch.randint(0, N_SLOTS, (n_seq,), generator=gen)
    elif mix == "zipf":
        popularity = 1.0 / torch.arange(1, n_ad + 1, dtype=torch.float64) ** 1.2
        seq = torch.randperm(n_ad, generator=gen)[torch.multinomial(popularity, n_seq, True, generator=gen)]
    elif mix == "identical":
        seq = torch.full((n_seq,), hot)
    elif mix == "skewed":
        spread = torch.randint(0, n_ad, (n_seq,), generator=gen)
        seq = torch.where(torch.rand(n_seq, generator=gen) < 0.9, hot, spread)
    else:
        raise AssertionError(mix)
    base = torch.rand(n_seq, generator=gen) < 0.2
    if n_seq >= 2 and not base.any():
        base[int(torch.randint(0, n_seq, (1,), generator=gen))] = True
    if n_seq >= 2 and base.all():
        base[0] = False
    seq = torch.where(base, -1, seq).long()
    if order == "sorted":  # what the engine does: sequences sorted by slot, so runs are long
        perm = torch.argsort(seq, stable=True)
        seq, lens = seq[perm], [lens[i] for i in perm.tolist()]
    return torch.repeat_interleave(seq, torch.tensor(lens))


def slot_ranks(max_rank: int) -> list[int]:
    """Mixed adapter ranks <= max_rank per slot; the last slot is empty (rank 0)."""
    cycle = [max_rank, max_rank // 2, max_rank // 4, max(1, max_rank // 8), 3]
    return [min(max_rank, cycle[i % len(cycle)]) for i in range(N_SLOTS - 1)] + [0]


@dataclass
class Case:
    x: Tensor  # [T, K]
    y: Tensor  # [T, R]
    lora_a: Tensor  # [L, R, K]
    lora_b: Tensor  # [L, N, R]
    token_slot: Tensor  # [T]
    meta: LoraMeta
    init_shrink: Tensor  # [T, R] garbage initial content of shrink outputs
    init_expand: Tensor  # [T, N] initial content of expand / add_lora outputs


@functools.cache
def make_pool(max_rank: int, k: int, n: int) -> tuple[Tensor, Tensor]:
    """Slot pool (lora_a [L, R, K], lora_b [L, N, R]) with zero padding beyond each slot's rank.

    Cached: tests must not modify it.
    """
    gen = _gen("pool", max_rank, k, n)
    lora_a = torch.randn(N_SLOTS, max_rank, k, generator=gen) / k**0.5
    lora_b = torch.randn(N_SLOTS, n, max_rank, generator=gen) / max_rank**0.5
    for s, r in enumerate(slot_ranks(max_rank)):
        lora_a[s, r:] = 0
        lora_b[s, :, r:] = 0
    return lora_a, lora_b


def make_case(
    mix: str, n_tok: int, max_rank: int, order: str = "random", k: int = K_IN, n: int = N_OUT
) -> Case:
    gen = _gen(mix, n_tok, max_rank, order, k, n)
    ranks = slot_ranks(max_rank)
    lora_a, lora_b = make_pool(max_rank, k, n)
    token_slot = make_token_slots(mix, n_tok, order, gen)
    return Case(
        x=torch.randn(n_tok, k, generator=gen),
        y=torch.randn(n_tok, max_rank, generator=gen),
        lora_a=lora_a,
        lora_b=lora_b,
        token_slot=token_slot,
        meta=build_lora_meta(token_slot, ranks),
        init_shrink=torch.randn(n_tok, max_rank, generator=gen),
        init_expand=torch.randn(n_tok, n, generator=gen),
    )


def to(case: Case, device: torch.device | str, dtype: torch.dtype = torch.float32) -> Case:
    """The case on ``device`` with float tensors in ``dtype`` (meta rebuilt on the device)."""
    ranks = slot_ranks(case.lora_a.shape[1])
    return Case(
        *(t.to(device=device, dtype=dtype) for t in (case.x, case.y, case.lora_a, case.lora_b)),
        token_slot=case.token_slot.to(device),
        meta=build_lora_meta(case.token_slot.to(device), ranks),
        init_shrink=case.init_shrink.to(device=device, dtype=dtype),
        init_expand=case.init_expand.to(device=device, dtype=dtype),
    )


def run_op(ops: LoraOps, op: str, c: Case, out: Tensor | None = None) -> Tensor:
    """Run ``op`` of ``ops`` on a fresh copy of the case's initial output (or on ``out``); return it."""
    if out is None:
        out = (c.init_shrink if op.endswith("shrink") else c.init_expand).clone()
    if op == "bgmv_shrink":
        ops.bgmv_shrink(out, c.x, c.lora_a, c.token_slot, SCALE)
    elif op == "sgmv_shrink":
        ops.sgmv_shrink(out, c.x, c.lora_a, c.meta, SCALE)
    elif op.startswith("bgmv_expand"):
        ops.bgmv_expand(out, c.y[:, : c.lora_b.shape[2]], c.lora_b, c.token_slot, add=op.endswith("add"))
    elif op.startswith("sgmv_expand"):
        ops.sgmv_expand(out, c.y, c.lora_b, c.meta, add=op.endswith("add"))
    elif op == "add_lora":
        ops.add_lora(out, c.x, c.lora_a, c.lora_b, c.meta)
    else:
        raise AssertionError(op)
    return out


REF = get_lora_ops("reference")
CPU = get_lora_ops("cpu")


def check_against_reference(ops: LoraOps, op: str, c: Case, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """``op`` of ``ops`` writes the same ``out`` (dtype and values) as the reference on case ``c``."""
    expected = run_op(REF, op, c)
    got = run_op(ops, op, c)
    assert got.dtype == expected.dtype, f"{ops.name} {op} changed out's dtype to {got.dtype}"
    torch.testing.assert_close(
        got.cpu(), expected.cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{ops.name} {op} != reference: {m}"
    )


# ----------------------------------------------------------------------------- metadata


def test_build_lora_meta_hand_written() -> None:
    m = build_lora_meta(torch.tensor([0, 0, 1, 1, 1, -1, 0], dtype=torch.int32), [4, 8])
    assert m.seg_indptr_list == (0, 2, 5, 6, 7), "segment boundaries are the changes of slot"
    assert m.seg_slot_list == (0, 1, -1, 0), "each run of equal slot is one segment, in token order"
    assert m.seg_rank_list == (4, 8, 0, 4), "segments carry their slot's rank, base segments rank 0"
    assert m.seg_len_list == (2, 3, 1, 1), "segment lengths are the run lengths"
    assert m.max_rank == 8, "max_rank is the largest segment rank"
    assert m.max_seg_len == 3, "max_seg_len is the longest run"
    assert m.num_tokens == 7, "num_tokens counts every token, base ones included"
    assert m.num_segments == 4, "num_segments counts base segments too"
    for field in ("token_slot", "seg_indptr", "seg_slot", "seg_rank"):
        assert getattr(m, field).dtype == torch.int64, f"{field} is int64 even for an int32 token_slot"
    assert m.seg_indptr.tolist() == [0, 2, 5, 6, 7], "seg_indptr holds the same values as seg_indptr_list"
    assert m.seg_slot.tolist() == [0, 1, -1, 0], "seg_slot holds the same values as seg_slot_list"
    assert m.seg_rank.tolist() == [4, 8, 0, 4], "seg_rank holds the same values as seg_rank_list"


def test_build_lora_meta_edge_cases() -> None:
    base = build_lora_meta(torch.tensor([-1, -1, -1]), [16])
    assert base.seg_indptr_list == (0, 3), "an all-base batch is one segment over all tokens"
    assert base.seg_slot_list == (-1,), "the all-base segment has slot -1"
    assert base.seg_rank_list == (0,), "the all-base segment has rank 0"
    assert base.max_rank == 0, "an all-base batch has max_rank 0"
    empty = build_lora_meta(torch.zeros(0, dtype=torch.int64), [16])
    assert empty.seg_indptr_list == (0,), "an empty batch has the boundary list (0,)"
    assert empty.seg_slot_list == (), "an empty batch has no segments"
    assert empty.max_rank == 0, "an empty batch has max_rank 0"
    assert empty.max_seg_len == 0, "an empty batch has max_seg_len 0"
    assert empty.seg_indptr.tolist() == [0], "an empty batch's seg_indptr tensor is [0]"
    assert empty.seg_slot.numel() == 0, "an empty batch's seg_slot tensor is empty"
    one = build_lora_meta(torch.tensor([2]), torch.tensor([8, 16, 32]))
    assert one.seg_indptr_list == (0, 1), "a one-token batch is one segment"
    assert one.seg_slot_list == (2,), "the one segment has the token's slot"
    assert one.seg_rank_list == (32,), "slot ranks may be given as a tensor"
    assert one.max_rank == 32, "max_rank is the one segment's rank"
    alternating = build_lora_meta(torch.tensor([1, 0, 1, 0]), [0, 4])
    assert alternating.seg_slot_list == (1, 0, 1, 0), "alternating slots give one segment per token"
    assert alternating.seg_rank_list == (4, 0, 4, 0), "an empty slot (rank 0) keeps rank 0 in its segments"
    assert alternating.max_rank == 4, "max_rank ignores the rank-0 slot"


@pytest.mark.parametrize(
    "token_slot",
    [torch.tensor([0, 3]), torch.tensor([-2, 0]), torch.tensor([[0, 1]])],
    ids=["slot-too-big", "slot-below-minus-one", "not-1d"],
)
def test_build_lora_meta_rejects_bad_input(token_slot: Tensor) -> None:
    with pytest.raises(ValueError, match="token_slot"):
        build_lora_meta(token_slot, [8, 8, 8])


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("order", ["sorted", "random"])
def test_build_lora_meta_segments_are_maximal_runs(mix: str, order: str) -> None:
    ts = make_token_slots(mix, 64, order, _gen("meta", mix, order))
    ranks = slot_ranks(32)
    m = build_lora_meta(ts, ranks)
    lens = torch.tensor(m.seg_len_list)
    assert -1 in ts.tolist(), "the generated batch has base tokens (the case the segments must keep)"
    assert torch.equal(torch.repeat_interleave(torch.tensor(m.seg_slot_list), lens), ts), (
        "the segments' slots repeated by their lengths give back token_slot"
    )
    assert all(a != b for a, b in itertools.pairwise(m.seg_slot_list)), (
        "neighbouring segments have different slots (runs are maximal)"
    )
    assert m.seg_rank_list == tuple(ranks[s] if s >= 0 else 0 for s in m.seg_slot_list), (
        "each segment has its slot's rank, base segments rank 0"
    )
    assert list(m.seg_indptr_list) == [0, *torch.cumsum(lens, 0).tolist()], (
        "seg_indptr is the running sum of the segment lengths"
    )
    assert m.max_rank == max(m.seg_rank_list), "max_rank is the largest segment rank"


# ----------------------------------------------------------------------------- interface


def test_get_lora_ops() -> None:
    assert get_lora_ops().name == "cpu", "the default (auto on cpu) is the cpu implementation"
    assert get_lora_ops("auto", torch.device("cpu")).name == "cpu", "auto on a CPU device picks cpu"
    assert get_lora_ops("reference").add_lora is ref.add_lora, (
        "reference gives the reference module's functions"
    )
    has_triton = importlib.util.find_spec("triton") is not None
    assert get_lora_ops("auto", "cuda").name == ("triton" if has_triton else "cpu"), (
        "auto on a CUDA device picks triton when it is importable, else cpu"
    )
    with pytest.raises(ValueError, match="auto, reference, cpu, triton"):
        get_lora_ops("cuda")


# ----------------------------------------------------------------------------- reference


def test_reference_matches_naive_loop() -> None:
    """The reference against an explicit per-token float64 loop, so that it is itself checked."""
    c = make_case("uniform", 16, 16)
    x, y, a, b = (t.double() for t in (c.x, c.y, c.lora_a, c.lora_b))
    want = {
        "bgmv_shrink": c.init_shrink.double().clone(),
        "bgmv_expand_add": c.init_expand.double().clone(),
        "bgmv_expand_set": c.init_expand.double().clone(),
        "add_lora": c.init_expand.double().clone(),
    }
    for t, s in enumerate(c.token_slot.tolist()):
        if s < 0:
            want["bgmv_shrink"][t] = 0
            continue
        want["bgmv_shrink"][t] = SCALE * (a[s] @ x[t])
        want["bgmv_expand_add"][t] += b[s] @ y[t]
        want["bgmv_expand_set"][t] = b[s] @ y[t]
        want["add_lora"][t] += b[s] @ (a[s] @ x[t])
    assert c.token_slot.lt(0).any(), "the case has base tokens"
    assert c.token_slot.ge(0).any(), "the case has adapter tokens"
    for op, expected in want.items():
        torch.testing.assert_close(
            run_op(REF, op, c).double(), expected, atol=1e-5, rtol=1e-5,
            msg=lambda m, op=op: f"reference {op} != per-token float64 loop: {m}",
        )  # fmt: skip
    for op in ("sgmv_shrink", "sgmv_expand_add", "sgmv_expand_set"):
        torch.testing.assert_close(
            run_op(REF, op, c), run_op(REF, op.replace("sgmv", "bgmv"), c),
            msg=lambda m, op=op: f"reference {op} != its BGMV variant on meta's per-token slots: {m}",
        )  # fmt: skip


# ----------------------------------------------------------------------------- cpu


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("order", ["sorted", "random"])
@pytest.mark.parametrize("max_rank", [8, 16, 32, 64])
@pytest.mark.parametrize("n_tok", [1, 3, 16, 64])
@pytest.mark.parametrize("mix", MIXES)
def test_cpu_matches_reference(mix: str, n_tok: int, max_rank: int, order: str, op: str) -> None:
    check_against_reference(CPU, op, make_case(mix, n_tok, max_rank, order))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mix", ["zipf", "skewed"])
def test_cpu_half_precision(mix: str, dtype: torch.dtype, op: str) -> None:
    c = to(make_case(mix, 64, 32, "sorted"), "cpu", dtype)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    check_against_reference(CPU, op, c, atol=4 * tol, rtol=tol)


def _strided_check(ops: LoraOps, op: str, c: Case, device: torch.device | str) -> None:
    """``out`` (and x, y) as column-slice views of bigger tensors: exact in-place writes only there."""
    shrink = op.endswith("shrink")
    width = c.init_shrink.shape[1] if shrink else c.init_expand.shape[1]
    gen = _gen("big", op, width)
    big = torch.randn(c.x.shape[0], width + 45, generator=gen)
    big[:, 17 : 17 + width] = c.init_shrink if shrink else c.init_expand
    bigx = torch.randn(c.x.shape[0], c.x.shape[1] + 9, generator=gen)
    bigx[:, 5 : 5 + c.x.shape[1]] = c.x
    bigy = torch.randn(c.y.shape[0], c.y.shape[1] + 7, generator=gen)
    bigy[:, 3 : 3 + c.y.shape[1]] = c.y
    results = []
    for impl, dev in ((REF, "cpu"), (ops, device)):
        b, bx, by = big.clone().to(dev), bigx.to(dev), bigy.to(dev)
        cd = to(c, dev)
        cd.x, cd.y = bx[:, 5 : 5 + c.x.shape[1]], by[:, 3 : 3 + c.y.shape[1]]
        out = b[:, 17 : 17 + width]
        assert not out.is_contiguous(), "out is a strided column-slice view"
        assert not cd.x.is_contiguous(), "x is a strided column-slice view"
        run_op(impl, op, cd, out)
        results.append(b.cpu())
    torch.testing.assert_close(
        results[1], results[0], atol=1e-5, rtol=1e-5,
        msg=lambda m: f"{ops.name} {op} into a strided view != reference (whole parent tensor): {m}",
    )  # fmt: skip
    untouched = torch.cat([big[:, :17], big[:, 17 + width :]], dim=1)
    torch.testing.assert_close(
        torch.cat([results[1][:, :17], results[1][:, 17 + width :]], 1), untouched,
        msg=lambda m: f"{ops.name} {op} wrote outside the out view: {m}",
    )  # fmt: skip


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_tok", [3, 16])
def test_cpu_strided_out(n_tok: int, op: str) -> None:
    _strided_check(CPU, op, make_case("zipf", n_tok, 32, "sorted"), "cpu")


@pytest.mark.parametrize("op", ["sgmv_shrink", "sgmv_expand_add", "sgmv_expand_set"])
def test_cpu_engine_sized_rank_buffer(op: str) -> None:
    """Shrink into / expand from a [T, meta.max_rank] buffer narrower than the pool's R."""
    c = make_case("skewed", 16, 64, "sorted")
    c.y, c.init_shrink = c.y[:, : c.meta.max_rank], c.init_shrink[:, : c.meta.max_rank]
    check_against_reference(CPU, op, c)


def test_cpu_all_base_batch() -> None:
    c = make_case("identical", 16, 16)
    c.token_slot = torch.full((16,), -1)
    c.meta = build_lora_meta(c.token_slot, slot_ranks(16))
    out = c.init_expand.clone()
    CPU.add_lora(out, c.x, c.lora_a, c.lora_b, c.meta)
    assert torch.equal(out, c.init_expand), "add_lora leaves out unchanged when no token has an adapter"
    for op in OPS:
        check_against_reference(CPU, op, c)


# ----------------------------------------------------------------------------- triton


def _interpreted_in_process() -> bool:
    """Whether triton (its library and our kernels) was imported in interpreter mode here."""
    import triton.language.standard as tl_standard
    from lora_kernels import triton_ops

    return all(
        type(fn).__name__ == "InterpretedFunction"
        for fn in (tl_standard._sum_combine, triton_ops._bgmv_kernel, triton_ops._sgmv_kernel)
    )


@pytest.fixture(scope="module")
def triton_env() -> tuple[LoraOps, str]:
    """Triton ops and the device to run them on: CUDA, else CPU tensors under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return get_lora_ops("triton"), "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and _interpreted_in_process():
        return get_lora_ops("triton"), "cpu"
    if os.environ.get("LORA_KERNELS_TRITON_CHILD"):
        pytest.fail("triton is not in interpreter mode in the child process")
    # triton was imported in compiled mode before this module: run the triton tests in a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1", "LORA_KERNELS_TRITON_CHILD": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-k", "triton", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        pytest.fail(f"triton tests failed in a TRITON_INTERPRET=1 subprocess:\n{proc.stdout}\n{proc.stderr}")
    pytest.skip("triton was imported in compiled mode earlier; passed in a TRITON_INTERPRET=1 subprocess")


# Reduced grid for the (slow) interpreter: every mix at T = 3, 16, 64, cycling the pool rank and order.
TRITON_GRID = [
    (mix, n_tok, (8, 16, 32, 64)[i % 4], ("random", "sorted")[i % 2])
    for i, (mix, n_tok) in enumerate(itertools.product(MIXES, (3, 16, 64)))
] + [("uniform", 1, 8, "random")]


@pytest.mark.parametrize(("mix", "n_tok", "max_rank", "order"), TRITON_GRID)
def test_triton_matches_reference(
    triton_env: tuple[LoraOps, str], mix: str, n_tok: int, max_rank: int, order: str
) -> None:
    ops, device = triton_env
    c = make_case(mix, n_tok, max_rank, order)
    for op in OPS:
        check_against_reference(ops, op, to(c, device))


@pytest.mark.parametrize("op", OPS)
def test_triton_strided_out_odd_sizes(triton_env: tuple[LoraOps, str], op: str) -> None:
    ops, device = triton_env
    _strided_check(ops, op, make_case("zipf", 16, 32, "sorted", k=37, n=70), device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_triton_half_precision(triton_env: tuple[LoraOps, str], dtype: torch.dtype) -> None:
    ops, device = triton_env
    c = make_case("skewed", 16, 16, "sorted")
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    for op in OPS:
        check_against_reference(ops, op, to(c, device, dtype), atol=4 * tol, rtol=tol)


def test_triton_engine_sized_buffer_and_all_base(triton_env: tuple[LoraOps, str]) -> None:
    ops, device = triton_env
    c = make_case("skewed", 16, 64, "sorted")
    c.y, c.init_shrink = c.y[:, : c.meta.max_rank], c.init_shrink[:, : c.meta.max_rank]
    for op in ("sgmv_shrink", "sgmv_expand_add", "sgmv_expand_set"):
        check_against_reference(ops, op, to(c, device))
    c.token_slot = torch.full((16,), -1)
    c.meta = build_lora_meta(c.token_slot, slot_ranks(64))
    for op in OPS:
        check_against_reference(ops, op, to(c, device))


def test_with_slot_ranks_equals_a_fresh_build() -> None:
    token_slot = torch.tensor([-1, -1, 0, 0, 2, 2, 2, 1, -1, 2])
    meta = build_lora_meta(token_slot, [8, 16, 32])
    other = [0, 4, 12]
    got, want = with_slot_ranks(meta, other), build_lora_meta(token_slot, other)
    assert got.seg_rank_list == want.seg_rank_list, "segment ranks are the new slot ranks"
    assert got.max_rank == 12, "max_rank is recomputed from the new ranks"
    assert want.max_rank == 12, "a fresh build with the new ranks has the same max_rank"
    assert torch.equal(got.seg_rank, want.seg_rank), "the seg_rank tensor holds the new ranks"
    assert got.seg_indptr_list == want.seg_indptr_list, "the segments themselves are unchanged"


# ----------------------------------------------------------------------------- fused shrink (stacked A)

FUSED_N = (N_OUT, 40, 24)  # output widths of the group's members (q/k/v-like: one input, several outputs)


def member_ranks(max_rank: int) -> list[list[int]]:
    """Rank of each member in each slot: the first as slot_ranks, the second half of it and 0 (not
    targeted) in every third slot, the third equal to the first."""
    base = slot_ranks(max_rank)
    second = [0 if s % 3 == 0 else r // 2 for s, r in enumerate(base)]
    return [base, second, list(base)]


@functools.cache
def make_fused_pool(max_rank: int, k: int = K_IN) -> tuple[Tensor, list[Tensor]]:
    """Stacked A [L, R * G, K] stored rank-major ([L, R, G, K], as the engine's pool) and each
    member's B [L, N_j, R], zero beyond each member's rank. Cached: tests must not modify it."""
    gen = _gen("fused", max_rank, k)
    g = len(FUSED_N)
    stacked = torch.randn(N_SLOTS, max_rank, g, k, generator=gen) / k**0.5
    bs = [torch.randn(N_SLOTS, n, max_rank, generator=gen) / max_rank**0.5 for n in FUSED_N]
    for j, ranks in enumerate(member_ranks(max_rank)):
        for s, r in enumerate(ranks):
            stacked[s, r:, j] = 0
            bs[j][s, :, r:] = 0
    return stacked.flatten(1, 2), bs


def run_fused(ops: LoraOps, path: str, x: Tensor, token_slot: Tensor, a_fused: Tensor, bs: list[Tensor],
              outs: list[Tensor], max_rank: int) -> None:  # fmt: skip
    """One shrink over the stacked A of the group, then each member's expand of its column slice."""
    g = len(bs)
    ranks = member_ranks(max_rank)
    fused_ranks = [g * max(r[s] for r in ranks) for s in range(N_SLOTS)]
    meta = build_lora_meta(token_slot, fused_ranks)
    metas = [build_lora_meta(token_slot, r) for r in ranks]
    if meta.max_rank == 0:
        return
    h = torch.empty(x.shape[0], meta.max_rank, dtype=torch.float32, device=x.device)
    if path == "sgmv":
        ops.sgmv_shrink(h, x, a_fused, meta)
    else:
        ops.bgmv_shrink(h, x, a_fused, token_slot)
    for j, (b, out) in enumerate(zip(bs, outs, strict=True)):
        if path == "sgmv":
            ops.sgmv_expand(out, h[:, j::g], b, metas[j], add=True)
        else:
            ops.bgmv_expand(out, h[:, j::g], b, token_slot, add=True)


def check_fused(ops: LoraOps, device: str, mix: str, n_tok: int, max_rank: int, path: str) -> None:
    """The fused group's outputs equal the reference's add_lora of each member on its own A view."""
    gen = _gen("fused-case", mix, n_tok, max_rank)
    token_slot = make_token_slots(mix, n_tok, "sorted", gen)
    x = torch.randn(n_tok, K_IN, generator=gen)
    inits = [torch.randn(n_tok, n, generator=gen) for n in FUSED_N]
    a_fused, bs = make_fused_pool(max_rank)
    a_view = a_fused.view(N_SLOTS, max_rank, len(FUSED_N), K_IN)
    want = [t.clone() for t in inits]
    for j, (b, out) in enumerate(zip(bs, want, strict=True)):
        REF.add_lora(out, x, a_view[:, :, j], b, build_lora_meta(token_slot, member_ranks(max_rank)[j]))
    got = [t.clone().to(device) for t in inits]
    run_fused(ops, path, x.to(device), token_slot.to(device), a_fused.to(device), [b.to(device) for b in bs],
              got, max_rank)  # fmt: skip
    for j in range(len(FUSED_N)):
        torch.testing.assert_close(
            got[j].cpu(), want[j], atol=1e-5, rtol=1e-5,
            msg=lambda m, j=j: f"{ops.name} fused {path} shrink, member {j} != its own add_lora: {m}",
        )  # fmt: skip


@pytest.mark.parametrize("path", ["sgmv", "bgmv"])
@pytest.mark.parametrize("max_rank", [8, 32])
@pytest.mark.parametrize("n_tok", [1, 3, 16, 64])
@pytest.mark.parametrize("mix", MIXES)
def test_cpu_fused_shrink_matches_per_member_reference(
    mix: str, n_tok: int, max_rank: int, path: str
) -> None:
    check_fused(CPU, "cpu", mix, n_tok, max_rank, path)


@pytest.mark.parametrize("path", ["sgmv", "bgmv"])
@pytest.mark.parametrize("mix", MIXES)
def test_reference_fused_shrink_matches_per_member(mix: str, path: str) -> None:
    check_fused(REF, "cpu", mix, 16, 16, path)


FUSED_TRITON_GRID = [(m, (3, 16)[i % 2], (8, 32)[i % 2]) for i, m in enumerate(MIXES)]


@pytest.mark.parametrize(("mix", "n_tok", "max_rank"), FUSED_TRITON_GRID)
@pytest.mark.parametrize("path", ["sgmv", "bgmv"])
def test_triton_fused_shrink_matches_per_member_reference(
    triton_env: tuple[LoraOps, str], mix: str, n_tok: int, max_rank: int, path: str
) -> None:
    ops, device = triton_env
    check_fused(ops, device, mix, n_tok, max_rank, path)

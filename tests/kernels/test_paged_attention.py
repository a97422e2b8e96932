"""Paged decode attention: the torch reference against dense attention, the Triton kernel against the
reference (on CUDA, else on CPU tensors under TRITON_INTERPRET=1, which tests/conftest.py sets)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from lora_kernels.paged_attention import get_paged_attention, paged_decode_attention


def _case(lens: list[int], *, block_size: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A shuffled block pool holding sequences of `lens` tokens, and their dense keys/values."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3  # spare blocks hold garbage that must never be read
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_seq) + 1
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    dense = []
    for d, n in enumerate(lens):
        blocks = [order.pop() for _ in range(per_seq[d])]
        table[d, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n]
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n]
        dense.append((k, v))
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k_cache, v_cache, table, torch.tensor(lens), dense


SHAPES = [  # (lens, block_size, heads, kv_heads, head_dim)
    ([1, 5, 16, 17, 40], 16, 4, 2, 16),
    ([3], 4, 2, 2, 8),
    ([33, 7, 64], 8, 6, 2, 24),  # head_dim not a power of two
    ([9, 12], 16, 8, 1, 32),  # multi-query
]


@pytest.mark.parametrize(("lens", "block_size", "heads", "kv_heads", "head_dim"), SHAPES)
def test_reference_equals_dense_attention(lens, block_size, heads, kv_heads, head_dim) -> None:
    q, kc, vc, table, seq_lens, dense = _case(
        lens, block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim
    )
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    paged_decode_attention(out, q, kc, vc, table, seq_lens, max(lens), scale)
    for d, (k, v) in enumerate(dense):
        want = F.scaled_dot_product_attention(
            q[d][:, None, :], k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[d], want, msg=lambda m, d=d: f"sequence {d}: paged != dense: {m}")


@pytest.fixture(scope="module")
def triton_paged():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and triton not in interpreter mode")
    return get_paged_attention("triton", "cuda"), "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("lens", "block_size", "heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(triton_paged, lens, block_size, heads, kv_heads, head_dim, dtype) -> None:
    fn, device = triton_paged
    q, kc, vc, table, seq_lens, _ = _case(
        lens, block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=1
    )
    scale = head_dim**-0.5
    want = torch.empty_like(q)
    rounded = (t.to(dtype).float() for t in (q, kc, vc))  # the reference sees the same rounded inputs
    paged_decode_attention(want, *rounded, table, seq_lens, max(lens), scale)
    args = [t.to(device=device, dtype=dtype) for t in (q, kc, vc)]
    out = torch.full_like(args[0], float("nan"))
    fn(out, *args, table.to(device), seq_lens.to(device), max(lens), scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype, "the kernel writes out in its own dtype"
    torch.testing.assert_close(
        out.float().cpu(), want, atol=tol, rtol=tol, msg=lambda m: f"triton paged attention != reference: {m}"
    )


def test_get_paged_attention_picks_by_device() -> None:
    assert get_paged_attention("auto", "cpu") is paged_decode_attention, "auto on CPU is the torch path"
    assert get_paged_attention("torch", "cuda") is paged_decode_attention, "torch is forced when asked"
    with pytest.raises(ValueError, match="auto, torch, triton"):
        get_paged_attention("flash", "cpu")


def _dense_windowed(q, k, v, scale, window, softcap):
    """One sequence's dense attention over its last `window` keys (all with 0), scores soft-capped."""
    if window:
        k, v = k[-window:], v[-window:]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


WINDOWED = [(0, 5.0), (4, 0.0), (7, 0.0), (16, 2.0), (100, 0.0)]  # (window, softcap)


@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
def test_reference_windows_and_softcaps(window, softcap) -> None:
    q, kc, vc, table, seq_lens, dense = _case([1, 5, 16, 17, 40], block_size=8, heads=4, kv_heads=2,
                                              head_dim=16)
    out = torch.empty_like(q)
    paged_decode_attention(out, q, kc, vc, table, seq_lens, 40, 0.25, window=window, softcap=softcap)
    for d, (k, v) in enumerate(dense):
        want = _dense_windowed(q[d], k, v, 0.25, window, softcap)
        torch.testing.assert_close(
            out[d], want, msg=lambda m, d=d: f"sequence {d}, window {window}, softcap {softcap}: {m}")


@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
def test_triton_windows_and_softcaps_match_reference(triton_paged, window, softcap) -> None:
    fn, device = triton_paged
    q, kc, vc, table, seq_lens, _ = _case([1, 5, 16, 17, 40], block_size=8, heads=4, kv_heads=2, head_dim=16)
    want = torch.empty_like(q)
    paged_decode_attention(want, q, kc, vc, table, seq_lens, 40, 0.25, window=window, softcap=softcap)
    args = [t.to(device) for t in (q, kc, vc)]
    out = torch.full_like(args[0], float("nan"))
    fn(out, *args, table.to(device), seq_lens.to(device), 40, 0.25, window=window, softcap=softcap)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"window {window}, softcap {softcap}: triton != reference: {m}")

"""The experts of a mixture-of-experts block with per-token LoRA (`lora_kernels.moe_experts`): the
grouped torch path and the Triton kernels equal the one-token-at-a-time reference.

Cases cross expert mixes (every token on the same experts, spread over all, skewed to a few, some
experts never chosen), top-k 1/2/4, batch sizes 1 to 40 and adapter mixes (no LoRA, every token on
an adapter row, a mix of adapter rows and tokens without one). Triton runs on CUDA when available,
else on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported),
in float32 (the interpreter's loads of bfloat16 are cast to float32, as in tests/kernels/test_kernels.py);
bfloat16 is compared on CUDA only.
"""

from __future__ import annotations

import importlib.util
import os
import zlib

import pytest
import torch
import torch.nn.functional as F
from lora_kernels.moe_experts import ExpertLora, get_moe_experts, moe_experts_reference

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EXPERTS, HIDDEN, INTER, ROWS, RANK = 6, 48, 40, 3, 8  # sizes that are not multiples of the blocks
MIXES = ("same", "spread", "skewed", "unused")
LORA_MIXES = ("none", "all", "mixed")


def _triton_runs() -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.util.find_spec("triton") is not None and (CUDA or interpreted)


def _case(mix: str, top_k: int, tokens: int, lora_mix: str, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(zlib.crc32(repr((mix, top_k, tokens, lora_mix)).encode()))
    x = torch.randn(tokens, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5
    if mix == "same":
        ids = torch.arange(top_k).repeat(tokens, 1)
    else:
        pool = {"spread": EXPERTS, "skewed": top_k + 1, "unused": EXPERTS - 2}[mix]
        ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    lora = None
    if lora_mix != "none":
        rows = torch.randint(0, ROWS, (tokens,), generator=g)
        if lora_mix == "mixed":
            rows[torch.rand(tokens, generator=g) < 0.4] = -1
        ranks = [RANK, 4, 2]  # an adapter row of a smaller rank: its extra rank rows/columns are zero
        a_gu = torch.randn(ROWS, EXPERTS, RANK, HIDDEN, generator=g) * 0.3
        b_gu = torch.randn(ROWS, EXPERTS, 2 * INTER, RANK, generator=g) * 0.3
        a_d = torch.randn(ROWS, EXPERTS, RANK, INTER, generator=g) * 0.3
        b_d = torch.randn(ROWS, EXPERTS, HIDDEN, RANK, generator=g) * 0.3
        for row, r in enumerate(ranks):
            a_gu[row, :, r:], a_d[row, :, r:], b_gu[row, ..., r:], b_d[row, ..., r:] = 0, 0, 0, 0
        lora = ExpertLora(rows, a_gu, b_gu, a_d, b_d, RANK)
    to = lambda t: t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    if lora is not None:
        lora = ExpertLora(to(lora.rows), to(lora.gate_up_a), to(lora.gate_up_b), to(lora.down_a),
                          to(lora.down_b), lora.rank)  # fmt: skip
    return to(x), to(ids), to(weights), to(gate_up), to(down), lora


def _reference(x, ids, weights, gate_up, down, lora) -> torch.Tensor:
    """The reference in float32 on the CPU."""
    f = lambda t: t.float().cpu() if t.is_floating_point() else t.cpu()  # noqa: E731
    lora32 = None if lora is None else ExpertLora(
        f(lora.rows), f(lora.gate_up_a), f(lora.gate_up_b), f(lora.down_a), f(lora.down_b), lora.rank)
    out = torch.empty(x.shape, dtype=torch.float32)
    moe_experts_reference(out, f(x), f(ids), f(weights), f(gate_up), f(down), F.silu, lora32)
    return out


@pytest.mark.parametrize("lora_mix", LORA_MIXES)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(("top_k", "tokens"), [(1, 1), (2, 7), (2, 40), (4, 17)])
def test_torch_experts_equal_the_reference(mix: str, top_k: int, tokens: int, lora_mix: str) -> None:
    x, ids, weights, gate_up, down, lora = _case(mix, top_k, tokens, lora_mix)
    out = torch.empty_like(x)
    get_moe_experts("torch", DEVICE)(out, x, ids, weights, gate_up, down, F.silu, lora)
    ref = _reference(x, ids, weights, gate_up, down, lora)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"torch experts ({mix}, top-{top_k}, {tokens} tokens, LoRA "
                               f"{lora_mix}) equal the reference: {m}")  # fmt: skip


@pytest.mark.skipif(not _triton_runs(), reason="no triton, or no CUDA and not TRITON_INTERPRET=1")
@pytest.mark.parametrize("lora_mix", LORA_MIXES)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize(("top_k", "tokens"), [(1, 1), (2, 7), (2, 40), (4, 17)])
def test_triton_experts_equal_the_reference(mix: str, top_k: int, tokens: int, lora_mix: str) -> None:
    x, ids, weights, gate_up, down, lora = _case(mix, top_k, tokens, lora_mix)
    out = torch.empty_like(x)
    get_moe_experts("triton", DEVICE)(out, x, ids, weights, gate_up, down, F.silu, lora)
    ref = _reference(x, ids, weights, gate_up, down, lora)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"triton experts ({mix}, top-{top_k}, {tokens} tokens, LoRA "
                               f"{lora_mix}) equal the reference: {m}")  # fmt: skip


@pytest.mark.skipif(not (CUDA and _triton_runs()), reason="bfloat16 Triton is compared on CUDA only")
@pytest.mark.parametrize("lora_mix", LORA_MIXES)
def test_triton_experts_in_bfloat16_stay_close_to_the_reference(lora_mix: str) -> None:
    x, ids, weights, gate_up, down, lora = _case("spread", 2, 33, lora_mix, torch.bfloat16)
    out = torch.empty_like(x)
    get_moe_experts("triton", DEVICE)(out, x, ids, weights, gate_up, down, F.silu, lora)
    torch.testing.assert_close(out.float().cpu(), _reference(x, ids, weights, gate_up, down, lora),
                               atol=5e-2, rtol=5e-2, msg=lambda m: f"bf16 triton experts ({lora_mix}): {m}")


def test_an_empty_step_and_the_impl_choice() -> None:
    x, ids, weights, gate_up, down, _ = _case("spread", 2, 1, "none")
    out = torch.full((0, HIDDEN), 7.0, device=DEVICE)
    get_moe_experts("torch", DEVICE)(out, x[:0], ids[:0], weights[:0], gate_up, down, F.silu)
    assert out.shape == (0, HIDDEN), "an empty step writes nothing"
    assert get_moe_experts("auto", "cpu").__name__ == "moe_experts_torch", "auto is torch off CUDA"
    with pytest.raises(ValueError, match="unknown MoE experts impl"):
        get_moe_experts("cuda-graphs", "cpu")

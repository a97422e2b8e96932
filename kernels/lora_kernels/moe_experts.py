"""The experts of a mixture-of-experts block, with per-token LoRA on them: torch, Triton, reference.

Shapes (``T`` tokens, ``K`` choices per token, ``E`` experts, ``H`` hidden, ``I`` expert width,
``N`` adapter rows, ``R`` max rank):

* ``x`` [T, H]; ``ids`` [T, K] int64 in [0, E); ``weights`` [T, K] (float32 or x's dtype);
* ``gate_up`` [E, 2I, H] (gate rows, then up rows); ``down`` [E, H, I]; ``act`` the gate's activation;
* ``lora`` (optional, :class:`ExpertLora`): ``rows`` [T] int64, the adapter row of each token (-1:
  none); ``gate_up_a`` [N, E, R, H], ``gate_up_b`` [N, E, 2I, R], ``down_a`` [N, E, R, I],
  ``down_b`` [N, E, H, R] (any strides), scaling folded into B, rank rows/columns past an
  adapter's own zero; ``rank`` the columns read (the step's largest expert rank, <= R).

Semantics, written into ``out`` [T, H] (``s`` the token's row, ``e`` a chosen expert)::

    g  = gate_up[e] @ x[t]  + gate_up_b[s, e] @ (gate_up_a[s, e] @ x[t])     (LoRA term when s >= 0)
    h  = act(g[:I]) * g[I:]
    y  = down[e] @ h        + down_b[s, e] @ (down_a[s, e] @ h)
    out[t] = sum over the K choices of weights[t, k] * y

Implementations (all "output first, written in place, return None"): ``moe_experts_torch`` (the
engine's path off CUDA) sorts the step's (token, choice) pairs by (expert, adapter row) once, runs
one GEMM per expert that any token chose over its contiguous pairs and one LoRA shrink/expand per
(expert, adapter) group, then sums each token's choices with one ``index_add_``;
``lora_kernels.triton_moe.moe_experts`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1``) runs the
same sorted pairs through a grouped-GEMM kernel and per-pair LoRA kernels; ``moe_experts_reference``
computes one token and choice at a time (tests). :func:`get_moe_experts` picks one like
``get_lora_ops``: ``auto`` is Triton on a CUDA device when triton is importable, else torch.

Invariants: experts no token chose are never computed; a token without an adapter row (or a step
without ``lora``) gets exactly the base experts' result; the result does not depend on how the
tokens are batched or ordered (up to float rounding of the accumulation order).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import Tensor

from .moe_pairs import Activation, ExpertLora, expert_spans, pair_groups, sort_pairs

__all__ = ["ExpertLora", "MoeExpertsFn", "get_moe_experts", "moe_experts_reference", "moe_experts_torch"]

MoeExpertsFn = Callable[..., None]


def moe_experts_torch(out: Tensor, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                      act: Activation, lora: ExpertLora | None = None) -> None:  # fmt: skip
    """The module docstring's semantics, grouped: at most E GEMMs per projection, plus one LoRA
    shrink and expand per (expert, adapter) group of the step."""
    t, k = ids.shape
    inter = down.shape[2]
    order, counts, span = sort_pairs(ids, gate_up.shape[0], lora)
    groups = pair_groups(counts, span)
    tokens = order // k
    xs = x.index_select(0, tokens)
    h = torch.empty(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    experts = expert_spans(groups)
    on = lora is not None and lora.rank > 0
    adapted = [(e, row, s, n) for e, row, s, n in groups if row >= 0] if on else []
    for e, s, n in experts:
        torch.matmul(xs[s : s + n], gate_up[e].t(), out=h[s : s + n])
    for e, row, s, n in adapted:
        r = lora.rank
        h[s : s + n] += (xs[s : s + n] @ lora.gate_up_a[row, e, :r].t()) @ lora.gate_up_b[row, e, :, :r].t()
    hidden = act(h[:, :inter]) * h[:, inter:]
    for e, s, n in experts:
        torch.matmul(hidden[s : s + n], down[e].t(), out=y[s : s + n])
    for e, row, s, n in adapted:
        r = lora.rank
        y[s : s + n] += (hidden[s : s + n] @ lora.down_a[row, e, :r].t()) @ lora.down_b[row, e, :, :r].t()
    scaled = y * weights.reshape(-1).index_select(0, order)[:, None]
    out.zero_()
    out.index_add_(0, tokens, scaled.to(out.dtype))


def moe_experts_reference(out: Tensor, x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                          act: Activation, lora: ExpertLora | None = None) -> None:  # fmt: skip
    """The module docstring's semantics, one token and choice at a time (tests only)."""
    inter = down.shape[2]
    out.zero_()
    for t in range(x.shape[0]):
        row = -1 if lora is None else int(lora.rows[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = gate_up[e] @ x[t]
            if row >= 0:
                g = g + lora.gate_up_b[row, e] @ (lora.gate_up_a[row, e] @ x[t])
            h = act(g[:inter]) * g[inter:]
            y = down[e] @ h
            if row >= 0:
                y = y + lora.down_b[row, e] @ (lora.down_a[row, e] @ h)
            out[t] += (y * weights[t, j]).to(out.dtype)


def get_moe_experts(impl: str, device: torch.device | str) -> MoeExpertsFn:
    """``triton`` for ``auto`` on a CUDA device when triton is importable, else ``torch``;
    ``torch`` / ``triton`` / ``reference`` force one (ValueError for anything else)."""
    if impl not in ("auto", "torch", "triton", "reference"):
        raise ValueError(f"unknown MoE experts impl {impl!r}; valid: auto, torch, triton, reference")
    if impl == "auto":
        cuda = torch.device(device).type == "cuda"
        impl = "triton" if cuda and importlib.util.find_spec("triton") is not None else "torch"
    if impl == "torch":
        return moe_experts_torch
    if impl == "reference":
        return moe_experts_reference
    from .triton_moe import moe_experts

    return moe_experts

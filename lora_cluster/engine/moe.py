"""The mixture-of-experts MLP block: a top-k router and the fused expert computation (Qwen3-MoE, Mixtral).

Routing (`route`), as transformers' routers compute it: router logits `x @ router.T`, a float32
softmax over the experts, the `top_k` largest probabilities and their experts, renormalised to sum
to one when the family says so (`MoeSpec.norm_topk`). The weights stay float32 into the weighted
sum where the family keeps them (`MoeSpec.float32_weights`, Mixtral), else they are cast to the
activations' dtype first (Qwen3-MoE), so bfloat16 follows each family's rounding.

Experts (`moe_experts`, in the kernels' functional style: output first, a plain-torch reference
`moe_experts_reference` beside it): the step's (token, choice) pairs are sorted by expert once, so
each expert runs one gate/up GEMM and one down GEMM over the contiguous rows of its tokens (at most
`num_experts` launches each, whatever the number of tokens), the activation and the routing weights
apply to all rows at once, and one `index_add_` sums each token's choices. Decode and prefill rows
take the same path (the block is per token). A Triton grouped-GEMM path for CUDA is not written:
on CUDA this torch path runs as is.

Invariants: each token's output is the sum over its `top_k` chosen experts of
`weight * down_e(act(gate_e(x)) * up_e(x))`; experts no token chose are never computed; the result
does not depend on how tokens are batched (the same rows give the same sums up to float rounding
of the accumulation order).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_cluster.engine.moe_spec import MoeSpec

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MoeWeights:
    """One layer's MoE weights, in the engine's layout whatever the checkpoint's (per-expert
    `experts.{e}.w1/w3/w2` or `gate_proj/up_proj/down_proj`, or transformers' stacked tensors)."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [experts, hidden, intermediate]


def route(x: torch.Tensor, router: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], router [E, hidden] -> (weights [T, top_k], expert ids [T, top_k] int64).

    Weights are float32 when `spec.float32_weights`, else in x's dtype (see the module docstring)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if spec.float32_weights else weights.to(x.dtype)), ids


def moe_experts(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: Activation) -> None:  # fmt: skip
    """out [T, hidden] = sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]).

    x [T, hidden]; ids [T, K] int64 in [0, E); weights [T, K] (float32 or x's dtype);
    gate_up [E, 2I, hidden]; down [E, hidden, I]; `act` the gate's activation. Grouped by expert:
    one host read of the per-expert counts, then at most E GEMMs per projection."""
    t, k = ids.shape
    inter = down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, tokens)
    h = torch.empty(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    starts = itertools.accumulate(counts, initial=0)  # one more than counts: zip stops at counts
    bounds = [(e, start, n) for e, (start, n) in enumerate(zip(starts, counts, strict=False)) if n]
    for e, start, n in bounds:
        torch.matmul(xs[start : start + n], gate_up[e].t(), out=h[start : start + n])
    hidden = act(h[:, :inter]) * h[:, inter:]
    for e, start, n in bounds:
        torch.matmul(hidden[start : start + n], down[e].t(), out=y[start : start + n])
    scaled = y * weights.reshape(-1).index_select(0, order)[:, None]
    out.zero_()
    out.index_add_(0, tokens, scaled.to(out.dtype))


def moe_experts_reference(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor, act: Activation) -> None:  # fmt: skip
    """`moe_experts`'s semantics in plain torch, one token and choice at a time (tests only)."""
    inter = down.shape[2]
    out.zero_()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            y = down[e] @ (act(h[:inter]) * h[inter:])
            out[t] += (y * weights[t, j]).to(out.dtype)


def moe_block(x: torch.Tensor, weights: MoeWeights, spec: MoeSpec, act: Activation) -> torch.Tensor:
    """The MoE MLP of one layer: x [T, hidden] (normalised) -> [T, hidden]."""
    w, ids = route(x, weights.router, spec)
    out = torch.empty_like(x)
    if x.shape[0]:
        moe_experts(out, x, ids, w, weights.gate_up, weights.down, act)
    return out

"""The mixture-of-experts MLP block: a top-k router and the fused expert computation (Qwen3-MoE, Mixtral).

Routing (`route`), as transformers' routers compute it: router logits `x @ router.T`, a float32
softmax over the experts, the `top_k` largest probabilities and their experts, renormalised to sum
to one when the family says so (`MoeSpec.norm_topk`). The weights stay float32 into the weighted
sum where the family keeps them (`MoeSpec.float32_weights`, Mixtral), else they are cast to the
activations' dtype first (Qwen3-MoE), so bfloat16 follows each family's rounding.

Experts: `lora_kernels.moe_experts` (the kernels' interface: a grouped torch path, a Triton path
for CUDA and a plain-torch reference beside them), with each token's LoRA on the experts when the
step has any (`ExpertLora`: per token its adapter row, per chosen expert that row's delta). The
runner picks the implementation with its LoRA ops: Triton on CUDA, torch elsewhere.

Invariants: each token's output is the sum over its `top_k` chosen experts of
`weight * down_e(act(gate_e(x)) * up_e(x))`; experts no token chose are never computed; the result
does not depend on how tokens are batched (the same rows give the same sums up to float rounding
of the accumulation order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lora_kernels.moe_experts import ExpertLora, MoeExpertsFn

from lora_cluster.engine.model.moe_spec import MoeSpec

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


def moe_block(x: torch.Tensor, weights: MoeWeights, spec: MoeSpec, act: Activation, experts: MoeExpertsFn,
              lora: ExpertLora | None = None) -> torch.Tensor:  # fmt: skip
    """The MoE MLP of one layer: x [T, hidden] (normalised) -> [T, hidden], its experts run by
    `experts` (a `lora_kernels.moe_experts` implementation) with the step's expert LoRA, if any."""
    w, ids = route(x, weights.router, spec)
    out = torch.empty_like(x)
    if x.shape[0]:
        experts(out, x, ids, w, weights.gate_up, weights.down, act, lora)
    return out

"""The mixture-of-experts part of a family's spec, read from its config (Qwen3-MoE, Mixtral).

`MoeSpec` says what `engine.model.moe` runs in place of a layer's gated MLP; `read_moe` builds it from a
config and refuses, at start, what that block does not run: dense layers among the sparse ones
(`mlp_only_layers`, `decoder_sparse_step`), shared (always-on) experts, a top-k outside
1..experts. Plain Python (no torch), like `engine.model.family`, which calls it.

Invariants: `1 <= top_k <= num_experts`; `intermediate >= 1` is each expert's width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# config fields of shared (always-on) experts, which the MoE block does not run
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
Refuse = Callable[[Any, str, Any, Any], Exception]  # (config, field, value, allowed) -> the error


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts MLP on every layer (`engine.model.moe`): a linear router over
    `num_experts` gated experts of width `intermediate`, each token taking the `top_k` experts of
    highest softmax probability, weighted by those probabilities (renormalised over the top k when
    `norm_topk`: always for Mixtral, `norm_topk_prob` for Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate: int
    norm_topk: bool
    float32_weights: bool = False  # routing weights stay float32 into the weighted sum (Mixtral)


def read_moe(config: Any, experts_field: str, norm_topk: bool, refuse: Refuse, *,
             float32_weights: bool = False) -> MoeSpec:  # fmt: skip
    """The MoE block of every layer of `config` (its expert count in `experts_field`); `refuse`
    makes the family's error naming a field and value the block cannot honour."""
    experts = getattr(config, experts_field, None)
    if not (isinstance(experts, int) and experts >= 1):
        raise refuse(config, experts_field, experts, "a positive integer")
    top_k = getattr(config, "num_experts_per_tok", None)
    if not (isinstance(top_k, int) and 1 <= top_k <= experts):
        raise refuse(config, "num_experts_per_tok", top_k, f"an integer in 1..{experts}")
    if getattr(config, "mlp_only_layers", None):
        raise refuse(config, "mlp_only_layers", config.mlp_only_layers, "[] (a MoE block on every layer)")
    if getattr(config, "decoder_sparse_step", 1) != 1:
        raise refuse(config, "decoder_sparse_step", config.decoder_sparse_step, "1 (every layer sparse)")
    for name in SHARED_EXPERT_FIELDS:
        if getattr(config, name, None):
            raise refuse(config, name, getattr(config, name), "none (shared experts are not run)")
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoeSpec(experts, top_k, int(width), norm_topk, float32_weights)

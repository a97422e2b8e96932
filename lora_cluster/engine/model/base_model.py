"""A loaded decoder base model: its weights in the engine's layout, its dimensions and its tokenizer.

Invariant: every layer's weights have one layout whatever the checkpoint's (`engine.model.model_loader`
reads them): q/k/v fused as `qkv`, gate/up as `gate_up` (None on a mixture-of-experts layer, whose
router and experts are `moe`), and a norm the family does not have is None. `ModelDims` are the
decoder's sizes as the forward pass and the adapter pool need them; `ModelDims.shapes()` is what an
adapter is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.engine.model.family import FamilySpec
from lora_cluster.engine.model.moe import MoeWeights

__all__ = ["BaseModel", "LayerWeights", "ModelDims", "eos_token_ids", "fused_splits"]


@dataclass
class LayerWeights:
    pre_attn_norm: torch.Tensor | None  # [hidden]; None where the family has no such norm
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, hidden], q/k/v projections fused
    qkv_bias: torch.Tensor | None  # [q_dim + 2 * kv_dim]
    o: torch.Tensor  # [hidden, q_dim]
    o_bias: torch.Tensor | None
    post_attn_norm: torch.Tensor | None  # [hidden], on the attention's output (Gemma, OLMo 2)
    pre_mlp_norm: torch.Tensor | None  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden], gate/up fused; None on a MoE layer
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None  # [hidden, intermediate]; None on a MoE layer
    down_bias: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None = None  # [hidden], on the MLP's output (Gemma, OLMo 2)
    q_norm: torch.Tensor | None = None  # [head_dim] per head, or [q_dim] over all heads (OLMo 2)
    k_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # the MoE MLP, in place of gate_up / down


@dataclass
class ModelDims:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int  # the longest sequence served exactly (longrope: its original context)
    fused_targets: bool = False  # adapters target qkv_proj / gate_up_proj (fused checkpoints)
    moe: bool = False  # the MLP is a mixture of experts: adapters target attention and the experts
    experts: int = 0  # experts per layer (mixture of experts)
    expert_intermediate: int = 0  # each expert's width (mixture of experts)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shapes(self) -> ModelShapes:
        h, i = self.hidden, self.intermediate
        mlp = {} if self.moe else {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        w = self.expert_intermediate
        experts = {"gate_up_proj": (h, 2 * w), "down_proj": (w, h)} if self.moe else {}
        return ModelShapes(
            num_layers=self.num_layers,
            modules={
                "q_proj": (h, self.q_dim),
                "k_proj": (h, self.kv_dim),
                "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h),
                **mlp,
            },
            fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            if self.fused_targets else {},
            experts=self.experts if self.moe else 0,
            expert_modules=experts,
        )


@dataclass
class BaseModel:
    name: str  # as the user gave it (folder or hub id)
    path: Path
    config: PretrainedConfig
    text_config: PretrainedConfig  # the decoder's (`config` itself unless a multimodal checkpoint)
    spec: FamilySpec
    dims: ModelDims
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    tokenizer: object


def fused_splits(dims: ModelDims) -> dict[str, tuple[str, int, int]]:
    """Where each projection's output sits in the fused layout: projection -> (fused tensor key,
    first column, end column) of `qkv` (q, k, v) and `gate_up` (gate, up)."""
    q, kv, inter = dims.q_dim, dims.kv_dim, dims.intermediate
    return {
        "q_proj": ("qkv", 0, q),
        "k_proj": ("qkv", q, q + kv),
        "v_proj": ("qkv", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up", 0, inter),
        "up_proj": ("gate_up", inter, 2 * inter),
    }


def eos_token_ids(model: BaseModel) -> set[int]:
    """The model's end-of-sequence ids: the tokenizer's, the config's and the generation config's."""
    ids = {model.tokenizer.eos_token_id}
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [value])
    return {i for i in ids if i is not None}

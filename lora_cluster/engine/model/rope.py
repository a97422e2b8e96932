"""Rotary position embeddings: the cos/sin tables of a model's rope specs, and their application.

Tables are computed once at start for every position up to the engine's `max_len`, in float32 and
then cast to the model's dtype (so that rotated queries and keys keep it), exactly as transformers
computes them: the default type from the base (`theta`) over the rotating dims; every
other supported type (`family.ROPE_TYPES`) through transformers' own `ROPE_INIT_FUNCTIONS`, with the
spec's `layer_type` for per-layer-type parameters (Gemma 3's local base). The attention factor those
functions return scales cos and sin, as in transformers.

Rotation is rotate-half over the first `rotary_dim` dims of each head; the remaining dims pass
unchanged (partial rotary, as transformers' `apply_rotary_pos_emb` with a narrower cos/sin).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lora_cluster.engine.model.family import RopeSpec

RopeTable = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [max_len, rotary_dim]


def rope_table(config: Any, spec: RopeSpec, max_len: int, device: torch.device,
               dtype: torch.dtype = torch.float32) -> RopeTable:  # fmt: skip
    """cos/sin [max_len, rotary_dim] of every position for one rope spec, in `dtype`."""
    if spec.rope_type == "default":
        dim = spec.rotary_dim
        inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scale = 1.0
    else:
        kwargs = {} if spec.layer_type is None else {"layer_type": spec.layer_type}
        inv_freq, scale = ROPE_INIT_FUNCTIONS[spec.rope_type](config, "cpu", **kwargs)
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rope_tables(config: Any, ropes: dict[str, RopeSpec], max_len: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> dict[str, RopeTable]:  # fmt: skip
    """Every table of a family's rope specs, by key."""
    return {key: rope_table(config, spec, max_len, device, dtype) for key, spec in ropes.items()}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] (rotary_dim <= head_dim, even)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

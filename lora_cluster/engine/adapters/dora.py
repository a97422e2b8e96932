"""DoRA served by the batched LoRA: its magnitude as a per-row, per-output-feature scale.

PEFT's DoRA (peft.tuners.lora.dora, eval mode) adds to a Linear's output `base(x)`:
`(g - 1) * (base(x) - bias) + g * s * B(A(x))`, with `g = m / ||W + s * B @ A||` per output row
(m: the adapter's `lora_magnitude_vector`, W: the base weight, s: the LoRA scaling; the norm is
detached, so it is a constant at inference). `g` depends only on the adapter and the base weights,
so it is computed once when an adapter is copied into its slot (`row_scale`): `g` is folded into
B's rows (the LoRA kernels then add `g * s * B(A(x))` unchanged) and `g - 1` is stored per slot,
layer and output feature (`AdapterPool.dora`), which the LoRA layer multiplies into each DoRA row's
bias-free base output. A plain LoRA slot stores zeros there, so rows of plain adapters and base rows
in the same batch are unchanged, bit for bit. A fused checkpoint projection (Phi-3's `qkv_proj`)
is split by output rows, and a row's norm is the same row's in the member, so members compute
their own `g`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def row_scale(weight: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor,
              magnitude: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DoRA's `g = m / ||W + s * B @ A||_row` [out] in float32 (`b_scaled` is s * B, [out, r])."""
    w = weight.float()
    merged = w + b_scaled.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
    return magnitude.to(w.device, torch.float32) / torch.linalg.norm(merged, dim=1)


def projection_weights(layers: list, dims) -> Callable[[int, str], torch.Tensor]:
    """The base weight [out, in] of (layer, projection) read from the engine's fused layer weights
    (`model_loader.LayerWeights`: q/k/v in `qkv`, gate/up in `gate_up`), for `row_scale`."""
    q, kv, inter = dims.q_dim, dims.kv_dim, dims.intermediate
    where = {
        "q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv), "v_proj": ("qkv", q + kv, q + 2 * kv),
        "o_proj": ("o", 0, None), "gate_proj": ("gate_up", 0, inter),
        "up_proj": ("gate_up", inter, 2 * inter), "down_proj": ("down", 0, None),
    }  # fmt: skip

    def weight(layer: int, module: str) -> torch.Tensor:
        attr, lo, hi = where[module]
        return getattr(layers[layer], attr)[lo:hi]

    return weight

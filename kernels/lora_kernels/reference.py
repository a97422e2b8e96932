"""Reference LoRA ops: plain torch gather + einsum, computed in float32. Obviously correct, slow.

Shapes (T tokens, L slots, R max rank, ``K`` in_features, ``N`` out_features):

* ``x``: [T, K]; ``lora_a``: [L, R, K]; ``lora_b``: [L, N, R]; ``token_slot``: [T], -1 = base.
* shrink ``out``: [T, R_out] with ``R_out <= R`` (only the first ``R_out`` rank rows are used);
  expand ``y``: [T, R_in] with ``R_in <= R`` (only the first ``R_in`` rank columns are used).

Semantics (``s`` = slot of token ``t``):

* shrink: ``out[t] = scale * x[t] @ lora_a[s, :R_out].T``; rows of base tokens (s = -1) are set to 0.
* expand: ``out[t] (+)= y[t] @ lora_b[s, :, :R_in].T`` for s >= 0; rows of base tokens are left
  untouched, with ``add=True`` and with ``add=False`` alike.
* add_lora: ``out[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T`` for s >= 0; base rows untouched.

The reference uses the full padded rank and ignores ``meta.seg_rank``: with the pool's zero padding
beyond each adapter's rank the results are identical. The SGMV variants expand the segments of
``meta`` back to a per-token slot vector, so comparing them with the BGMV variants on ``token_slot``
(as the tests do) also checks the metadata.
All functions write ``out`` in place (it may be a strided view) and return None.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .meta import LoraMeta

__all__ = ["add_lora", "bgmv_expand", "bgmv_shrink", "sgmv_expand", "sgmv_shrink"]


def _shrink_f32(x: Tensor, lora_a: Tensor, slots: Tensor, r_out: int) -> Tensor:
    """[T, r_out] float32 ``x[t] @ lora_a[s, :r_out].T``, zero rows for base tokens."""
    a = lora_a[slots.clamp(min=0), :r_out].float()  # [T, r_out, K]
    h = torch.einsum("tk,trk->tr", x.float(), a)
    return h * (slots >= 0).unsqueeze(1)


def _expand_into(out: Tensor, y32: Tensor, lora_b: Tensor, slots: Tensor, add: bool) -> None:
    """Write ``(out +) y32 @ lora_b[s, :, :R_in].T`` into the rows of ``out`` with s >= 0."""
    b = lora_b[slots.clamp(min=0), :, : y32.shape[1]].float()  # [T, N, R_in]
    delta = torch.einsum("tr,tnr->tn", y32, b)
    new = out.float() + delta if add else delta
    mask = slots >= 0
    out[mask] = new[mask].to(out.dtype)


def bgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, token_slot: Tensor, scale: float = 1.0) -> None:
    """out[T, R_out] = scale * x[T, K] @ lora_a[slot, :R_out].T per token; base rows = 0."""
    out.copy_(_shrink_f32(x, lora_a, token_slot.long(), out.shape[1]) * scale)


def bgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, token_slot: Tensor, add: bool = True) -> None:
    """out[T, N] (+)= y[T, R_in] @ lora_b[slot, :, :R_in].T per token; base rows untouched."""
    _expand_into(out, y.float(), lora_b, token_slot.long(), add)


def sgmv_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta, scale: float = 1.0) -> None:
    """Segmented shrink; same result as :func:`bgmv_shrink` with ``meta``'s per-token slots."""
    out.copy_(_shrink_f32(x, lora_a, meta.token_slot, out.shape[1]) * scale)


def sgmv_expand(out: Tensor, y: Tensor, lora_b: Tensor, meta: LoraMeta, add: bool = True) -> None:
    """Segmented expand; same result as :func:`bgmv_expand` with ``meta``'s per-token slots."""
    _expand_into(out, y.float(), lora_b, meta.token_slot, add)


def add_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoraMeta) -> None:
    """out[T, N] += (x @ lora_a[s].T) @ lora_b[s].T per token with s >= 0 (fp32 intermediate)."""
    slots = meta.token_slot
    h = _shrink_f32(x, lora_a, slots, lora_a.shape[1])
    _expand_into(out, h, lora_b, slots, add=True)

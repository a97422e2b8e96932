"""lora_kernels: batched LoRA for heterogeneous batches (many adapters in one forward pass).

Punica / S-LoRA style. The engine's adapter pool holds, for every LoRA-wrapped linear layer (one
projection of one decoder layer), a pair of slot tensors allocated once (``L`` = max_loras slots,
``R`` = max_lora_rank, ``K`` = in_features, ``N`` = out_features):

* ``lora_a``: [L, R, K]; rows ``>= rank`` of a slot holding a rank-``rank`` adapter are zero.
* ``lora_b``: [L, N, R]; scaling (alpha/r or alpha/sqrt(r)) folded in; columns ``>= rank`` zero.

A batch of ``T`` tokens gives each token a slot (``token_slot`` [T] int64, ``-1`` = base model
only, no LoRA). :func:`build_lora_meta` turns it into a :class:`LoraMeta` whose segments are the
maximal runs of equal slot (the engine sorts sequences by slot so runs are long).

:func:`get_lora_ops` returns a :class:`LoraOps` of five functions, all "output first, written in
place, return None"; ``out`` may be a strided view such as ``fused[:, 128:256]``:

* ``bgmv_shrink(out[T, R_out], x[T, K], lora_a, token_slot, scale=1.0)``:
  ``out[t] = scale * x[t] @ lora_a[s, :R_out].T``; base rows set to 0.
* ``bgmv_expand(out[T, N], y[T, R_in], lora_b, token_slot, add=True)``:
  ``out[t] (+)= y[t] @ lora_b[s, :, :R_in].T`` for s >= 0; base rows untouched (also if add=False).
* ``sgmv_shrink(out, x, lora_a, meta, scale=1.0)`` / ``sgmv_expand(out, y, lora_b, meta, add=True)``:
  the same, with the slots taken from ``meta``'s segments (one dense matmul per segment).
* ``add_lora(out[T, N], x[T, K], lora_a, lora_b, meta)``:
  ``out[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T`` for s >= 0; base rows untouched.

The engine's LoRA layer (``lora_cluster.engine.model.lora_layer``) calls ``add_lora`` for unfused
projections, ``sgmv_shrink`` over a stacked A plus one ``sgmv_expand`` per member for the fused
q/k/v and gate/up groups (``out`` and ``y`` then strided column slices), and the BGMV functions for
the decode rows of a step when it takes the gathered path (Triton; see ``use_bgmv`` there).
``paged_attention`` / ``triton_paged``: decode attention over the engine's paged KV cache.
``moe_experts`` (``get_moe_experts``; Triton: ``triton_moe``): the experts of a mixture-of-experts
block with per-token LoRA on them.

Implementations: ``reference`` (plain torch, float32, slow), ``cpu`` (per-segment BLAS, or one
``bmm`` over the pool's slots in place for many short segments, see ``slot_batch``, whose
``add_lora`` batches go to the C++ kernel of ``native`` once it is built; BGMV as batched matmuls
over gathered weights), ``triton`` (GPU kernels; CPU tensors only under
``TRITON_INTERPRET=1``). ``auto`` picks triton on a CUDA device when triton is importable, else cpu.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .meta import LoraMeta, build_lora_meta, with_slot_ranks

__all__ = ["IMPLS", "LoraMeta", "LoraOps", "build_lora_meta", "get_lora_ops", "with_slot_ranks"]

IMPLS = ("auto", "reference", "cpu", "triton")
_MODULES = {"reference": ".reference", "cpu": ".cpu", "triton": ".triton_ops"}


@dataclass(frozen=True)
class LoraOps:
    """The five LoRA functions of one implementation (see the module docstring for semantics)."""

    name: str
    bgmv_shrink: Callable[..., None]
    bgmv_expand: Callable[..., None]
    sgmv_shrink: Callable[..., None]
    sgmv_expand: Callable[..., None]
    add_lora: Callable[..., None]


def get_lora_ops(impl: str = "auto", device: torch.device | str = "cpu") -> LoraOps:
    """Return the :class:`LoraOps` of ``impl`` (one of ``IMPLS``) for tensors on ``device``.

    ``auto`` is ``triton`` on a CUDA device when triton is importable, else ``cpu``.
    Raises ValueError for an unknown ``impl``; ImportError for ``triton`` without triton installed.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown LoRA ops impl {impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        cuda = torch.device(device).type == "cuda"
        impl = "triton" if cuda and importlib.util.find_spec("triton") is not None else "cpu"
    mod = importlib.import_module(_MODULES[impl], __name__)
    return LoraOps(
        name=impl,
        bgmv_shrink=mod.bgmv_shrink,
        bgmv_expand=mod.bgmv_expand,
        sgmv_shrink=mod.sgmv_shrink,
        sgmv_expand=mod.sgmv_expand,
        add_lora=mod.add_lora,
    )

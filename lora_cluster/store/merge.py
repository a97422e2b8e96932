"""Merged adapters: one LoRA adapter made per request from several, in LoRAX's `merged_adapters` schema.

A merge names adapters `ids` with `weights`, a `merge_strategy`, a `density` and a
`majority_sign_method` (`MergeSpec`). Every strategy works one (layer, projection) at a time, over
the adapters that target it, with each adapter's LoRA scaling `s_i` (alpha / r) folded in; the
merged adapter's own scaling is 1. The strategies follow PEFT's `add_weighted_adapter`
(peft/tuners/lora/model.py and peft/utils/merge_utils.py), which the tests check token for token:

- `linear`: the exact weighted sum of the adapters' deltas, `sum_i w_i * s_i * B_i A_i`, as a LoRA of
  rank `sum_i r_i`: A stacks the rows `w_i * s_i * A_i`, B the columns `B_i` (PEFT's
  `combination_type="cat"`). The merged rank may exceed `max_lora_rank`; such a merge is refused.
- `ties` (TIES-merging): A and B are merged separately. Each adapter's matrix keeps its `density`
  fraction of entries of largest magnitude (the rest set to 0); a sign is elected per entry (the sign
  of the sum of the kept values, `total`, or of the count of their signs, `frequency`); the kept
  entries that agree with it are weighted (A by `sign(w_i s_i) sqrt|w_i s_i|`, B by `sqrt|w_i s_i|`)
  and averaged over the adapters that contributed an entry there.
- `dare_linear` (DARE): A and B are merged separately: each matrix keeps each entry with probability
  `density` and is divided by `density` (random pruning with rescale), then the weighted matrices
  (weights as for ties) are summed.
- `dare_ties`: DARE's random pruning, then TIES' sign election and disjoint mean.

`ties` and `dare_*` need every adapter targeting a projection to have the same rank there (PEFT:
"All adapters must have the same r value"); the merged rank is that rank. DARE's random masks come
from a generator seeded with `EngineConfig.merge_seed`, drawn in PEFT's order (layer by layer,
projections in the model's order, A then B, adapters in request order), so a merge is deterministic
and equal to PEFT's after `torch.manual_seed(merge_seed)`. A merge of one adapter is its weighted
delta whatever the strategy (PEFT switches to linear then).

A merged adapter's id is `merged/<hash of its spec>`: requests for the same merge share it (routing
affinity, the device slot and the host tier); what it is cached under also counts the versions of
its adapters (see `store.merged`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lora_cluster.adapter_experts import expert_unit
from lora_cluster.adapter_format import LoraWeights
from lora_cluster.errors import AdapterMergeError
from lora_cluster.request.merge_spec import MergeSpec


def merge(spec: MergeSpec, adapters: Sequence[LoraWeights], module_order: Sequence[str], *, adapter_id: str,
          max_rank: int, seed: int) -> LoraWeights:
    """The merged adapter of `adapters` (one per `spec.ids`, same order), named `adapter_id`.
    `module_order` is the model's projection order (PEFT's merge order). Raises AdapterMergeError
    (ranks that differ for ties/dare, a merged rank above `max_rank`)."""
    dora = [w.adapter_id for w in adapters if w.magnitude]
    if dora:
        raise AdapterMergeError(adapter_id, f"DoRA adapters ({', '.join(dora)}) cannot be merged: their "
                                "magnitude rescales each one's merged weight, which no LoRA sum reproduces")
    strategy = "linear" if len(adapters) == 1 else spec.strategy
    generator = torch.Generator().manual_seed(seed)
    order = {m: i for i, m in enumerate(module_order)}
    # LoRA on a mixture of experts' experts (per-expert modules) comes after the model's projections
    keys = sorted({k for w in adapters for k in w.a}, key=lambda k: (k[0], order.get(k[1], len(order)), k[1]))
    if strategy != "linear" and any(expert_unit(m) for _, m in keys):
        raise AdapterMergeError(adapter_id, f"a {strategy} merge of LoRA on a mixture of experts' experts "
                                "is not served (its pruning over PEFT's stacked expert matrices is not "
                                "reproduced per expert); use linear, the exact weighted sum")
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key in keys:
        parts = [(w, weight * w.scaling[key[1]]) for w, weight in zip(adapters, spec.weights, strict=True)
                 if key in w.a]
        if strategy == "linear":
            a[key] = torch.cat([w.a[key] * ws for w, ws in parts], dim=0)
            b[key] = torch.cat([w.b[key] for w, _ in parts], dim=1)
        else:
            ranks = {w.a[key].shape[0] for w, _ in parts}
            if len(ranks) > 1:
                raise AdapterMergeError(adapter_id, f"{strategy} needs equal ranks, but layer {key[0]} "
                                        f"{key[1]} has ranks {sorted(ranks)} (use linear)")
            scale_a = torch.tensor([math.copysign(math.sqrt(abs(ws)), ws) for _, ws in parts])
            scale_b = torch.tensor([math.sqrt(abs(ws)) for _, ws in parts])
            a[key] = _combine(strategy, [w.a[key] for w, _ in parts], scale_a, spec, generator)
            b[key] = _combine(strategy, [w.b[key] for w, _ in parts], scale_b, spec, generator)
        rank = a[key].shape[0]
        if rank > max_rank:
            raise AdapterMergeError(adapter_id, f"merged rank {rank} at layer {key[0]} {key[1]} exceeds "
                                    f"max_lora_rank={max_rank} (linear: the sum of the adapters' ranks)")
    modules = frozenset(m for _, m in a)
    rank = max(t.shape[0] for t in a.values())
    return LoraWeights(adapter_id=adapter_id, rank=rank, target_modules=modules,
                       scaling=dict.fromkeys(modules, 1.0), a=a, b=b)


def _combine(strategy: str, tensors: list[torch.Tensor], weights: torch.Tensor, spec: MergeSpec,
             generator: torch.Generator) -> torch.Tensor:
    """One matrix of a ties / dare_linear / dare_ties merge (PEFT's merge_utils, seeded)."""
    if strategy == "ties":
        pruned = [_magnitude_prune(t, spec.density) for t in tensors]
    else:
        pruned = [_random_prune(t, spec.density, generator) for t in tensors]
    stacked = torch.stack(pruned, dim=0)
    weighted = stacked * weights.view((-1,) + (1,) * (stacked.dim() - 1))
    if strategy == "dare_linear":
        return weighted.sum(dim=0)
    sign = stacked.sign()
    magnitude = stacked.sum(dim=0) if spec.majority_sign_method == "total" else sign.sum(dim=0)
    agree = sign == torch.where(magnitude >= 0, 1, -1)
    return (weighted * agree).sum(dim=0) / torch.clamp(agree.sum(dim=0), min=1.0)


def _magnitude_prune(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the `density` fraction of entries of largest magnitude."""
    if density >= 1:
        return tensor
    mask = torch.zeros_like(tensor).reshape(-1)
    k = int(density * tensor.numel())
    mask[torch.topk(tensor.abs().reshape(-1), k=k, largest=True)[1]] = 1
    return tensor * mask.reshape(tensor.shape)


def _random_prune(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Keep each entry with probability `density`, rescaled by 1 / density."""
    if density >= 1:
        return tensor
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * mask / density

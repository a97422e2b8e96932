"""LoRA on a mixture of experts' experts, as PEFT writes it: split or joined into per-expert pairs.

`adapter_format.parse_lora_tensors` collects an adapter's expert tensors with the patterns below and
hands them here; each function fills the adapter's `a` / `b` maps with one (A [r, in], B [out, r])
pair per expert and projection, under the module name `expert_module(e, param)`, and returns the
LoRA scaling of each (layer, "experts.{param}"). Two layouts are served:
- PEFT 0.21 on transformers 5's stacked experts (`target_parameters` naming `mlp.experts.gate_up_proj`
  / `down_proj`; `target_modules` naming the projections is converted by PEFT to the same form):
  `split_experts`;
- per-expert LoRA as PEFT wrote it before transformers 5 (one nn.Linear per expert): `join_per_expert`,
  the way PEFT 0.21 converts it.
Every refusal names the adapter and what does not fit. Pure functions over tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch

from lora_cluster.errors import AdapterFormatError, AdapterRankError, AdapterShapeError

# PEFT's LoRA on transformers' stacked experts (target_parameters): the outer ParamWrapper's tensors,
# or (one `base_layer.` deeper) the inner one's
STACKED_EXPERTS = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])(?:\.\w+)?\.weight$")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the experts' stacked parameters LoRA may target
# per-expert LoRA as PEFT wrote it before transformers 5 (per-expert nn.Linear): Mixtral's w1/w3/w2
# under block_sparse_moe, Qwen3-MoE's gate_proj/up_proj/down_proj under mlp
PER_EXPERT = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                        r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
PER_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
                   "down_proj": "down"}  # fmt: skip


class ExpertShapes(Protocol):
    """What the experts' LoRA must fit (`adapter_format.ModelShapes` has it)."""

    num_layers: int
    experts: int  # experts per mixture-of-experts layer
    expert_modules: dict[str, tuple[int, int]]  # "gate_up_proj" / "down_proj" -> (in_features, out_features)


Scaling = Callable[[str, int], float]  # (module name as the adapter config names it, rank) -> LoRA scaling


def expert_module(expert: int, param: str) -> str:
    """The module name of expert `expert`'s `param` ("gate_up_proj", "down_proj") in `LoraWeights`."""
    return f"experts.{expert}.{param}"


def expert_unit(module: str) -> str | None:
    """"experts.gate_up_proj" for every expert's "experts.{e}.gate_up_proj" (the pool stores the
    experts of one projection together), None for other modules."""
    if not module.startswith("experts."):
        return None
    parts = module.split(".")
    return f"experts.{parts[2]}" if len(parts) == 3 else None


def split_experts(adapter_id: str, stacked: dict[tuple[int, str, str], torch.Tensor], shapes: ExpertShapes,
                  max_rank: int, module_scaling: Scaling, a: dict, b: dict) -> dict[tuple[int, str], float]:
    """PEFT's LoRA on the stacked experts of each layer (its `ParamWrapper`s: A [E * r, in] with
    expert e's rank rows at e * r, B [out, r * E] with expert e's column j at j * E + e) split into
    per-expert (A [r, in], B [out, r]) pairs in `a` / `b`. Which parameter a wrapper adapts is read
    from its shapes: gate_up_proj is (hidden -> 2 x width), down_proj (width -> hidden), never equal.
    Returns the scaling of each (layer, "experts.{param}")."""
    scaling: dict[tuple[int, str], float] = {}
    by_shape = {shape: p for p, shape in shapes.expert_modules.items()}
    experts = shapes.experts
    for layer, nesting in sorted({(k[0], k[1]) for k in stacked}):
        wa, wb = stacked.get((layer, nesting, "A")), stacked.get((layer, nesting, "B"))
        where = f"layer {layer} mlp.experts{'.' + nesting.rstrip('.') if nesting else ''}"
        if wa is None or wb is None:
            raise AdapterFormatError(adapter_id, f"lora_A and lora_B do not pair up at {where}")
        param = by_shape.get((wa.shape[-1], wb.shape[0])) if wa.dim() == 2 and wb.dim() == 2 else None
        if param is None or wa.shape[0] % experts or wb.shape[1] != wa.shape[0]:
            raise AdapterShapeError(adapter_id, f"{where}: lora_A {tuple(wa.shape)} / lora_B "
                                    f"{tuple(wb.shape)} are not LoRA on the model's {experts} experts "
                                    f"(gate_up_proj {shapes.expert_modules['gate_up_proj']}, down_proj "
                                    f"{shapes.expert_modules['down_proj']} as (in, out))")
        if layer >= shapes.num_layers:
            raise AdapterShapeError(adapter_id, f"layer {layer} >= the model's {shapes.num_layers} layers")
        rank = wa.shape[0] // experts
        if rank > max_rank:
            raise AdapterRankError(adapter_id, rank, max_rank)
        if (layer, expert_module(0, param)) in a:
            raise AdapterFormatError(adapter_id, f"{where}: two LoRA weights on the experts' {param}")
        per_a = wa.float().reshape(experts, rank, -1)
        per_b = wb.float().reshape(wb.shape[0], rank, experts)
        for e in range(experts):
            a[(layer, expert_module(e, param))] = per_a[e].contiguous()
            b[(layer, expert_module(e, param))] = per_b[:, :, e].contiguous()
        scaling[(layer, f"experts.{param}")] = module_scaling(f"mlp.experts.{param}", rank)
    return scaling


def join_per_expert(adapter_id: str, per_expert: dict[tuple[int, int, str], dict[str, object]],
                    shapes: ExpertShapes, module_scaling: Scaling, a: dict,
                    b: dict) -> dict[tuple[int, str], float]:  # fmt: skip
    """Per-expert LoRA as PEFT wrote it before transformers 5 (`experts.{e}.w1/w3/w2` or
    `gate_proj/up_proj/down_proj`), joined as PEFT 0.21 converts it: gate and up become one
    `gate_up_proj` pair of rank r_gate + r_up (A stacked, B block-diagonal: gate rows from the gate's
    B, up rows from the up's), each part's scaling folded into its B (so the pairs' scaling is 1).
    Returns the scaling of each (layer, "experts.{param}")."""
    hidden, width = shapes.expert_modules["down_proj"][1], shapes.expert_modules["down_proj"][0]
    want = {"gate": (hidden, width), "up": (hidden, width), "down": (width, hidden)}  # (in, out)
    parts: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, e, part), entry in per_expert.items():
        wa, wb, name = entry.get("A"), entry.get("B"), entry["name"]
        where = f"layer {layer} experts.{e}.{name}"
        if wa is None or wb is None:
            raise AdapterFormatError(adapter_id, f"lora_A and lora_B do not pair up at {where}")
        if layer >= shapes.num_layers or e >= shapes.experts:
            raise AdapterShapeError(adapter_id, f"{where}: the model has {shapes.num_layers} layers of "
                                    f"{shapes.experts} experts")
        in_f, out_f = want[part]
        fits = wa.dim() == 2 and wb.dim() == 2 and wb.shape[1] == wa.shape[0]
        if not (fits and wa.shape[1] == in_f and wb.shape[0] == out_f):
            raise AdapterShapeError(adapter_id, f"{where}: lora_A {tuple(wa.shape)} / lora_B "
                                    f"{tuple(wb.shape)} do not fit the expert's {name} "
                                    f"(in_features={in_f}, out_features={out_f})")
        scale = module_scaling(f"experts.{e}.{name}", wa.shape[0])
        parts[(layer, e, part)] = (wa.float(), wb.float() * scale)
    scaling: dict[tuple[int, str], float] = {}
    for layer, e in sorted({(k[0], k[1]) for k in parts}):
        gate, up = parts.get((layer, e, "gate")), parts.get((layer, e, "up"))
        if gate is not None or up is not None:
            ranks = [p[0].shape[0] if p is not None else 0 for p in (gate, up)]
            wb = torch.zeros(2 * width, sum(ranks))
            if gate is not None:
                wb[:width, : ranks[0]] = gate[1]
            if up is not None:
                wb[width:, ranks[0] :] = up[1]
            key = (layer, expert_module(e, "gate_up_proj"))
            a[key] = torch.cat([p[0] for p in (gate, up) if p is not None]).contiguous()
            b[key] = wb
            scaling[(layer, "experts.gate_up_proj")] = 1.0
        down = parts.get((layer, e, "down"))
        if down is not None:
            a[(layer, expert_module(e, "down_proj"))], b[(layer, expert_module(e, "down_proj"))] = down
            scaling[(layer, "experts.down_proj")] = 1.0
    return scaling


__all__ = ["EXPERT_PARAMS", "PER_EXPERT", "PER_EXPERT_PART", "STACKED_EXPERTS", "ExpertShapes",
           "expert_module", "expert_unit", "join_per_expert", "split_experts"]

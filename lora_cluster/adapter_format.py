"""PEFT LoRA adapters: parse a local adapter folder into validated host tensors.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors`. Pickle weights
(`adapter_model.bin`) are refused: loading them would execute code from an untrusted file. Every
refusal is an `AdapterError` subclass naming the adapter and the limit or reason, never a path of
the server's file system.

Validation is one set of small steps, in this order: `folder_files`, `weights_file_or_refuse`,
`read_adapter_config` (`read_adapter_file` + `parse_adapter_config`), `check_rank`,
`parse_safetensors_bytes` and `parse_lora_tensors`. `load_peft_adapter` composes them for a plain folder;
`lora_cluster.store.admission.admit_folder` composes the same steps with checksums and decryption.

Policy: an adapter is admitted only if every tensor maps to a (layer, projection) of the served
model with matching shapes, its rank is <= `max_lora_rank`, and its values are finite. On a model
whose checkpoint fuses projections (Phi-3's `qkv_proj`, `gate_up_proj`), PEFT's adapters target the
fused names; such a pair (A [r, in], B [sum of outs, r]) is split exactly into its members'
(A, B rows of that member) pairs, the same delta. DoRA (`use_dora`) is served on the dense
projections: each `lora_magnitude_vector` [out_features] is kept per (layer, module) in
`LoraWeights.magnitude` (split by member rows on a fused projection) and turned into a per-row scale
when copied into a slot (`engine.adapters.dora`); DoRA on anything else (embeddings, experts) is
refused by name. What the engine cannot apply is refused by name: `modules_to_save` (full copies of
base modules), `trainable_token_indices`, LoRA biases. On a
mixture-of-experts model (Qwen3-MoE, Mixtral) LoRA is served on attention and on the experts as
PEFT 0.21 writes it for transformers 5's stacked experts (`target_parameters` naming the experts'
`gate_up_proj` / `down_proj`: A [E * r, in] expert-major, B [out, r * E] rank-major, one
`ParamWrapper` nested in the other, told apart by their shapes), split per expert into
`experts.{e}.gate_up_proj` / `experts.{e}.down_proj` pairs (`adapter_experts`); per-expert tensors as
PEFT wrote them before transformers 5 (`experts.{e}.w1/w3/w2`, `gate_proj/up_proj/down_proj`) are
joined as PEFT 0.21 converts them (gate and up into one `gate_up_proj` pair); LoRA on the router or
on other parameters is refused by name. On a
multimodal checkpoint served as text (Gemma 3), LoRA on the vision tower or projector is not loaded:
text requests never run those modules, in transformers either. The LoRA
scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rslora, per-module `rank_pattern` /
`alpha_pattern` honoured) is kept per module and folded into B only when copied into a slot.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lora_cluster.adapter_experts import (
    EXPERT_PARAMS,
    PER_EXPERT,
    PER_EXPERT_PART,
    STACKED_EXPERTS,
    expert_unit,
    join_per_expert,
    split_experts,
)
from lora_cluster.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterLoadError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
)
from lora_cluster.request.adapter_id import check_adapter_id

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# PEFT key: base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
# PEFT DoRA's magnitude vector of a projection (per output feature)
_MAG_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_magnitude_vector(?:\.\w+)?$")
_MAGNITUDE = re.compile(r"\.lora_magnitude_vector(?:\.\w+)?$")
# a mixture-of-experts block's experts or router (LoRA on them is refused unless
# adapter_experts.STACKED_EXPERTS or PER_EXPERT matches)
_MOE = re.compile(r"\.(?:block_sparse_moe|mlp\.experts|mlp\.gate)\.")
# a multimodal checkpoint's modules that text requests never run (LoRA on them has no effect there)
_NOT_TEXT = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|multi_modal_projector)\.")
@dataclass(frozen=True)
class ModelShapes:
    """What an adapter must fit: layer count and (in_features, out_features) per projection."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # projection name -> (in_features, out_features)
    # a fused checkpoint projection adapters may target -> its members, in output-row order
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    experts: int = 0  # experts per mixture-of-experts layer (0: a dense model)
    # each expert's projection LoRA may target ("gate_up_proj", "down_proj") -> (in_features, out_features)
    expert_modules: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class LoraWeights:
    """One adapter's weights on the host, validated against the served model.

    `a[(layer, module)]` is [r_m, in_features] and `b[(layer, module)]` is [out_features, r_m],
    unscaled; `scaling[module]` multiplies B when it is copied into a device slot.
    """

    adapter_id: str
    rank: int  # largest rank over modules
    target_modules: frozenset[str]
    scaling: dict[str, float]
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    version: int = 0  # the loader's version of the adapter id when these weights were read
    # DoRA: the magnitude vector [out_features] of each (layer, module), empty for plain LoRA
    magnitude: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = (*self.a.values(), *self.b.values(), *self.magnitude.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def module_rank(self, module: str) -> int:
        """Rank of `module` (0 when the adapter does not target it); for "experts.{param}", the
        largest rank over the experts' `param` modules."""
        if module.startswith("experts.") and module.count(".") == 1:
            ranks = [t.shape[0] for (_, m), t in self.a.items() if expert_unit(m) == module]
        else:
            ranks = [t.shape[0] for (_, m), t in self.a.items() if m == module]
        return max(ranks, default=0)


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern: a key matches a module name that ends with it."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module) or key == module:
            return value
    return default


def folder_files(adapter_id: str, folder: Path | str) -> frozenset[str]:
    """The names of the files in the adapter folder `folder` (symlinks to files count, as in the hub
    cache). No folder there is AdapterNotFoundError; an unreadable one AdapterLoadError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFoundError(adapter_id, "no adapter folder")
    try:
        return frozenset(p.name for p in folder.iterdir() if p.is_file())
    except OSError as e:
        raise AdapterLoadError(adapter_id, f"cannot read the adapter folder: {_os_reason(e)}") from e


def read_adapter_file(adapter_id: str, folder: Path, name: str) -> bytes:
    """The bytes of the adapter's file `name`. A missing file is AdapterNotFoundError, an unreadable
    one AdapterLoadError; neither message names the server's path."""
    try:
        return (Path(folder) / name).read_bytes()
    except FileNotFoundError as e:
        raise AdapterNotFoundError(adapter_id, f"no {name} in the adapter folder") from e
    except OSError as e:
        raise AdapterLoadError(adapter_id, f"cannot read {name}: {_os_reason(e)}") from e


def _os_reason(error: OSError) -> str:
    """An OSError's reason without the file name it carries (the server's path stays private)."""
    return error.strerror or type(error).__name__


def parse_adapter_config(adapter_id: str, data: bytes | str) -> dict:
    """Parse and check `adapter_config.json`'s content; raises AdapterFormatError on anything but
    plain LoRA with a positive integer rank `r`."""
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(adapter_id, f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise AdapterFormatError(adapter_id, f"{CONFIG_FILE} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterFormatError(adapter_id, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("modules_to_save"):
        raise AdapterFormatError(adapter_id, f"modules_to_save={config['modules_to_save']!r} is not "
                                 "supported: only LoRA deltas are served over the shared base weights")
    if config.get("trainable_token_indices"):
        raise AdapterFormatError(adapter_id,
                                 "trainable_token_indices is not supported (it changes embeddings)")
    if config.get("lora_bias"):
        raise AdapterFormatError(adapter_id, "lora_bias=true is not supported (only bias-free LoRA)")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(adapter_id, f"bias={config.get('bias')!r} is not supported (only 'none')")
    params = config.get("target_parameters") or []
    other = [p for p in params if not isinstance(p, str) or p.rpartition(".")[2] not in EXPERT_PARAMS
             or p.rpartition(".")[0] not in ("", "experts", "mlp.experts")]  # fmt: skip
    if other:
        raise AdapterFormatError(adapter_id, f"target_parameters {other!r} is not served: LoRA on parameters "
                                 "is served for a mixture of experts' mlp.experts.gate_up_proj and "
                                 "mlp.experts.down_proj only (not the router's or any other)")
    if config.get("fan_in_fan_out"):
        raise AdapterFormatError(adapter_id, "fan_in_fan_out adapters are not supported")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        raise AdapterFormatError(adapter_id, f"r must be a positive integer, got {r!r}")
    return config


def read_adapter_config(adapter_id: str, folder: Path) -> dict:
    """Read and check the `adapter_config.json` in `folder` (`parse_adapter_config`)."""
    return parse_adapter_config(adapter_id, read_adapter_file(adapter_id, folder, CONFIG_FILE))


def weights_file_or_refuse(adapter_id: str, names: Container[str], accepted: Sequence[str] = (WEIGHTS_FILE,),
                           where: str = "the adapter folder") -> str:
    """The first of the `accepted` weights files among the adapter's file `names`.

    Policy: pickle weights (`PICKLE_FILES`) are never loaded (that would run code from an untrusted
    file): an adapter that has only those is refused with AdapterFormatError saying so, and one
    with a config but no weights with AdapterFormatError naming `where` (never a server path). A
    folder with neither holds no adapter: AdapterNotFoundError, as for a folder that is not there."""
    for name in accepted:
        if name in names:
            return name
    pickled = next((p for p in PICKLE_FILES if p in names), None)
    if pickled is not None:
        raise AdapterFormatError(
            adapter_id, f"{pickled} is pickle; only {WEIGHTS_FILE} is accepted (no pickle loading)")
    if CONFIG_FILE not in names:
        raise AdapterNotFoundError(adapter_id, f"no adapter ({CONFIG_FILE}, {WEIGHTS_FILE}) in {where}")
    raise AdapterFormatError(adapter_id, f"no {WEIGHTS_FILE} in {where}")


def check_rank(adapter_id: str, config: dict, max_rank: int) -> None:
    """Refuse an adapter whose configured rank `r` exceeds `max_rank` (AdapterRankError), before its
    weights are read; `parse_lora_tensors` checks each module's actual rank as well."""
    if config["r"] > max_rank:
        raise AdapterRankError(adapter_id, config["r"], max_rank)


def parse_safetensors_bytes(adapter_id: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's content; anything unreadable is AdapterFormatError
    ("... is corrupt")."""
    try:
        return load_safetensors(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterFormatError(adapter_id, f"{WEIGHTS_FILE} is corrupt: {e}") from e


def load_peft_adapter(adapter_id: str, folder: Path, shapes: ModelShapes, max_rank: int) -> LoraWeights:
    """Load and validate the plain PEFT adapter in `folder` for a model of the given shapes.

    The composition of this module's steps, in order: the folder exists (`folder_files`), the
    weights are safetensors (`weights_file_or_refuse`), the config is plain LoRA
    (`read_adapter_config`), the rank fits (`check_rank`), the file parses
    (`parse_safetensors_bytes`) and the tensors fit the model (`parse_lora_tensors`).
    `lora_cluster.store.admission` composes the same steps with checksums and decryption."""
    folder = Path(folder)
    weights = weights_file_or_refuse(adapter_id, folder_files(adapter_id, folder))
    config = read_adapter_config(adapter_id, folder)
    check_rank(adapter_id, config, max_rank)
    tensors = parse_safetensors_bytes(adapter_id, read_adapter_file(adapter_id, folder, weights))
    return parse_lora_tensors(adapter_id, config, tensors, shapes, max_rank)


def parse_lora_tensors(
    adapter_id: str, config: dict, tensors: dict[str, torch.Tensor], shapes: ModelShapes, max_rank: int
) -> LoraWeights:
    """Map PEFT tensor names to (layer, module) pairs and check them against the model."""
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    magnitude: dict[tuple[int, str], torch.Tensor] = {}
    dora = bool(config.get("use_dora"))
    if dora and config.get("target_parameters"):
        raise AdapterFormatError(adapter_id, "DoRA (use_dora=true) on a mixture of experts' experts "
                                 "(target_parameters) is not supported: DoRA is served on attention "
                                 "and dense MLP projections only")
    experts = [f"mlp.experts.{p}" for p in shapes.expert_modules]
    targets = ", ".join(sorted([*shapes.modules, *shapes.fused, *experts]))
    odd = next((k for k in tensors if _MAGNITUDE.search(k) and not _MAG_KEY.match(k)
                and not _NOT_TEXT.search(k)), None)
    if odd is not None:
        raise AdapterFormatError(adapter_id, f"DoRA on tensor {odd!r} is not supported: DoRA is served on "
                                 "dense attention and MLP projections only (not on embeddings, a mixture "
                                 "of experts' experts or other modules)")
    stacked: dict[tuple[int, str, str], torch.Tensor] = {}  # (layer, nesting, A|B) -> PEFT's expert tensor
    per_expert: dict[tuple[int, int, str], dict[str, object]] = {}  # (layer, expert, part) -> name, A, B
    for key, tensor in tensors.items():
        if _NOT_TEXT.search(key):
            continue
        expert = STACKED_EXPERTS.match(key)
        if expert is not None and shapes.experts:
            stacked[(int(expert[1]), expert[2], expert[3])] = tensor
            continue
        single = PER_EXPERT.match(key)
        if single is not None and shapes.experts:
            entry = per_expert.setdefault((int(single[1]), int(single[2]), PER_EXPERT_PART[single[3]]), {})
            entry.update({"name": single[3], single[4]: tensor})
            continue
        mag = _MAG_KEY.match(key)
        if mag is not None:
            if not dora:
                raise AdapterFormatError(adapter_id,
                                         f"tensor {key!r} is a DoRA magnitude but use_dora is not set")
            _magnitude(adapter_id, int(mag[1]), mag[2], tensor, shapes, targets, magnitude)
            continue
        match = _KEY.match(key)
        if match is None and _MOE.search(key):
            raise AdapterFormatError(
                adapter_id, f"tensor {key!r} is LoRA on a mixture-of-experts block that is not served (the "
                "router, or experts on a dense model); "
                f"adapters may target {targets}")
        if match is None:
            raise AdapterFormatError(
                adapter_id, f"tensor {key!r} is not a LoRA weight of a supported projection ({targets})")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes.modules and module not in shapes.fused:
            raise AdapterFormatError(adapter_id, f"target module {module!r} is not supported ({targets})")
        if layer >= shapes.num_layers:
            raise AdapterShapeError(adapter_id, f"layer {layer} >= the model's {shapes.num_layers} layers")
        if module in shapes.fused:
            _split_fused(adapter_id, layer, module, which, tensor, shapes, a, b)
            continue
        (a if which == "A" else b)[(layer, module)] = tensor.float().contiguous()
    def module_scaling(module: str, rank: int) -> float:
        return _module_scaling(config, module, rank)

    expert_scaling = split_experts(adapter_id, stacked, shapes, max_rank, module_scaling, a, b)
    if per_expert and stacked:
        raise AdapterFormatError(adapter_id, "LoRA on the experts both per expert and on the stacked experts")
    if per_expert:  # a dense base has no expert shapes to join against
        expert_scaling.update(join_per_expert(adapter_id, per_expert, shapes, module_scaling, a, b))
    if not a:
        raise AdapterFormatError(adapter_id, f"{WEIGHTS_FILE} holds no LoRA weights")
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))[0]
        raise AdapterFormatError(
            adapter_id, f"lora_A and lora_B do not pair up at layer {missing[0]} {missing[1]}"
        )
    if dora and magnitude.keys() != a.keys():
        missing = sorted(set(a) ^ set(magnitude))[0]
        raise AdapterFormatError(adapter_id, f"DoRA: lora_A/lora_B and lora_magnitude_vector do not pair up "
                                 f"at layer {missing[0]} {missing[1]}")
    scaling: dict[str, float] = {}
    fused_of = {m: name for name, members in shapes.fused.items() for m in members}
    for (layer, module), wa in a.items():
        wb = b[(layer, module)]
        unit = expert_unit(module)
        in_f, out_f = shapes.expert_modules[unit[8:]] if unit else shapes.modules[module]
        if (
            wa.dim() != 2
            or wb.dim() != 2
            or wa.shape[1] != in_f
            or wb.shape[0] != out_f
            or wb.shape[1] != wa.shape[0]
        ):
            raise AdapterShapeError(
                adapter_id,
                f"layer {layer} {module}: lora_A {tuple(wa.shape)} / lora_B {tuple(wb.shape)} do not fit "
                f"the model's {module} (in_features={in_f}, out_features={out_f})",
            )
        rank = wa.shape[0]
        if rank > max_rank:
            raise AdapterRankError(adapter_id, rank, max_rank)
        if not (torch.isfinite(wa).all() and torch.isfinite(wb).all()):
            raise AdapterFormatError(adapter_id, f"layer {layer} {module} holds NaN or infinite values")
        scaling[module] = expert_scaling[(layer, unit)] if unit else _module_scaling(
            config, fused_of.get(module, module), rank)
    return LoraWeights(
        adapter_id=adapter_id,
        rank=max(t.shape[0] for t in a.values()),
        target_modules=frozenset(m for _, m in a),
        scaling=scaling,
        a=a,
        b=b,
        magnitude=magnitude,
    )


def _magnitude(adapter_id: str, layer: int, module: str, tensor: torch.Tensor, shapes: ModelShapes,
               targets: str, magnitude: dict) -> None:  # fmt: skip
    """A DoRA magnitude vector [out_features] of a dense projection, split by member rows on a fused one
    (DoRA's weight norm is per output row, so a fused row's norm is its member row's)."""
    if module not in shapes.modules and module not in shapes.fused:
        raise AdapterFormatError(adapter_id, f"DoRA on {module!r} is not supported: DoRA is served on "
                                 f"dense projections ({targets})")
    if layer >= shapes.num_layers:
        raise AdapterShapeError(adapter_id, f"layer {layer} >= the model's {shapes.num_layers} layers")
    members = shapes.fused.get(module, (module,))
    outs = [shapes.modules[m][1] for m in members]
    if tensor.dim() != 1 or tensor.shape[0] != sum(outs):
        raise AdapterShapeError(adapter_id, f"layer {layer} {module}: lora_magnitude_vector "
                                f"{tuple(tensor.shape)} does not fit the model's {module} "
                                f"(out_features={sum(outs)})")
    if not torch.isfinite(tensor).all():
        raise AdapterFormatError(adapter_id, f"layer {layer} {module}: lora_magnitude_vector holds NaN or "
                                 "infinite values")
    for m, part in zip(members, tensor.float().split(outs), strict=True):
        magnitude[(layer, m)] = part.contiguous()


def _split_fused(adapter_id: str, layer: int, module: str, which: str, tensor: torch.Tensor,
                 shapes: ModelShapes, a: dict, b: dict) -> None:  # fmt: skip
    """A fused projection's lora_A is every member's A; its lora_B's rows split by member outputs."""
    members = shapes.fused[module]
    if which == "A":
        for m in members:
            a[(layer, m)] = tensor.float().contiguous()
        return
    outs = [shapes.modules[m][1] for m in members]
    if tensor.dim() != 2 or tensor.shape[0] != sum(outs):
        raise AdapterShapeError(adapter_id, f"layer {layer} {module}: lora_B {tuple(tensor.shape)} does not "
                                f"fit the model's {module} (out_features={sum(outs)})")
    for m, part in zip(members, tensor.float().split(outs), strict=True):
        b[(layer, m)] = part.contiguous()


def _module_scaling(config: dict, module: str, rank: int) -> float:
    alpha = float(
        _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", config["r"]))
    )
    if config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank


__all__ = ["AdapterError", "LoraWeights", "ModelShapes", "check_adapter_id", "check_rank", "folder_files",
           "load_peft_adapter", "parse_adapter_config", "parse_lora_tensors", "parse_safetensors_bytes",
           "read_adapter_config", "read_adapter_file", "weights_file_or_refuse"]

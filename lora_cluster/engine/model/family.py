"""What differs between the decoder families the engine serves, read from a model's config.

The engine has one forward pass (`engine.model.runner.ModelRunner`); a `FamilySpec` says how to run it for
one checkpoint: which norms a layer has and where, whether queries/keys are normalised, the scale of
the embeddings, residuals, attention scores and logits, soft-capping, each layer's sliding window
and rope table (or none), the MLP's activation, whether the checkpoint stores q/k/v and gate/up
fused, and whether the MLP is a mixture of experts (`engine.model.moe_spec.MoeSpec`: Qwen3-MoE,
Mixtral). Adding a family is one reader in `_READERS` plus its tests. A multimodal checkpoint
listed in `TEXT_ONLY` (Gemma 3 from 4B up) is served as its text decoder: its spec is that
decoder's.

Policy: `read_family` refuses, at start, an architecture without a reader (`UnsupportedModelError`,
listing the supported ones) and any config value the runner cannot honour (`ConfigError` naming the
field and the value: an unknown layer type, rope type or activation, bidirectional attention, ...).
Nothing unsupported is served approximately.

Invariants: `len(spec.layers) == config.num_hidden_layers`; every `LayerSpec.rope` is None or a
key of `spec.ropes`; a window is None or >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lora_cluster.engine.model.moe_spec import MoeSpec, read_moe
from lora_cluster.errors import ConfigError, UnsupportedModelError

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope types whose tables depend only on the config (not on the length of the batch being run);
# longrope too, within its original context (`FamilySpec.max_positions`: its short factors apply)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional", "longrope")


@dataclass(frozen=True)
class Norms:
    """The checkpoint name (under `model.layers.{i}.`) of each norm a layer applies, None where it
    has none: `pre_attn` normalises the attention's input, `post_attn` its output before the
    residual add, `pre_mlp` / `post_mlp` the same around the MLP."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None


LLAMA_NORMS = Norms()
SANDWICH_NORMS = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm")  # Gemma 2/3
POST_NORMS = Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo 2


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its sliding window (None: full causal attention) and the key of its rope
    table in `FamilySpec.ropes` (None: the layer applies no rotary embedding)."""

    window: int | None
    rope: str | None


@dataclass(frozen=True)
class RopeSpec:
    """One rope table: its type, base, how many leading dims of a head rotate, and the
    `layer_type` under which transformers' rope functions read its parameters (None: top level)."""

    rope_type: str
    theta: float
    rotary_dim: int
    layer_type: str | None = None


@dataclass(frozen=True)
class FamilySpec:
    """How the one runner runs a checkpoint (see the module docstring)."""

    architecture: str
    layers: tuple[LayerSpec, ...]
    ropes: dict[str, RopeSpec]
    norms: Norms = LLAMA_NORMS
    norm_offset: float = 0.0  # norms scale by (weight + offset): 1 for Gemma
    norm_weight_in_float32: bool = False  # weight applied before the cast back (Gemma, OLMo 2)
    qk_norm: str | None = None  # "head": RMSNorm over each head's dims; "all": over all heads' dims
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float = 0.0  # score scale; 0 = head_dim ** -0.5
    attn_softcap: float = 0.0  # 0 = none
    final_softcap: float = 0.0
    logits_divisor: float = 1.0
    activation: str = "silu"
    fused_checkpoint: bool = False  # q/k/v as `qkv_proj`, gate/up as `gate_up_proj` (Phi-3)
    # the longest sequence served exactly, when shorter than max_position_embeddings: longrope's
    # original context (transformers switches every position to the long factors past it)
    max_positions: int | None = None
    moe: MoeSpec | None = None  # None: a dense gated MLP on every layer


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _head_dim(config: Any) -> int:
    return _get(config, "head_dim") or config.hidden_size // config.num_attention_heads


def _refuse(config: Any, field_name: str, value: Any, allowed: Any) -> ConfigError:
    arch = (_get(config, "architectures") or [config.model_type])[0]
    return ConfigError(
        f"{arch}: config field {field_name} = {value!r} is not supported (supported: {allowed})")


def _rope(config: Any, params: dict | None, where: str, layer_type: str | None = None) -> RopeSpec:
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(config, f"{where}.rope_type", rope_type, ", ".join(ROPE_TYPES))
    factor = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0) or 1.0)
    theta = params.get("rope_theta", _get(config, "rope_theta", 10000.0))
    return RopeSpec(rope_type, float(theta), int(_head_dim(config) * factor), layer_type)


def _layer_types(config: Any, sliding_everywhere: bool = False) -> list[str]:
    """Each layer's type: the config's `layer_types`, else every layer sliding when the family
    slides everywhere and a window is set (Mistral, Phi-3), else full attention."""
    n = config.num_hidden_layers
    types = _get(config, "layer_types")
    if types is None:
        sliding = sliding_everywhere and _get(config, "sliding_window") is not None
        types = ["sliding_attention" if sliding else "full_attention"] * n
    if len(types) != n:
        raise _refuse(config, "layer_types", f"{len(types)} entries", f"one per layer ({n})")
    for t in types:
        if t not in LAYER_TYPES:
            raise _refuse(config, "layer_types", t, ", ".join(LAYER_TYPES))
    return list(types)


def _windows(config: Any, types: list[str]) -> list[int | None]:
    window = _get(config, "sliding_window")
    if any(t == "sliding_attention" for t in types) and not (isinstance(window, int) and window >= 1):
        raise _refuse(config, "sliding_window", window, "a positive integer for sliding_attention layers")
    return [window if t == "sliding_attention" else None for t in types]


def _activation(config: Any, name: str = "hidden_act") -> str:
    act = _get(config, name, "silu")
    if act not in ACTIVATIONS:
        raise _refuse(config, name, act, ", ".join(ACTIVATIONS))
    return act


def _single_rope(config: Any, types: list[str], uses_rope: list[bool] | None = None) -> dict[str, Any]:
    ropes = {"global": _rope(config, _get(config, "rope_parameters"), "rope_parameters")}
    uses = uses_rope or [True] * len(types)
    layers = tuple(LayerSpec(w, "global" if u else None) for w, u in zip(_windows(config, types), uses,
                                                                          strict=True))
    return {"layers": layers, "ropes": ropes}


def _llama(config: Any, *, sliding_everywhere: bool = False) -> FamilySpec:
    types = _layer_types(config, sliding_everywhere)
    return FamilySpec(config.architectures[0], activation=_activation(config), **_single_rope(config, types))


def _mistral(config: Any) -> FamilySpec:
    return _llama(config, sliding_everywhere=True)


def _qwen3(config: Any) -> FamilySpec:
    return replace(_llama(config), qk_norm="head")


def _phi3(config: Any) -> FamilySpec:
    spec = replace(_llama(config, sliding_everywhere=True), fused_checkpoint=True)
    params = _get(config, "rope_parameters") or {}
    if spec.ropes["global"].rope_type == "longrope":
        original = params.get("original_max_position_embeddings")
        if not isinstance(original, int) or original < 1:
            raise _refuse(config, "rope_parameters.original_max_position_embeddings", original,
                          "a positive integer with longrope")
        spec = replace(spec, max_positions=original)
    return spec


def _granite(config: Any) -> FamilySpec:
    return replace(
        _llama(config), embed_scale=float(config.embedding_multiplier),
        residual_scale=float(config.residual_multiplier), attn_scale=float(config.attention_multiplier),
        logits_divisor=float(config.logits_scaling),
    )  # fmt: skip


def _olmo2(config: Any) -> FamilySpec:
    return replace(_llama(config), norms=POST_NORMS, qk_norm="all", norm_weight_in_float32=True)


def _smollm3(config: Any) -> FamilySpec:
    types = _layer_types(config)
    uses = [bool(u) for u in _get(config, "no_rope_layers") or [1] * len(types)]
    if len(uses) != len(types):
        raise _refuse(config, "no_rope_layers", f"{len(uses)} entries", f"one per layer ({len(types)})")
    return FamilySpec(config.architectures[0], activation=_activation(config),
                      **_single_rope(config, types, uses))


def _gemma(config: Any, *, per_type_rope: bool) -> FamilySpec:
    if _get(config, "use_bidirectional_attention"):
        raise _refuse(config, "use_bidirectional_attention", True, "False (causal decoding)")
    types = _layer_types(config)
    windows = _windows(config, types)
    if per_type_rope:  # Gemma 3: a table per layer type (the local base on sliding layers)
        params = _get(config, "rope_parameters") or {}
        ropes = {t: _rope(config, params.get(t), f"rope_parameters.{t}", t) for t in sorted(set(types))}
        layers = tuple(LayerSpec(w, t) for w, t in zip(windows, types, strict=True))
    else:
        ropes = {"global": _rope(config, _get(config, "rope_parameters"), "rope_parameters")}
        layers = tuple(LayerSpec(w, "global") for w in windows)
    return FamilySpec(
        config.architectures[0], layers, ropes, norms=SANDWICH_NORMS, norm_offset=1.0,
        norm_weight_in_float32=True, qk_norm="head" if per_type_rope else None,
        embed_scale=math.sqrt(config.hidden_size), attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=float(_get(config, "attn_logit_softcapping") or 0.0),
        final_softcap=float(_get(config, "final_logit_softcapping") or 0.0),
        activation=_activation(config, "hidden_activation"),
    )  # fmt: skip


def _qwen3_moe(config: Any) -> FamilySpec:
    spec = replace(_llama(config, sliding_everywhere=True), qk_norm="head")
    return replace(spec, moe=read_moe(config, "num_experts", bool(_get(config, "norm_topk_prob")), _refuse))


def _mixtral(config: Any) -> FamilySpec:
    moe = read_moe(config, "num_local_experts", True, _refuse, float32_weights=True)
    return replace(_mistral(config), moe=moe)


_READERS: dict[str, Callable[[Any], FamilySpec]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _llama,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": lambda c: _gemma(c, per_type_rope=False),
    "Gemma3ForCausalLM": lambda c: _gemma(c, per_type_rope=True),
    "Phi3ForCausalLM": _phi3,
    "GraniteForCausalLM": _granite,
    "Olmo2ForCausalLM": _olmo2,
    "SmolLM3ForCausalLM": _smollm3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
}
# multimodal checkpoints served text-only: architecture -> that of the decoder of its `text_config`
TEXT_ONLY = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = (*_READERS, *TEXT_ONLY)
# config.model_type -> architecture, for configs that do not list `architectures`
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
}  # fmt: skip


def architecture_of(config: Any) -> str:
    """The config's architecture: its first `architectures` entry, else the one of its model type."""
    listed = _get(config, "architectures")
    return listed[0] if listed else _BY_MODEL_TYPE.get(config.model_type, config.model_type)


def text_config(config: Any) -> Any:
    """The config of the decoder the engine runs: a text-only-served multimodal checkpoint's
    `text_config` (given its text architecture), else `config` itself."""
    arch = architecture_of(config)
    if arch not in TEXT_ONLY:
        return config
    text = config.text_config
    text.architectures = [TEXT_ONLY[arch]]
    return text


def read_family(model: str, config: Any) -> FamilySpec:
    """The `FamilySpec` of `model`'s config (of its decoder, for a multimodal checkpoint served
    text-only); refuses what the runner cannot honour (module docstring)."""
    arch = architecture_of(config)
    if arch in TEXT_ONLY:
        config, arch = text_config(config), TEXT_ONLY[arch]
    reader = _READERS.get(arch)
    if reader is None:
        raise UnsupportedModelError(model, arch, SUPPORTED_ARCHITECTURES)
    if not _get(config, "architectures"):
        config.architectures = [arch]
    try:
        spec = reader(config)
        if spec.max_positions is None and any(r.rope_type == "longrope" for r in spec.ropes.values()):
            raise _refuse(config, "rope_parameters.rope_type", "longrope", "longrope on Phi-3 only")
    except ConfigError as e:
        raise ConfigError(f"model {model!r}: {e}") from e
    return spec

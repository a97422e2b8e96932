"""Find, check and load a decoder base model into plain tensors.

Supported architectures share one forward pass (`lora_cluster.engine.model.runner`), run as the model's
`FamilySpec` says (`engine.model.family`: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Granite, OLMo 2,
SmolLM3, and the mixture-of-experts Qwen3-MoE and Mixtral). Any other architecture, or a config
value the runner cannot honour, is refused at start naming it. Each layer's weights land in one
layout whatever the checkpoint's: q/k/v fused as `qkv` [q_dim + 2 kv_dim, hidden] and gate/up as
`gate_up` (concatenated from separate projections, or taken as they are from a checkpoint that
stores `qkv_proj` / `gate_up_proj`); the norms a family does not have are None. A MoE layer's router
and experts land in `engine.model.moe.MoeWeights` (experts stacked: gate/up [E, 2I, hidden], down [E,
hidden, I]) from the per-expert checkpoint names (`experts.{e}.w1/w3/w2` under `block_sparse_moe`
for Mixtral, `experts.{e}.gate_proj/up_proj/down_proj` for Qwen3-MoE) or transformers' stacked
`experts.gate_up_proj` / `down_proj`; its dense gate_up / down are None. Weights are read from
safetensors only; a checkpoint shipped only as pickle (`pytorch_model.bin`) is refused. A hub id is
resolved through huggingface_hub, falling back to its local cache when the hub cannot be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from lora_cluster.engine.model.base_model import BaseModel, LayerWeights, ModelDims
from lora_cluster.engine.model.family import (
    MoeSpec,
    read_family,
    text_config,
)
from lora_cluster.engine.model.moe import MoeWeights
from lora_cluster.errors import ConfigError

__all__ = ["load_base_model", "resolve_device", "resolve_model_path"]
DECODER_PREFIXES = ("model", "language_model.model", "model.language_model")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The configured device and dtype; "auto" is cuda (bfloat16) when available, else cpu (float32)."""
    where = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dtype == "auto":
        return where, torch.bfloat16 if where.type == "cuda" else torch.float32
    return where, getattr(torch, dtype)


def resolve_model_path(model: str) -> Path:
    """A local folder as is; otherwise a hub snapshot (downloaded, or from the local cache offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or model.startswith("."):
        raise ConfigError(f"model folder {model!r} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as online_error:  # network, auth or unknown repo: try the local cache
        try:
            return Path(snapshot_download(model, allow_patterns=patterns, local_files_only=True))
        except Exception as e:
            raise ConfigError(
                f"model {model!r} is neither a local folder nor reachable on the Hugging Face hub "
                f"({online_error}), and it is not in the local hub cache"
            ) from e


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        pickled = sorted(p.name for p in path.glob("*.bin"))
        raise ConfigError(
            f"no safetensors weights in {path}"
            + (f" (found pickle {pickled[0]}; only safetensors are loaded)" if pickled else "")
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights


def _dims(config: PretrainedConfig) -> ModelDims:
    heads = config.num_attention_heads
    return ModelDims(
        num_layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
    )


def load_base_model(model: str, *, dtype: torch.dtype, device: torch.device) -> BaseModel:
    path = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model!r}: cannot read config.json: {e}") from e
    spec = read_family(model, config)
    text = text_config(config)
    dims = _dims(text)
    dims.fused_targets = spec.fused_checkpoint
    dims.moe = spec.moe is not None
    if spec.moe is not None:
        dims.experts, dims.expert_intermediate = spec.moe.num_experts, spec.moe.intermediate
    if spec.max_positions is not None:
        dims.max_position_embeddings = min(dims.max_position_embeddings, spec.max_positions)
    w = _read_weights(path)
    # where the decoder's weights sit: `model.` for a causal LM; a multimodal checkpoint's text
    # decoder under `language_model.model.` (as saved) or `model.language_model.` (its other tools' names)
    base = next((b for b in DECODER_PREFIXES if f"{b}.embed_tokens.weight" in w), "model")

    def take(name: str) -> torch.Tensor | None:
        t = w.pop(name, None)
        return None if t is None else t.to(device=device, dtype=dtype)

    def need(name: str) -> torch.Tensor:
        t = take(name)
        if t is None:
            raise ConfigError(f"model {model!r}: weight {name!r} is missing from the checkpoint")
        return t

    def fused(prefix: str, names: tuple[str, ...], suffix: str) -> torch.Tensor | None:
        parts = [take(f"{prefix}.{n}.{suffix}") for n in names]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ConfigError(f"model {model!r}: {prefix} has {suffix} for only some of {names}")
        return torch.cat(parts, dim=0).contiguous()

    def norm(prefix: str, name: str | None) -> torch.Tensor | None:
        return None if name is None else need(f"{prefix}.{name}.weight")

    def projections(p: str) -> tuple[torch.Tensor | None, ...]:
        """(qkv, qkv bias, gate_up, gate_up bias) of layer prefix `p`, in the engine's fused layout."""
        if spec.fused_checkpoint:
            return (take(f"{p}.self_attn.qkv_proj.weight"), take(f"{p}.self_attn.qkv_proj.bias"),
                    take(f"{p}.mlp.gate_up_proj.weight"), take(f"{p}.mlp.gate_up_proj.bias"))  # fmt: skip
        qkv = ("q_proj", "k_proj", "v_proj")
        return (fused(f"{p}.self_attn", qkv, "weight"), fused(f"{p}.self_attn", qkv, "bias"),
                fused(f"{p}.mlp", ("gate_proj", "up_proj"), "weight"),
                fused(f"{p}.mlp", ("gate_proj", "up_proj"), "bias"))  # fmt: skip

    def experts(p: str, moe: MoeSpec) -> MoeWeights:
        """Layer prefix `p`'s router and stacked experts (see the module docstring)."""
        found = (f"{p}.{n}" for n in ("mlp", "block_sparse_moe") if f"{p}.{n}.gate.weight" in w)
        mlp = next(found, f"{p}.mlp")
        router = need(f"{mlp}.gate.weight")
        stacked = take(f"{mlp}.experts.gate_up_proj")
        if stacked is not None:
            gate_up, down = stacked.contiguous(), need(f"{mlp}.experts.down_proj").contiguous()
        else:
            mixtral = f"{mlp}.experts.0.w1.weight" in w
            g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            e = f"{mlp}.experts"
            gate_up = torch.stack([torch.cat([need(f"{e}.{x}.{g}.weight"), need(f"{e}.{x}.{u}.weight")])
                                   for x in range(moe.num_experts)])  # fmt: skip
            down = torch.stack([need(f"{e}.{x}.{d}.weight") for x in range(moe.num_experts)])
        want = (moe.num_experts, 2 * moe.intermediate, dims.hidden)
        if tuple(gate_up.shape) != want or tuple(down.shape) != (want[0], dims.hidden, moe.intermediate):
            raise ConfigError(f"model {model!r}: {mlp} experts are {tuple(gate_up.shape)} / "
                              f"{tuple(down.shape)}, not {want} as the config says")
        return MoeWeights(router, gate_up, down)

    layers = []
    qk = (lambda p, n: need(f"{p}.self_attn.{n}.weight")) if spec.qk_norm else (lambda p, n: None)
    for i in range(dims.num_layers):
        p = f"{base}.layers.{i}"
        qkv, qkv_bias, gate_up, gate_up_bias = projections(p)
        moe = experts(p, spec.moe) if spec.moe else None
        if qkv is None or (gate_up is None and moe is None):
            raise ConfigError(f"model {model!r}: layer {i} lacks attention or MLP projections")
        layers.append(
            LayerWeights(
                pre_attn_norm=norm(p, spec.norms.pre_attn),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=need(f"{p}.self_attn.o_proj.weight"),
                o_bias=take(f"{p}.self_attn.o_proj.bias"),
                post_attn_norm=norm(p, spec.norms.post_attn),
                pre_mlp_norm=norm(p, spec.norms.pre_mlp),
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=None if moe else need(f"{p}.mlp.down_proj.weight"),
                down_bias=take(f"{p}.mlp.down_proj.bias"),
                post_mlp_norm=norm(p, spec.norms.post_mlp),
                q_norm=qk(p, "q_norm"),
                k_norm=qk(p, "k_norm"),
                moe=moe,
            )
        )
    embed = need(f"{base}.embed_tokens.weight")
    lm_head = take("lm_head.weight")
    if lm_head is None and base == "language_model.model":
        lm_head = take("language_model.lm_head.weight")
    if lm_head is None:
        if not (getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
            raise ConfigError(f"model {model!r}: lm_head.weight is missing and embeddings are not tied")
        lm_head = embed
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model!r}: cannot load its tokenizer: {e}") from e
    return BaseModel(
        name=model,
        path=path,
        config=config,
        text_config=text,
        spec=spec,
        dims=dims,
        embed=embed,
        layers=layers,
        norm=need(f"{base}.norm.weight"),
        lm_head=lm_head,
        tokenizer=tokenizer,
    )

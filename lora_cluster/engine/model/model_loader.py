"""Find, check and load a decoder base model into plain tensors.

Supported architectures share one forward pass (`lora_cluster.engine.model.runner`), run as the model's
`FamilySpec` says (`engine.model.family`: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Granite, OLMo 2,
SmolLM3, and the mixture-of-experts Qwen3-MoE and Mixtral). Any other architecture, or a config
value the runner cannot honour, is refused at start naming it. Each layer's weights land in one
layout whatever the checkpoint's (`engine.model.checkpoint`): q/k/v fused as `qkv` [q_dim + 2 kv_dim,
hidden] and gate/up as `gate_up`; the norms a family does not have are None; a MoE layer's router
and experts land in `engine.model.moe.MoeWeights` and its dense gate_up / down are None. Weights
are read from safetensors only; a checkpoint shipped only as pickle (`pytorch_model.bin`) is refused.
A hub id is resolved through huggingface_hub, falling back to its local cache when the hub cannot be
reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from lora_cluster.engine.model.base_model import BaseModel, ModelDims
from lora_cluster.engine.model.checkpoint import Checkpoint
from lora_cluster.engine.model.family import FamilySpec, read_family, text_config
from lora_cluster.errors import ConfigError

__all__ = ["load_base_model", "resolve_device", "resolve_model_path"]


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


def _dims(config: PretrainedConfig, spec: FamilySpec) -> ModelDims:
    """The decoder's dimensions from its text config, as the family spec adjusts them."""
    heads = config.num_attention_heads
    dims = ModelDims(
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
    dims.fused_targets = spec.fused_checkpoint
    dims.moe = spec.moe is not None
    if spec.moe is not None:
        dims.experts, dims.expert_intermediate = spec.moe.num_experts, spec.moe.intermediate
    if spec.max_positions is not None:
        dims.max_position_embeddings = min(dims.max_position_embeddings, spec.max_positions)
    return dims


def load_base_model(model: str, *, dtype: torch.dtype, device: torch.device) -> BaseModel:
    """Load `model` (a folder or a hub id) onto `device` in `dtype` (see the module docstring)."""
    path = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model!r}: cannot read config.json: {e}") from e
    spec = read_family(model, config)
    text = text_config(config)
    dims = _dims(text, spec)
    weights = Checkpoint(model, _read_weights(path), spec, dims, dtype=dtype, device=device)
    layers = [weights.layer(i) for i in range(dims.num_layers)]
    embed = weights.need(f"{weights.base}.embed_tokens.weight")
    tied = getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    lm_head = weights.lm_head(embed, tied)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model!r}: cannot load its tokenizer: {e}") from e
    return BaseModel(name=model, path=path, config=config, text_config=text, spec=spec, dims=dims,
                     embed=embed, layers=layers, norm=weights.need(f"{weights.base}.norm.weight"),
                     lm_head=lm_head, tokenizer=tokenizer)

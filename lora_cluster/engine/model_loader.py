"""Find, check and load a Llama-family base model into plain tensors.

Supported architectures share one forward pass (`lora_cluster.engine.llama`): Llama, Mistral and
Qwen2 (attention biases included). Any other architecture is refused at start with the list of
supported ones. Weights are read from safetensors only; a checkpoint shipped only as pickle
(`pytorch_model.bin`) is refused. A hub id is resolved through huggingface_hub, falling back to its
local cache when the hub cannot be reached.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from lora_cluster.adapter_format import ModelShapes
from lora_cluster.errors import ConfigError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, hidden], q/k/v projections fused
    qkv_bias: torch.Tensor | None  # [q_dim + 2 * kv_dim]
    o: torch.Tensor  # [hidden, q_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden], gate/up fused
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass
class ModelDims:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shapes(self) -> ModelShapes:
        h, i = self.hidden, self.intermediate
        return ModelShapes(
            num_layers=self.num_layers,
            modules={
                "q_proj": (h, self.q_dim),
                "k_proj": (h, self.kv_dim),
                "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            },
        )


@dataclass
class BaseModel:
    name: str  # as the user gave it (folder or hub id)
    path: Path
    config: PretrainedConfig
    dims: ModelDims
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    tokenizer: object


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
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    arch = (getattr(config, "architectures", None) or [by_type.get(config.model_type, config.model_type)])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(model, arch, SUPPORTED_ARCHITECTURES)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"model {model!r}: hidden_act {config.hidden_act!r} is not supported (only silu)")
    dims = _dims(config)
    w = _read_weights(path)

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

    layers = []
    for i in range(dims.num_layers):
        p = f"model.layers.{i}"
        layers.append(
            LayerWeights(
                input_norm=need(f"{p}.input_layernorm.weight"),
                qkv=fused(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), "weight"),
                qkv_bias=fused(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), "bias"),
                o=need(f"{p}.self_attn.o_proj.weight"),
                o_bias=take(f"{p}.self_attn.o_proj.bias"),
                post_norm=need(f"{p}.post_attention_layernorm.weight"),
                gate_up=fused(f"{p}.mlp", ("gate_proj", "up_proj"), "weight"),
                gate_up_bias=fused(f"{p}.mlp", ("gate_proj", "up_proj"), "bias"),
                down=need(f"{p}.mlp.down_proj.weight"),
                down_bias=take(f"{p}.mlp.down_proj.bias"),
            )
        )
        if layers[-1].qkv is None or layers[-1].gate_up is None:
            raise ConfigError(f"model {model!r}: layer {i} lacks attention or MLP projections")
    embed = need("model.embed_tokens.weight")
    lm_head = take("lm_head.weight")
    if lm_head is None:
        if not getattr(config, "tie_word_embeddings", False):
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
        dims=dims,
        embed=embed,
        layers=layers,
        norm=need("model.norm.weight"),
        lm_head=lm_head,
        tokenizer=tokenizer,
    )

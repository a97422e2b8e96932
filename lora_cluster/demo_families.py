"""Tiny random-weight models of each supported family, with PEFT adapters: `lora-cluster demo --arch`.

`build_family_zoo(out, arch)` writes `out/model` (a checkpoint of the family saved by transformers'
own `save_pretrained`, so its key names, fused projections and tied embeddings are the family's)
and `out/adapters/a{i}` (written by PEFT's `save_pretrained` from a `LoraConfig` on that model, so
target names are what PEFT writes for the family: `qkv_proj` / `gate_up_proj` on Phi-3). Policy:

* Small and exercising: 2 layers, hidden 64, head_dim 16, GQA; a sliding window of `WINDOW` tokens
  where the family has windows (Gemma's alternating layers, Mistral and Phi-3 everywhere); the
  family's own differences switched on (llama3 rope scaling and tied embeddings, q/k norms,
  soft-caps, Granite's multipliers, a layer without rope, partial rotary, Gemma 3's local base;
  4-8 experts, top-2, with and without renormalisation, on the mixtures of experts).
* Every weight random from `torch.Generator(seed)` (norm weights around their identity, linear
  weights ~ N(0, 1/in), LoRA A and B both non-zero), so adapters visibly change outputs.
* Adapter a{i} has the shape `ADAPTERS[i % 5]`: ranks 4-64, attention and MLP targets, rslora. On
  the mixtures of experts an MLP target becomes LoRA on every expert's `gate_up_proj` and
  `down_proj` (PEFT's `target_parameters`, both: PEFT requires every adapter on one model that
  targets parameters to target the same ones), attention targets stay `target_modules`.
* Deterministic and reusable like `lora_cluster.demo`: a folder whose `manifest.json` matches
  (version, arch, seed, num_adapters) is returned untouched; the zoo is written in a temporary
  sibling and renamed into place.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_cluster.demo import DemoZoo, train_tokenizer

FAMILY_ZOO_VERSION = 2
WINDOW = 8  # sliding window of the tiny models that have one (prompts in the tests are longer)
_DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=3)  # fmt: skip
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip

# --arch name -> (transformers config class, architecture, the family's settings on the tiny dims)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               {"rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    # Gemma 3 from 4B up: a multimodal checkpoint (a tiny vision tower) served as its text decoder
    "gemma3mm": ("Gemma3Config", "Gemma3ForConditionalGeneration", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"sliding_window": WINDOW,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
    # Phi-4-mini's shape: longrope (served within its original context), partial rotary, tied embeddings
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM",
                 {"tie_word_embeddings": True, "original_max_position_embeddings": 64,
                  "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                      "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                      "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.125,
                 "logits_scaling": 2.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                {"no_rope_layers": [1, 0], "tie_word_embeddings": True}),
    # mixtures of experts: 8 experts, top-2 without renormalisation (norm_topk_prob false)
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": False, "tie_word_embeddings": False}),
    # 4 experts, top-2 renormalised, sliding window on every layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
}  # fmt: skip
ARCHS = tuple(FAMILIES)
MOE_ARCHS = ("qwen3moe", "mixtral")


@dataclass(frozen=True)
class FamilyAdapter:
    """One demo adapter's shape; targets are the unfused names (mapped to fused ones where the
    model fuses them)."""

    r: int
    lora_alpha: int
    targets: tuple[str, ...]
    use_rslora: bool = False


_ATTN, _MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = (
    FamilyAdapter(4, 8, ("q_proj", "v_proj")),
    FamilyAdapter(16, 16, _ATTN + _MLP, use_rslora=True),
    FamilyAdapter(64, 32, _MLP),
    FamilyAdapter(8, 16, ("k_proj", "o_proj", "down_proj")),
    FamilyAdapter(32, 32, _ATTN + _MLP, use_rslora=True),
)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def family_config(arch: str, vocab_size: int) -> Any:
    """The transformers config of the tiny `arch` model (float32)."""
    import transformers

    cls_name, architecture, settings = FAMILIES[arch]
    if architecture == "Gemma3ForConditionalGeneration":
        text = family_config("gemma3", vocab_size).to_dict()
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(),
                                         mm_tokens_per_image=4, architectures=[architecture],
                                         dtype="float32")  # fmt: skip
    return getattr(transformers, cls_name)(vocab_size=vocab_size, architectures=[architecture],
                                           dtype="float32", **_DIMS, **settings)  # fmt: skip


def _randomize(model: torch.nn.Module, g: torch.Generator, norm_center: float) -> None:
    """Every parameter random (see the module docstring); tied weights are drawn once."""
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in name:
                p.copy_(norm_center + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.05 * noise)
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)  # in_features (last dim of stacked experts too)


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _targets(spec: FamilyAdapter, fused: bool, moe: bool) -> tuple[list[str], list[str] | None]:
    """PEFT's (target_modules, target_parameters): fused names on fused checkpoints; on MoE models
    the attention targets, and every expert's projections when the shape has an MLP target."""
    if moe:
        mlp = any(t in _MLP for t in spec.targets)
        return sorted(t for t in spec.targets if t in _ATTN), EXPERT_PARAMETERS if mlp else None
    return sorted({_FUSED.get(t, t) if fused else t for t in spec.targets}), None


def _write_family(tmp: Path, zoo: DemoZoo, arch: str, seed: int, num_adapters: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = train_tokenizer("tiny")
    config = family_config(arch, len(tokenizer))
    torch.manual_seed(seed)  # transformers' own init, overwritten below
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, torch.Generator().manual_seed(seed), 0.0 if arch.startswith("gemma") else 1.0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model", save_jinja_files=False)
    model.name_or_path = str(zoo.model_dir)
    fused = FAMILIES[arch][1] == "Phi3ForCausalLM"
    moe = arch in MOE_ARCHS
    for i, adapter_id in enumerate(zoo.adapter_ids):
        spec = ADAPTERS[i % len(ADAPTERS)]
        modules, parameters = _targets(spec, fused, moe)
        lora = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, target_modules=modules or None,
                          target_parameters=parameters, use_rslora=spec.use_rslora, lora_dropout=0.0,
                          task_type="CAUSAL_LM")  # fmt: skip
        peft_model = get_peft_model(copy.deepcopy(model), lora)
        g = torch.Generator().manual_seed(seed * 1_000_003 + i + 1)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        peft_model.save_pretrained(tmp / "adapters" / adapter_id, save_embedding_layers=False)
    (tmp / "adapters").mkdir(exist_ok=True)


def _manifest(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def build_family_zoo(out: Path, arch: str, *, num_adapters: int = 5, seed: int = 0,
                     replace: bool = True) -> DemoZoo:  # fmt: skip
    """Write (or reuse) the tiny `arch` zoo at `out` (see the module docstring). A zoo of other
    arguments is replaced when `replace`, else `FileExistsError`; a non-empty folder without a
    manifest is never overwritten (`FileExistsError`)."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown --arch {arch!r}; one of {', '.join(ARCHS)}")
    if num_adapters < 0:
        raise ValueError("num_adapters must be >= 0")
    out = Path(out).resolve()
    want = {"version": FAMILY_ZOO_VERSION, "arch": arch, "seed": seed, "num_adapters": num_adapters}
    zoo = DemoZoo(out / "model", out / "adapters", [f"a{i}" for i in range(num_adapters)])
    found = _manifest(out)
    if found == want:
        return zoo
    if out.exists() and any(out.iterdir()) and found is None:
        raise FileExistsError(f"{out} is not empty and holds no demo zoo manifest; refusing to overwrite it")
    if found is not None and not replace:
        raise FileExistsError(f"{out} holds a demo zoo of {found}; refusing to replace it with one of {want}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_family(tmp, zoo, arch, seed, num_adapters)
        (tmp / "manifest.json").write_text(json.dumps(want, indent=2, sort_keys=True))
        tmp.chmod(0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "zoo")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return zoo

"""Family support at the edges: what is refused at start and how, adapters as PEFT writes them per
family, and `lora-cluster demo --arch`.

A config value the runner cannot honour fails `build_engine` at start with a `ConfigError` naming
the field and the value; an unknown architecture with `UnsupportedModelError` listing the supported
ones. Adapters that the batched LoRA cannot serve exactly (`modules_to_save`) are refused by
name. (Token parity of every family: tests/engine/test_family_parity.py.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lora_cluster.cli import main
from lora_cluster.demo import DemoZoo
from lora_cluster.demo_families import ARCHS, build_family_zoo
from lora_cluster.engine import SamplingParams, build_engine
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import AdapterFormatError, ConfigError, UnsupportedModelError


@pytest.fixture(scope="module")
def zoos(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], DemoZoo]:
    root = tmp_path_factory.mktemp("family-zoos")
    return lambda arch: build_family_zoo(root / arch, arch)


def _edited(zoo: DemoZoo, tmp_path: Path, edit: Callable[[dict], None]) -> str:
    """A copy of the zoo's model whose config.json `edit` changed."""
    model = tmp_path / "model"
    shutil.copytree(zoo.model_dir, model)
    config = json.loads((model / "config.json").read_text())
    edit(config)
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


REFUSED = [  # (family, config edit, field named, value named)
    ("gemma3", lambda c: c.update(layer_types=["chunked_attention", "full_attention"]), "layer_types",
     "chunked_attention"),
    ("llama3", lambda c: c["rope_parameters"].update(rope_type="dynamic"), "rope_parameters.rope_type",
     "dynamic"),
    ("qwen3", lambda c: c.update(hidden_act="relu"), "hidden_act", "relu"),
    ("gemma3", lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention", "True"),
    ("gemma2", lambda c: c.update(hidden_activation="gelu_new"), "hidden_activation", "gelu_new"),
    ("mistral", lambda c: c.update(sliding_window=0), "sliding_window", "0"),
    ("qwen3moe", lambda c: c.update(mlp_only_layers=[1]), "mlp_only_layers", "[1]"),
    ("qwen3moe", lambda c: c.update(decoder_sparse_step=2), "decoder_sparse_step", "2"),
    ("mixtral", lambda c: c.update(num_shared_experts=2), "num_shared_experts", "2"),
    ("mixtral", lambda c: c.update(num_experts_per_tok=5), "num_experts_per_tok", "5"),
]


@pytest.mark.parametrize(("arch", "edit", "field", "value"), REFUSED, ids=[f"{r[0]}-{r[2]}" for r in REFUSED])
def test_a_config_value_the_engine_cannot_honour_fails_at_start_naming_it(zoos, tmp_path, arch, edit, field,
                                                                           value):  # fmt: skip
    model = _edited(zoos(arch), tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        build_engine(model=model, adapter_source=None)
    assert field in str(info.value), f"the error names the field {field}: {info.value}"
    assert value in str(info.value), f"the error names the value {value}: {info.value}"


def test_an_unknown_architecture_fails_at_start_listing_the_supported_ones(zoos, tmp_path):
    model = _edited(zoos("qwen3"), tmp_path, lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]))
    with pytest.raises(UnsupportedModelError) as info:
        build_engine(model=model, adapter_source=None)
    assert "DeepseekV3ForCausalLM" in str(info.value), "the error names the architecture"
    for supported in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM"):
        assert supported in str(info.value), f"the error lists {supported} as supported"


def test_longrope_is_served_within_its_original_context(zoos):
    """transformers switches every position to longrope's long factors once a sequence passes the
    original context: the engine serves the short-factor range exactly, and no further."""
    engine = build_engine(model=str(zoos("phi4mini").model_dir), adapter_source=None, max_model_len=4096)
    try:
        assert engine.max_model_len == 64, "max_model_len is capped at original_max_position_embeddings"
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bfloat16_engine_serves_every_family_close_to_peft(zoos, arch):
    """bfloat16 is the default dtype on CUDA: rotated queries and keys keep it (the rope tables are
    cast as transformers casts them), and the first token's logprob stays near PEFT's float32 one."""
    from helpers import peft_logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    zoo = zoos(arch)
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), dtype="bfloat16",
                          max_lora_rank=64)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        outs = engine.generate(["the quick brown fox jumps over the lazy dog near the river"] * 2,
                               adapter_ids=[None, "a1"], sampling=sampling)
    finally:
        engine.close()
    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, zoo.adapters_dir / "a1", adapter_name="a1").eval()
    for aid, out in zip([None, "a1"], outs, strict=True):
        assert len(out.token_ids) == 4, f"{arch} ({aid}): a bfloat16 engine decodes every token"
        ref = torch.log_softmax(peft_logits(model, aid, out.prompt_token_ids)[-1].float(), dim=-1)
        first = out.logprobs[0]
        assert abs(first.logprob - ref[first.token_id].item()) < 0.1, (
            f"{arch} ({aid}): the bfloat16 logprob of the first token is near PEFT's float32 one")


def _peft_adapter(zoo: DemoZoo, out: Path, **lora: object) -> Path:
    """An adapter written by PEFT itself on the zoo's model (`lora`: LoraConfig settings)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **lora))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize(("lora", "named"), [
    ({"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
], ids=["modules_to_save"])
def test_adapters_the_batched_lora_cannot_serve_are_refused_by_name(zoos, tmp_path, lora, named):
    zoo = zoos("qwen3")
    _peft_adapter(zoo, tmp_path / "adapters" / "odd", **lora)
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(tmp_path / "adapters"),
                          max_lora_rank=8)
    try:
        with pytest.raises(AdapterFormatError) as info:
            engine.generate(["hello"], adapter_ids=["odd"])
    finally:
        engine.close()
    assert "odd" in str(info.value), "the error names the adapter"
    assert named in str(info.value), f"the error names {named}: {info.value}"


def test_phi3_adapters_on_fused_projections_load_as_their_slices(zoos):
    """PEFT targets Phi-3's `qkv_proj` and `gate_up_proj`: the engine takes them as q/k/v and gate/up."""
    from lora_cluster.adapter_format import load_peft_adapter

    zoo = zoos("phi3")
    config = json.loads((zoo.adapters_dir / "a1" / "adapter_config.json").read_text())
    assert {"qkv_proj", "gate_up_proj"} <= set(config["target_modules"]), "PEFT wrote the fused names"
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    weights = load_peft_adapter("a1", zoo.adapters_dir / "a1", shapes, max_rank=64)
    assert weights.target_modules == set(shapes.modules), "every projection of the split is targeted"
    assert weights.scaling["q_proj"] == weights.scaling["up_proj"] == pytest.approx(16 / 16**0.5), (
        "the fused module's rslora scaling applies to each slice")


def test_demo_arch_builds_a_tiny_family_zoo_with_peft_adapters(tmp_path, capsys):
    out = tmp_path / "gemma3"
    assert main(["demo", "--arch", "gemma3", "--out", str(out), "--num-adapters", "2"]) == 0, "it builds"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"], "the model is of the family asked for"
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["a0", "a1"], "two adapters"
    assert (out / "adapters" / "a0" / "adapter_model.safetensors").exists(), "adapters are PEFT folders"
    assert main(["demo", "--arch", "nope", "--out", str(tmp_path / "x")]) == 2, "an unknown family is refused"
    err = capsys.readouterr().err
    assert all(a in err for a in ARCHS), f"the refusal lists every family: {err}"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(a in shown for a in ARCHS), "demo --help lists every family"

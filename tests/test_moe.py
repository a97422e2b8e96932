"""The mixture-of-experts block and what MoE bases take and refuse.

`moe_experts` (grouped by expert) equals its one-token-at-a-time reference; the router follows each
family's rules (Mixtral renormalises the top k, Qwen3-MoE only with `norm_topk_prob`); a checkpoint
in transformers' stacked expert layout serves the same tokens as the per-expert one; LoRA on the
experts (PEFT 0.21's `target_parameters`, or per-expert `experts.{e}.w1` tensors) is refused naming
the module, while attention LoRA loads. (Token parity with PEFT: tests/test_family_parity.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lora_kernels.moe_experts import moe_experts_reference, moe_experts_torch
from safetensors.torch import load_file, save_file

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.demo_families import build_family_zoo
from lora_cluster.engine import SamplingParams, build_engine
from lora_cluster.engine.model_loader import load_base_model
from lora_cluster.engine.moe import route
from lora_cluster.engine.moe_spec import MoeSpec
from lora_cluster.errors import AdapterFormatError

pytestmark = pytest.mark.usefixtures("torch_one_thread")
PROMPT = "the quick brown fox jumps over the lazy dog near the river"


@pytest.fixture(scope="module")
def zoos(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("moe-zoos")
    return lambda arch: build_family_zoo(root / arch, arch, num_adapters=2)


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_experts_equal_the_per_token_reference(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, k = 6, 16, 8, 2
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.randint(0, experts - 1, (tokens, k), generator=g)  # the last expert is never chosen
    weights = torch.rand(tokens, k, generator=g)
    out, ref = torch.empty(tokens, hidden), torch.empty(tokens, hidden)
    moe_experts_torch(out, x, ids, weights, gate_up, down, F.silu)
    moe_experts_reference(ref, x, ids, weights, gate_up, down, F.silu)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"grouped experts equal the reference for {tokens} tokens: {m}")


def test_the_router_renormalises_the_top_k_only_where_the_family_does() -> None:
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(5, 16, generator=g), torch.randn(8, 16, generator=g)
    probs = torch.softmax(x @ router.T, dim=-1)
    w, ids = route(x, router, MoeSpec(8, 2, 4, norm_topk=True, float32_weights=True))
    assert torch.allclose(w.sum(-1), torch.ones(5)), "renormalised weights sum to one (Mixtral)"
    assert ids.tolist() == probs.topk(2).indices.tolist(), "the experts of highest probability are chosen"
    w, _ = route(x, router, MoeSpec(8, 2, 4, norm_topk=False))
    assert torch.allclose(w, probs.topk(2).values), "without norm_topk_prob the weights are the probabilities"


def _generate(model: str, adapters: str | None, adapter: str | None) -> list[int]:
    engine = build_engine(model=model, adapter_source=adapters, max_lora_rank=64)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        return engine.generate([PROMPT], adapter_ids=[adapter], sampling=sampling)[0].token_ids
    finally:
        engine.close()


def test_a_checkpoint_with_stacked_experts_serves_the_same_tokens(zoos, tmp_path: Path) -> None:
    """transformers' own layout (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) loads
    as the per-expert names that `save_pretrained` writes."""
    zoo = zoos("mixtral")
    model = tmp_path / "stacked"
    shutil.copytree(zoo.model_dir, model)
    weights = load_file(model / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe"
        n = sum(1 for key in weights if key.startswith(f"{p}.experts.") and key.endswith(".w1.weight"))
        weights[f"model.layers.{layer}.mlp.gate.weight"] = weights.pop(f"{p}.gate.weight")
        weights[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([weights.pop(f"{p}.experts.{e}.w1.weight"), weights.pop(f"{p}.experts.{e}.w3.weight")])
            for e in range(n)])  # fmt: skip
        weights[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [weights.pop(f"{p}.experts.{e}.w2.weight") for e in range(n)])
    save_file(weights, model / "model.safetensors")
    assert _generate(str(model), str(zoo.adapters_dir), "a1") == _generate(
        str(zoo.model_dir), str(zoo.adapters_dir), "a1"), "both layouts decode the same tokens"


def _moe_adapter(zoo, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(base, lora).save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_lora_on_the_experts_is_refused_naming_it(zoos, tmp_path: Path, arch: str) -> None:
    zoo = zoos(arch)
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    folder = _moe_adapter(zoo, tmp_path / "experts")
    with pytest.raises(AdapterFormatError) as info:
        load_peft_adapter("experts", folder, shapes, max_rank=64)
    assert "target_parameters" in str(info.value) and "mlp.experts" in str(info.value), (
        f"PEFT's expert LoRA is refused naming the field and the experts: {info.value}")
    # an adapter of per-expert Linear modules (as PEFT wrote them before transformers 5)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(target_parameters=None, target_modules=["q_proj", "w1"])
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(folder / "adapter_model.safetensors").items() if "experts" not in k}
    expert = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    tensors[f"{expert}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{expert}.lora_B.weight"] = torch.zeros(128, 4)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError) as info:
        load_peft_adapter("experts", folder, shapes, max_rank=64)
    assert "experts.0.w1" in str(info.value) and "mixture-of-experts" in str(info.value), (
        f"per-expert LoRA is refused naming the module: {info.value}")
    served = load_peft_adapter("a1", zoo.adapters_dir / "a1", shapes, max_rank=64)
    assert served.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}, "attention LoRA loads"

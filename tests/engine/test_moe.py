"""The mixture-of-experts block and what MoE bases take and refuse.

`moe_experts` (grouped by expert) equals its one-token-at-a-time reference; the router follows each
family's rules (Mixtral renormalises the top k, Qwen3-MoE only with `norm_topk_prob`); a checkpoint
in transformers' stacked expert layout serves the same tokens as the per-expert one; LoRA on the
experts as PEFT 0.21 writes it (`target_parameters`, also when it converts per-expert
`target_modules`), and per-expert `experts.{e}.w1` tensors as PEFT wrote them before
transformers 5, load as each expert's PEFT delta, while LoRA on the router is refused naming it.
(Token parity with PEFT, expert LoRA included: tests/engine/test_family_parity.py.)
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
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.engine.model.moe import route
from lora_cluster.engine.model.moe_spec import MoeSpec
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


def _moe_adapter(zoo, out: Path, **targets) -> tuple[Path, object]:
    """A PEFT adapter on the zoo's model with random non-zero A and B (PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out, model


EXPERT_TARGETS = {
    "target_parameters": dict(target_modules=["q_proj"],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "gate_up_only": dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
    # per-expert names, which PEFT converts to target_parameters (gate and up at rank 2r, rank_pattern)
    "target_modules": dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"]),
}  # fmt: skip


@pytest.mark.parametrize("targets", list(EXPERT_TARGETS))
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_peft_expert_lora_loads_as_each_experts_delta(zoos, tmp_path: Path, arch: str, targets: str) -> None:
    """Every expert's scaled B_e @ A_e, as the loader splits PEFT's stacked tensors, equals the delta
    PEFT's ParamWrapper adds to that expert's slice of the stacked parameter."""
    from peft.tuners.lora.layer import ParamWrapper

    zoo = zoos(arch)
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    folder, peft_model = _moe_adapter(zoo, tmp_path / "experts", **EXPERT_TARGETS[targets])
    ours = load_peft_adapter("experts", folder, model.dims.shapes(), max_rank=64)
    wrappers = [(name, m) for name, m in peft_model.named_modules() if isinstance(m, ParamWrapper)]
    assert wrappers, f"PEFT wrote LoRA on the {arch} experts ({targets})"
    for name, wrapper in wrappers:
        layer = int(name.split("layers.")[1].split(".")[0])
        delta = wrapper.get_delta_weight("default")  # [E, out, in], as the stacked parameter
        for e in range(delta.shape[0]):
            key = (layer, f"experts.{e}.{wrapper.parameter_name}")
            mine = ours.scaling[key[1]] * ours.b[key] @ ours.a[key]
            torch.testing.assert_close(mine, delta[e], atol=1e-6, rtol=1e-5, msg=lambda m, k=key: (
                f"{arch} ({targets}) layer {k[0]} {k[1]}: the loaded delta is PEFT's: {m}"))
    assert "q_proj" in ours.target_modules, "attention LoRA loads beside the experts'"


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_lora_on_the_router_is_refused(zoos, tmp_path: Path, arch: str) -> None:
    zoo = zoos(arch)
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    folder, _ = _moe_adapter(zoo, tmp_path / "experts", **EXPERT_TARGETS["target_parameters"])
    config = json.loads((folder / "adapter_config.json").read_text())
    router = {**config, "target_parameters": ["mlp.gate.weight"]}
    (folder / "adapter_config.json").write_text(json.dumps(router))
    with pytest.raises(AdapterFormatError) as info:
        load_peft_adapter("router", folder, shapes, max_rank=64)
    assert "mlp.gate.weight" in str(info.value) and "router" in str(info.value), (
        f"LoRA on the router's parameter is refused naming it: {info.value}")
    # LoRA tensors on the router module (as PEFT wrote them before transformers 5)
    config.update(target_parameters=None, target_modules=["q_proj", "gate"])
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {k: v for k, v in load_file(folder / "adapter_model.safetensors").items() if "experts" not in k}
    gate = "base_model.model.model.layers.0.mlp.gate"
    tensors[f"{gate}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{gate}.lora_B.weight"] = torch.zeros(shapes.experts, 4)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError) as info:
        load_peft_adapter("router-module", folder, shapes, max_rank=64)
    assert "mlp.gate.lora_" in str(info.value) and "router" in str(info.value), (
        f"LoRA on the router module is refused naming the tensor: {info.value}")
    served = load_peft_adapter("a0", zoo.adapters_dir / "a0", shapes, max_rank=64)
    assert served.target_modules == {"q_proj", "v_proj"}, "attention-only LoRA loads"


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_per_expert_lora_of_transformers_4_loads_as_peft_converts_it(zoos, tmp_path: Path, arch: str) -> None:
    """Per-expert tensors (`block_sparse_moe.experts.{e}.w1/w3/w2`, `mlp.experts.{e}.gate_proj/...`)
    at rank 4: each expert's loaded delta equals the one PEFT 0.21 applies after converting the
    adapter to transformers 5's stacked experts (PEFT's conversion fails to load parts of unequal
    ranks, so only equal ones are compared)."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    zoo = zoos(arch)
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    names, block = (("w1", "w3", "w2"), "block_sparse_moe") if arch == "mixtral" else (
        ("gate_proj", "up_proj", "down_proj"), "mlp")
    width, hidden = shapes.expert_modules["down_proj"]
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for layer in range(shapes.num_layers):
        for e in range(shapes.experts):
            for name in names:
                i, o = (width, hidden) if name in ("w2", "down_proj") else (hidden, width)
                prefix = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, i, generator=g) * 0.1
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(o, 4, generator=g) * 0.1
    folder = tmp_path / "legacy"
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8,
        "target_modules": list(names), "base_model_name_or_path": str(zoo.model_dir),
        "task_type": "CAUSAL_LM", "lora_dropout": 0.0}))  # fmt: skip
    ours = load_peft_adapter("legacy", folder, shapes, max_rank=64)
    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, folder)
    wrappers = [(name, m) for name, m in peft_model.named_modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2 * shapes.num_layers, f"PEFT converts the {arch} per-expert LoRA to its wrappers"
    for name, wrapper in wrappers:
        layer = int(name.split("layers.")[1].split(".")[0])
        delta = wrapper.get_delta_weight("default")
        for e in range(shapes.experts):
            key = (layer, f"experts.{e}.{wrapper.parameter_name}")
            mine = ours.scaling[key[1]] * ours.b[key] @ ours.a[key]
            torch.testing.assert_close(mine, delta[e], atol=1e-6, rtol=1e-5, msg=lambda m, k=key: (
                f"{arch} layer {k[0]} {k[1]}: the joined per-expert delta is PEFT's: {m}"))


def test_a_linear_merge_of_expert_adapters_sums_each_experts_delta(zoos) -> None:
    """Merged adapters (LoRAX's merged_adapters) over LoRA on the experts: linear is each expert's
    exact weighted sum of deltas; ties / dare are refused naming the strategy."""
    from lora_cluster.errors import AdapterMergeError
    from lora_cluster.request.merge_spec import MergeSpec
    from lora_cluster.store.merge import merge

    zoo = zoos("qwen3moe")
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    adapters = [load_peft_adapter(a, zoo.adapters_dir / a, shapes, max_rank=64) for a in ("a0", "a1")]
    spec = MergeSpec.parse(["a0", "a1"], [0.5, 2.0], "linear", max_ids=4)
    merged = merge(spec, adapters, list(shapes.modules), adapter_id="merged/x", max_rank=64, seed=0)
    key = (1, "experts.3.gate_up_proj")
    want = 2.0 * adapters[1].scaling[key[1]] * adapters[1].b[key] @ adapters[1].a[key]
    got = merged.scaling[key[1]] * merged.b[key] @ merged.a[key]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5,
                               msg=lambda m: f"the merged expert delta is the weighted one: {m}")
    assert merged.module_rank("experts.down_proj") == 16, "the merged adapter keeps a1's expert rank"
    ties = MergeSpec.parse(["a0", "a1"], [0.5, 2.0], "ties", density=0.5, max_ids=4)
    with pytest.raises(AdapterMergeError, match="ties merge of LoRA on a mixture of experts"):
        merge(ties, adapters, list(shapes.modules), adapter_id="merged/y", max_rank=64, seed=0)


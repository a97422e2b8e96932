"""DoRA adapters (PEFT `use_dora=True`) are served token-exact with transformers + PEFT, mixed in
one batch with plain LoRA adapters and base-model rows.

Each DoRA adapter is written by PEFT itself (`get_peft_model` with `init_lora_weights=False`), then
its lora_B and magnitude vector are randomized, so the magnitude is not the identity. The batch
holds DoRA adapters of ranks 8 and 32 (attention and MLP targets, one rslora), the family zoo's
plain LoRA adapters and base rows, with chunked prefills, fewer slots than adapters and requests
that join while others decode. PEFT (one adapter active, or none) is run teacher-forced on the
engine's prompt + output: each engine token is PEFT's argmax and the logprobs and logits equal
PEFT's within 1e-4. The demo llama family, Qwen2 (attention biases, which DoRA's scale excludes)
and Phi-3 (fused `qkv_proj` / `gate_up_proj` targets split into slices) are covered. DoRA on a
module the engine does not serve it on is refused naming the adapter and DoRA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_peft, capture_logits, peft_logits, run_joining

from lora_cluster.adapter_format import load_peft_adapter
from lora_cluster.demo_families import build_family_zoo
from lora_cluster.engine import SamplingParams, build_engine
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import AdapterFormatError, AdapterMergeError
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.store.host_cache import HostCache
from lora_cluster.store.merge import merge

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [
    "the quick brown fox jumps over the lazy dog near the river",
    "a long story begins when the morning light falls over the quiet river and the town",
    "one two three four five six seven eight nine ten",
]
NEW_TOKENS = 10
TOL = 1e-4
TOP = 3
_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip
# DoRA adapters: (id, rank, alpha, targets, rslora)
DORA = [("d8", 8, 16, ["q_proj", "v_proj", "down_proj"], False),
        ("d32", 32, 16, _ATTN + _MLP, True)]  # fmt: skip


def write_dora_adapter(model_dir: Path, out: Path, *, r: int, alpha: int, targets: list[str],
                       rslora: bool = False, seed: int = 0) -> Path:  # fmt: skip
    """A DoRA adapter written by PEFT on `model_dir`, with random lora_B and a magnitude vector that
    is not the weight norm (so DoRA's scale is not the identity)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_dora=True, use_rslora=rslora,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def zoos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dora")


def _zoo(root: Path, arch: str):
    """The family's zoo (2 plain LoRA adapters) with the `DORA` adapters added to its adapter folder."""
    zoo = build_family_zoo(root / arch, arch, num_adapters=2)
    fused = arch == "phi3"
    for i, (aid, r, alpha, targets, rslora) in enumerate(DORA):
        if not (zoo.adapters_dir / aid).exists():
            names = sorted({_FUSED.get(t, t) for t in targets}) if fused else targets
            write_dora_adapter(zoo.model_dir, zoo.adapters_dir / aid, r=r, alpha=alpha, targets=names,
                               rslora=rslora, seed=i)
    return zoo


def _peft(zoo, adapter_ids: list[str]) -> object:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, zoo.adapters_dir / adapter_ids[0], adapter_name=adapter_ids[0])
    for adapter_id in adapter_ids[1:]:
        model.load_adapter(zoo.adapters_dir / adapter_id, adapter_name=adapter_id)
    return model.eval()


@pytest.mark.parametrize(("arch", "kernels"), [
    ("llama3", {}), ("llama3", {"lora_decode_kernel": "bgmv", "lora_fused_shrink": True}), ("qwen2", {}),
    ("phi3", {}),
], ids=["llama3", "llama3-bgmv-fused", "qwen2", "phi3"])
def test_dora_and_lora_mixed_batch_matches_peft(arch: str, kernels: dict, zoos: Path) -> None:
    zoo = _zoo(zoos, arch)
    adapter_ids = [DORA[0][0], *zoo.adapter_ids, DORA[1][0]]
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_loras=3,
                          max_lora_rank=32, max_num_seqs=8, max_num_batched_tokens=24, **kernels)
    captured = capture_logits(engine)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    requests = [(f"r{i}", PROMPTS[i % len(PROMPTS)], aid) for i, aid in enumerate([None, *adapter_ids, None])]
    try:
        finals = run_joining(engine, requests, sampling, first=4, steps_before=4)
    finally:
        engine.close()

    model = _peft(zoo, adapter_ids)
    for rid, _prompt, aid in requests:
        assert_matches_peft(model, aid, finals[rid], captured[rid], NEW_TOKENS, TOL, f"{arch} {rid} ({aid})")
    for aid in (d[0] for d in DORA):
        ids = finals[next(r for r, _, a in requests if a == aid)]
        full = ids.prompt_token_ids + ids.token_ids
        with_dora = peft_logits(model, aid, full)
        for layer in model.modules():  # the same adapter without DoRA's scale: plain LoRA
            variants = getattr(layer, "lora_variant", None)
            if isinstance(variants, dict):
                variants.pop(aid, None)
        assert (with_dora - peft_logits(model, aid, full)).abs().max() > 100 * TOL, (
            f"{arch} {aid}: the magnitude changes the logits (the comparison is not vacuous)")


def test_a_dora_adapter_loads_from_a_folder_with_its_magnitudes(zoos: Path) -> None:
    zoo = _zoo(zoos, "phi3")
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    weights = load_peft_adapter("d32", zoo.adapters_dir / "d32", model.dims.shapes(), max_rank=32)
    assert set(weights.magnitude) == set(weights.a), "every DoRA module has its magnitude vector"
    out = model.dims.shapes().modules["k_proj"][1]
    assert weights.magnitude[(0, "k_proj")].shape == (out,), "the fused qkv magnitude splits into k's rows"


def test_dora_served_end_to_end_from_the_adapter_store(zoos: Path) -> None:
    zoo = _zoo(zoos, "llama3")
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_lora_rank=32)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        outs = engine.generate([PROMPTS[0]] * 2, adapter_ids=["d8", None], sampling=sampling)
    finally:
        engine.close()
    assert [len(o.token_ids) for o in outs] == [4, 4], "the DoRA request and the base request both decode"


def test_dora_on_embeddings_is_refused_naming_the_adapter(zoos: Path, tmp_path: Path) -> None:
    zoo = _zoo(zoos, "llama3")
    write_dora_adapter(zoo.model_dir, tmp_path / "adapters" / "emb", r=4, alpha=8,
                       targets=["embed_tokens", "q_proj"])
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(tmp_path / "adapters"),
                          max_lora_rank=8)
    try:
        with pytest.raises(AdapterFormatError) as info:
            engine.generate(["hello"], adapter_ids=["emb"])
    finally:
        engine.close()
    assert "emb" in str(info.value), "the error names the adapter"
    assert "DoRA" in str(info.value), f"the error names DoRA: {info.value}"


def test_dora_on_experts_is_refused_naming_the_adapter(zoos: Path, tmp_path: Path) -> None:
    zoo = build_family_zoo(zoos / "qwen3moe", "qwen3moe", num_adapters=1)
    folder = tmp_path / "moe-dora"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).write_bytes((zoo.adapters_dir / "a0" / name).read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(use_dora=True, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    (folder / "adapter_config.json").write_text(json.dumps(config))
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(AdapterFormatError) as info:
        load_peft_adapter("moe-dora", folder, model.dims.shapes(), max_rank=64)
    assert "moe-dora" in str(info.value), "the error names the adapter"
    assert "DoRA" in str(info.value) and "experts" in str(info.value), f"the error says why: {info.value}"


def test_the_memory_plan_counts_the_dora_scale_of_every_slot(zoos: Path) -> None:
    zoo = _zoo(zoos, "llama3")
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir), max_loras=3,
                          max_lora_rank=8)
    try:
        pool, planned = engine.pool, engine.memory.adapter_pool_bytes
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*pool.a.values(), *pool.b.values(), *pool.dora.values())}  # fmt: skip
        zero_row = sum(t[:, -1].numel() * t.element_size() for t in pool.dora.values())
    finally:
        engine.close()
    assert pool.nbytes == sum(storages.values()), "the pool reports every byte it holds, DoRA scale included"
    assert sum(storages.values()) == planned + zero_row, (
        "the plan counts every slot's A, B and DoRA scale (the pool adds one zero row of DoRA scale)")


def test_an_int8_host_copy_keeps_the_dora_magnitudes(zoos: Path) -> None:
    zoo = _zoo(zoos, "llama3")
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    weights = load_peft_adapter("d8", zoo.adapters_dir / "d8", model.dims.shapes(), max_rank=32)
    cache = HostCache(1 << 30, int8=True)
    assert cache.put(weights, reload_cost_s=1.0), "the int8 host tier admits the DoRA adapter"
    back = cache.get("d8")
    assert back is not None and back.magnitude.keys() == weights.magnitude.keys(), (
        "the int8 host copy keeps every magnitude vector (else DoRA would be served as plain LoRA)")
    assert all(torch.equal(back.magnitude[k], t) for k, t in weights.magnitude.items()), (
        "the magnitudes come back exactly (they are not quantized)")


def test_merging_a_dora_adapter_is_refused_naming_it(zoos: Path) -> None:
    zoo = _zoo(zoos, "llama3")
    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    adapters = [load_peft_adapter(a, zoo.adapters_dir / a, shapes, max_rank=32) for a in ("d8", "a0")]
    spec = MergeSpec.parse(["d8", "a0"], [0.5, 0.5], max_ids=4)
    with pytest.raises(AdapterMergeError) as info:
        merge(spec, adapters, list(shapes.modules), adapter_id=spec.adapter_id, max_rank=64, seed=0)
    assert "d8" in str(info.value) and "DoRA" in str(info.value), f"the error names d8 and DoRA: {info.value}"

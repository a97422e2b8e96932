"""The demo model zoo: deterministic, reusable, and loadable by transformers and peft as is."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lora_cluster import demo
from lora_cluster.cli import main
from lora_cluster.demo import RANKS, TARGET_SETS, DemoZoo, build_demo_zoo


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _load_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], f"transformers loads the demo checkpoint exactly, not with {key}: {info[key]}"
    return model.eval()


def test_same_seed_same_bytes_other_seed_other_weights(demo_zoo: DemoZoo, tmp_path: Path) -> None:
    again = build_demo_zoo(tmp_path / "again", num_adapters=16, size="tiny", seed=0)
    ours, theirs = _files(demo_zoo.model_dir.parent), _files(again.model_dir.parent)
    assert ours.keys() == theirs.keys(), "the same arguments write the same set of files"
    different = [name for name in ours if ours[name] != theirs[name]]
    assert all(name.endswith("adapter_config.json") for name in different), (
        f"only adapter configs (which record the model's absolute path) differ between builds: {different}"
    )
    config = "adapters/a3/adapter_config.json"
    assert json.loads(theirs[config])["base_model_name_or_path"] == str(again.model_dir), (
        "an adapter config points at its own zoo's model folder"
    )
    moved = {**json.loads(theirs[config]), "base_model_name_or_path": str(demo_zoo.model_dir)}
    assert json.loads(ours[config]) == moved, "adapter configs differ in the model path only"
    other = build_demo_zoo(tmp_path / "other", num_adapters=2, seed=1)
    model = "model/model.safetensors"
    assert _files(other.model_dir.parent)[model] != ours[model], "another seed gives other model weights"
    assert (other.model_dir / "tokenizer.json").read_bytes() == ours["model/tokenizer.json"], (
        "the tokenizer does not depend on the seed"
    )


def test_adapters_do_not_depend_on_the_zoo_size(demo_zoo: DemoZoo, tmp_path: Path) -> None:
    small = build_demo_zoo(tmp_path / "small", num_adapters=2)
    assert small.adapter_ids == ["a0", "a1"], "a zoo of 2 adapters holds a0 and a1"
    for name in ("model/model.safetensors", "adapters/a1/adapter_model.safetensors"):
        same = (small.model_dir.parent / name).read_bytes() == (demo_zoo.model_dir.parent / name).read_bytes()
        assert same, f"{name} is the same in a 2-adapter and a 16-adapter zoo"


def test_matching_manifest_is_a_no_op_and_a_mismatch_rebuilds(demo_zoo: DemoZoo, tmp_path: Path) -> None:
    weights = demo_zoo.model_dir / "model.safetensors"
    before = weights.stat()
    assert build_demo_zoo(demo_zoo.model_dir.parent, num_adapters=16, size="tiny", seed=0) == demo_zoo, (
        "rebuilding with a matching manifest returns the same zoo"
    )
    assert weights.stat().st_mtime_ns == before.st_mtime_ns, "a matching manifest does not rewrite weights"
    assert weights.stat().st_ino == before.st_ino, "a matching manifest leaves the weights file in place"

    out = tmp_path / "zoo"
    build_demo_zoo(out, num_adapters=1)
    zoo = build_demo_zoo(out, num_adapters=3)
    assert sorted(p.name for p in zoo.adapters_dir.iterdir()) == ["a0", "a1", "a2"], (
        "a mismatching manifest rebuilds the zoo with the new adapter count"
    )
    assert json.loads((out / "manifest.json").read_text())["num_adapters"] == 3, (
        "the rebuilt zoo's manifest records the new adapter count"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo"], "a rebuild leaves no temporary folder"


def test_interrupted_build_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(tmp: Path, *args: object) -> None:
        (tmp / "model").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_write_zoo", crash)
    with pytest.raises(KeyboardInterrupt):
        build_demo_zoo(tmp_path / "zoo", num_adapters=1)
    assert list(tmp_path.iterdir()) == [], "an interrupted build leaves no zoo and no temporary folder"


def test_refuses_to_overwrite_a_folder_that_is_not_a_zoo(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        build_demo_zoo(tmp_path, num_adapters=1)
    assert (tmp_path / "notes.txt").read_text() == "mine", "the refused folder's files are left untouched"


def test_cli_demo_prints_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "zoo"
    assert main(["demo", "--out", str(out), "--num-adapters", "2", "--size", "tiny", "--seed", "3"]) == 0, (
        "`demo` exits with status 0"
    )
    printed = capsys.readouterr().out
    assert f"model: {out / 'model'}" in printed, "`demo` prints the model folder"
    assert f"adapters: {out / 'adapters'}" in printed, "`demo` prints the adapters folder"
    assert json.loads((out / "manifest.json").read_text())["seed"] == 3, "the manifest records --seed"
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(out), "--size", "huge"])


def test_transformers_loads_model_and_tokenizer(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = _load_model(demo_model_dir)
    cfg = model.config
    assert cfg.model_type == "llama", "the demo model is a llama model"
    assert cfg.architectures == ["LlamaForCausalLM"], "the demo model loads as LlamaForCausalLM"
    assert cfg.hidden_size == 64, "the tiny model has hidden size 64"
    assert cfg.num_hidden_layers == 2, "the tiny model has 2 layers"
    assert cfg.intermediate_size == 128, "the tiny model has MLP size 128"
    assert cfg.num_attention_heads == 4, "the tiny model has 4 attention heads"
    assert cfg.num_key_value_heads == 2, "the tiny model has 2 KV heads (grouped-query attention)"
    assert cfg.max_position_embeddings == 512, "the tiny model has 512 positions"
    assert cfg.vocab_size == len(tokenizer), "the model's vocabulary is the tokenizer's"
    assert not cfg.tie_word_embeddings, "input and output embeddings are separate weights"
    assert tokenizer.bos_token == "<s>", "the BOS token is <s>"
    assert tokenizer.eos_token_id == cfg.eos_token_id, "tokenizer and model agree on the EOS token"

    text = "The quick farmer from Kalotown wanders slowly, 42 times! Ünïcode ✓"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id, "encoding prepends the BOS token"
    assert tokenizer.decode(ids, skip_special_tokens=True) == text, "decoding gives back the text exactly"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n", (
        "the chat template renders roles as <|role|> lines closed by </s>"
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)), "the model gives one logit row per token"
    assert torch.isfinite(logits).all(), "the model's logits are finite"


def test_peft_loads_adapters_and_they_change_the_output(demo_zoo: DemoZoo) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_zoo.model_dir)
    ids = tokenizer("Please mend the lantern before 9 o'clock!", return_tensors="pt").input_ids

    def greedy(model: torch.nn.Module) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    model = _load_model(demo_zoo.model_dir)
    with torch.no_grad():
        base_logits = model(ids).logits
    base_tokens = greedy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*")
        peft_model = PeftModel.from_pretrained(model, demo_zoo.adapters_dir / "a0", adapter_name="a0")
        for adapter_id in demo_zoo.adapter_ids[1:]:
            result = peft_model.load_adapter(demo_zoo.adapters_dir / adapter_id, adapter_name=adapter_id)
            assert not result.unexpected_keys, f"{adapter_id} has no keys peft does not expect"
            missing_lora = [k for k in result.missing_keys if "lora_" in k]
            assert not missing_lora, f"peft finds all LoRA weights of {adapter_id}, missing {missing_lora}"
    changed = 0
    for adapter_id in demo_zoo.adapter_ids:
        peft_model.set_adapter(adapter_id)
        with torch.no_grad():
            assert not torch.allclose(peft_model(ids).logits, base_logits, atol=1e-3), (
                f"adapter {adapter_id} changes the logits"
            )
        changed += greedy(peft_model) != base_tokens
    assert changed >= 14, f"only {changed} of 16 adapters change the greedy output"
    with peft_model.disable_adapter():
        assert greedy(peft_model) == base_tokens, "with the adapters disabled peft generates the base tokens"


def test_adapter_config_is_what_peft_writes(demo_adapters_dir: Path) -> None:
    from peft import LoraConfig

    for adapter_id in ("a0", "a7"):
        written = json.loads((demo_adapters_dir / adapter_id / "adapter_config.json").read_text())
        expected = LoraConfig.from_pretrained(demo_adapters_dir / adapter_id).to_dict()
        expected["target_modules"] = sorted(expected["target_modules"])
        assert written == expected, f"{adapter_id}'s config is what peft's LoraConfig round-trips to"


def test_rank_and_target_module_mix(demo_zoo: DemoZoo) -> None:
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    ranks, target_sets, rslora = set(), set(), 0
    for adapter_id in demo_zoo.adapter_ids:
        cfg = json.loads((demo_zoo.adapters_dir / adapter_id / "adapter_config.json").read_text())
        r, targets = cfg["r"], cfg["target_modules"]
        assert cfg["peft_type"] == "LORA", f"{adapter_id} is a LoRA adapter"
        assert cfg["task_type"] == "CAUSAL_LM", f"{adapter_id} is for causal LM"
        assert cfg["lora_dropout"] == 0.0, f"{adapter_id} has no dropout"
        assert cfg["lora_alpha"] in (r, 2 * r), f"{adapter_id}'s alpha is r or 2r"
        ranks.add(r)
        target_sets.add(frozenset(targets))
        rslora += cfg["use_rslora"]
        expected = {}
        for layer in range(2):
            for name in targets:
                kind = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix, (n_out, n_in) = f"base_model.model.model.layers.{layer}.{kind}.{name}", shapes[name]
                expected |= {f"{prefix}.lora_A.weight": [r, n_in], f"{prefix}.lora_B.weight": [n_out, r]}
        with safe_open(demo_zoo.adapters_dir / adapter_id / "adapter_model.safetensors", "pt") as f:
            assert {k: f.get_slice(k).get_shape() for k in f.keys()} == expected, (  # noqa: SIM118
                f"{adapter_id} holds exactly the A and B weights of its targets, in peft's names and shapes"
            )
            assert all(f.get_tensor(k).abs().sum() > 0 for k in f.keys()), (  # noqa: SIM118
                f"none of {adapter_id}'s weights is all zero"
            )
    assert ranks == set(RANKS), "the zoo uses every rank of RANKS"
    assert target_sets == {frozenset(t) for t in TARGET_SETS}, "the zoo uses every target set of TARGET_SETS"
    assert rslora == 2, "two of the 16 adapters use rsLoRA scaling"


def test_base_size_has_about_100m_parameters() -> None:
    from transformers import LlamaForCausalLM

    vocab = len(demo.train_tokenizer("base"))
    assert 7000 <= vocab <= 8000, f"the base tokenizer's vocabulary is 7000-8000 tokens, not {vocab}"
    with torch.device("meta"):
        model = LlamaForCausalLM(demo.model_config("base", vocab))
    params = sum(p.numel() for p in model.parameters())
    assert 80e6 < params < 110e6, f"the base model has 80M-110M parameters, not {params}"


def test_1b_size_has_llama_3_2_1b_decoder_dims() -> None:
    from transformers import LlamaForCausalLM

    config = demo.model_config("1b", 8000)
    dims = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size)  # fmt: skip
    assert dims == (2048, 16, 32, 8, 8192), f"Llama-3.2-1B's decoder dims, not {dims}"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < params < 1.1e9, f"the 1b model has about 1.0B parameters, not {params}"

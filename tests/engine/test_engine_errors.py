"""Bad input: each case raises a domain error naming the adapter (or request) and the limit, and the
engine keeps serving the other requests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import GREEDY
from safetensors.torch import load_file, save_file

from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    PromptTooLongError,
    RequestError,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def bad_adapters(demo_adapters_dir: Path, tmp_path_factory) -> Path:
    """A source folder holding good adapters and one broken adapter per failure mode."""
    root = tmp_path_factory.mktemp("bad_adapters")
    for aid in ("a0", "a2"):
        shutil.copytree(demo_adapters_dir / aid, root / aid)
    # wrong shapes: lora_A of q_proj gets an in_features the model does not have
    shutil.copytree(demo_adapters_dir / "a0", root / "wrong-shape")
    weights = load_file(str(root / "wrong-shape" / "adapter_model.safetensors"))
    key = next(k for k in weights if "q_proj.lora_A" in k)
    weights[key] = torch.randn(weights[key].shape[0], weights[key].shape[1] + 3)
    save_file(weights, str(root / "wrong-shape" / "adapter_model.safetensors"))
    # corrupt safetensors: truncated
    shutil.copytree(demo_adapters_dir / "a0", root / "corrupt")
    path = root / "corrupt" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # pickle weights only
    (root / "pickled").mkdir()
    shutil.copy(demo_adapters_dir / "a0" / "adapter_config.json", root / "pickled")
    (root / "pickled" / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    # unsupported target module
    shutil.copytree(demo_adapters_dir / "a0", root / "lm-head")
    weights = load_file(str(root / "lm-head" / "adapter_model.safetensors"))
    weights["base_model.model.lm_head.lora_A.weight"] = torch.randn(8, 64)
    save_file(weights, str(root / "lm-head" / "adapter_model.safetensors"))
    return root


@pytest.fixture(scope="module")
def engine(make_engine, bad_adapters: Path) -> Engine:
    # a2 has rank 32: above this engine's max_lora_rank
    return make_engine(adapter_source=str(bad_adapters), max_loras=2, max_lora_rank=16)


@pytest.mark.parametrize(
    ("adapter_id", "error", "words"),
    [
        ("a2", AdapterRankError, ["'a2'", "rank 32", "max_lora_rank=16"]),
        ("wrong-shape", AdapterShapeError, ["'wrong-shape'", "q_proj", "in_features=64"]),
        ("missing", AdapterNotFoundError, ["'missing'", "not found"]),
        ("corrupt", AdapterFormatError, ["'corrupt'", "corrupt"]),
        ("pickled", AdapterFormatError, ["'pickled'", "pickle"]),
        ("lm-head", AdapterFormatError, ["'lm-head'", "not a LoRA weight of a supported projection"]),
        ("../a0", AdapterNotFoundError, ["invalid adapter id"]),
    ],
)
def test_bad_adapter_fails_alone(engine: Engine, adapter_id: str, error: type, words: list[str]):
    with pytest.raises(error) as info:
        engine.generate(["hello"], adapter_ids=[adapter_id], sampling=GREEDY)
    for word in words:
        assert word in str(info.value), f"the error message names {word!r}"
    assert getattr(info.value, "adapter_id", None) is not None, "the error carries the adapter id"
    # the same bad adapter in a running batch fails only its own request
    engine.add_request("good-base", "the quick brown fox", None, GREEDY)
    engine.add_request("good-lora", "the quick brown fox", "a0", GREEDY)
    if adapter_id != "../a0":
        engine.add_request("bad", "the quick brown fox", adapter_id, GREEDY)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["good-base"].finish_reason == "length", "a base request next to a bad adapter completes"
    assert finals["good-lora"].finish_reason == "length", "a good adapter next to a bad adapter completes"
    assert len(finals["good-lora"].token_ids) == 8, "a good adapter next to a bad one gets all its tokens"
    if adapter_id != "../a0":
        assert finals["bad"].finish_reason == "error", "the request with the bad adapter ends with 'error'"
        assert isinstance(finals["bad"].error, error), "the failed request carries the adapter's error"


def test_rank_error_names_limit(engine: Engine):
    with pytest.raises(AdapterRankError) as info:
        engine.load_adapter("a2")
    assert info.value.rank == 32, "the rank error names the adapter's rank"
    assert info.value.max_rank == 16, "the rank error names the engine's max_lora_rank"


def test_prompt_too_long_names_limit(engine: Engine):
    with pytest.raises(PromptTooLongError) as info:
        engine.add_request("long", [5] * engine.max_model_len, None, GREEDY)
    assert info.value.limit == engine.max_model_len - 1, "the limit leaves room for one new token"
    assert str(engine.max_model_len - 1) in str(info.value), "the error message names the limit"


@pytest.mark.parametrize(
    "kwargs",
    [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -5}, {"seed": -1}],
)
def test_bad_sampling_params(kwargs: dict):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_bad_token_ids_and_duplicates(engine: Engine):
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("ids", [1, 10**9], None, GREEDY)
    engine.add_request("dup", "hi", None, GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", "hi", None, GREEDY)
    engine.abort("dup")


def test_unsupported_architecture(demo_model_dir: Path, tmp_path: Path):
    model = tmp_path / "gpt2ish"
    shutil.copytree(demo_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        build_engine(model=str(model))
    assert "GPT2LMHeadModel" in str(info.value), "the error names the unsupported architecture"
    assert "LlamaForCausalLM" in str(info.value), "the error names the supported architecture"

"""Families end to end: `serve run`'s app on a tiny checkpoint of a family serves its PEFT adapters
through the OpenAI API with transformers + PEFT's greedy tokens.

One Ray app for every family, a replica group per family with its base model (conftest's `bases_app`,
shared with test_multi_base_e2e.py and test_tool_calls_e2e.py: `shared_apps.bases_config`; each family's
adapters are served as `<arch>-a<i>`): Phi-3 (fused checkpoint projections, adapters on the fused names,
sliding window, partial rotary) and Gemma 2 (sandwich norms, soft-capping, alternating sliding windows),
Mixtral (a mixture of experts with attention adapters). Every family's engine parity is
tests/engine/test_family_parity.py; this is the serving path around it.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from shared_apps import FAMILIES

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog near the river and the town"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def http(bases_app):
    with httpx.Client(base_url=bases_app, timeout=120) as client:
        yield client


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, bases_zoos, http):
    arch = request.param
    return arch, bases_zoos.families[arch], http


def _peft_greedy(zoo, adapter_id: str | None, ids: list[int]) -> list[int]:
    """transformers + PEFT's greedy continuation of `ids` (NEW_TOKENS tokens, EOS not stopping it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo.model_dir, dtype=torch.float32)
    if adapter_id is not None:
        model = PeftModel.from_pretrained(model, zoo.adapters_dir / adapter_id)
    out = model.eval().generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=3)
    return out[0, len(ids):].tolist()


def test_models_lists_the_family_base_and_its_adapters(family):
    arch, zoo, http = family
    parents = {m["id"]: m["parent"] for m in http.get("/v1/models").json()["data"]}
    assert parents.get(str(zoo.model_dir), "missing") is None, f"{arch}: /v1/models lists the base model"
    assert all(parents.get(a) == str(zoo.model_dir) for a in zoo.adapter_ids), (
        f"{arch}: /v1/models lists the family's adapters, under the family's base")


@pytest.mark.parametrize("adapter", [None, "a1", "a2"])
def test_completions_are_peft_greedy_tokens(family, adapter):
    from transformers import AutoTokenizer

    arch, zoo, http = family
    adapter_id = None if adapter is None else f"{arch}-{adapter}"
    body = {"model": adapter_id or str(zoo.model_dir), "prompt": PROMPT, "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, f"{arch} ({adapter_id}): the completion succeeds: {r.text}"
    tokenizer = AutoTokenizer.from_pretrained(zoo.model_dir)
    ids = tokenizer(PROMPT).input_ids
    want = tokenizer.decode(_peft_greedy(zoo, adapter_id, ids), skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == want, f"{arch} ({adapter_id}): the text is PEFT's greedy text"


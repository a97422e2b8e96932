"""Several base models in one cluster, end to end: one `serve run`-equivalent Ray app with a replica
group per base (conftest's `bases_app`, shared with test_family_serve_e2e.py and
test_tool_calls_e2e.py: `shared_apps.bases_config`), `llama` on the tiny demo Llama (its adapters
a0..a15) and `qwen` on a tiny Qwen3 checkpoint (its adapters q0, q1 from its own adapter source), then
the Phi-3, Gemma 2 and Mixtral groups, each group naming its own `model`. The Llama and Qwen3 bases
tokenize differently: the Qwen3 checkpoint's tokenizer gives every piece another id and has another
chat template (`other_tokenizer`), so the ingress must encode and template each request with its own
base's tokenizer for the texts below to match.

What must hold: /v1/models lists every base, each followed by its adapters with `parent` set to it; a
request's `model` (a base name or an adapter id) runs on that base, with transformers + PEFT's greedy
text for that base, for completions and chats (each rendered with its base's chat template); an
adapter of the Qwen3 base registered where the Llama base serves it is refused (a 400 naming the
adapter, the base it was trained for and the base that refused it, never a server path), and the
Llama base keeps serving; `/v1/cluster` names each replica's base.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from shared_apps import FAMILIES, LLAMA, QWEN, QWEN_ADAPTERS

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog near the river and the town"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def qwen_zoo(bases_zoos):
    """The tiny Qwen3 checkpoint in a folder named `qwen3-tiny`, with a tokenizer of its own, and its PEFT
    adapters as q0, q1 declaring `org/qwen3-tiny` as their base (`shared_apps.build_bases`)."""
    return bases_zoos.qwen_model, bases_zoos.qwen_adapters


@pytest.fixture(scope="module")
def http(bases_app):
    with httpx.Client(base_url=bases_app, timeout=120) as client:
        yield client


def _peft_text(model_dir, adapter_dir, tokenizer, ids: list[int] | None = None) -> str:
    """transformers + PEFT's greedy continuation of `ids` (default: PROMPT's; NEW_TOKENS tokens, EOS
    not stopping it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    ids = tokenizer(PROMPT).input_ids if ids is None else ids
    out = model.eval().generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=3)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_models_lists_every_base_each_with_its_adapters(http, demo_zoo, bases_zoos):
    data = http.get("/v1/models").json()["data"]
    parents = {m["id"]: m["parent"] for m in data}
    bases = [m["id"] for m in data if m["parent"] is None]
    families = [str(bases_zoos.families[arch].model_dir) for arch in FAMILIES]
    assert bases == [LLAMA, QWEN, *families], "/v1/models lists every base, in group order"
    assert all(parents.get(a) == QWEN for a in QWEN_ADAPTERS), "the Qwen3 adapters' parent is the Qwen3 base"
    assert all(parents.get(a) == LLAMA for a in demo_zoo.adapter_ids), "the demo adapters' parent is Llama"


@pytest.mark.parametrize(("model", "adapter"), [
    (LLAMA, None), ("a1", "a1"), ("a3", "a3"), (QWEN, None), ("q0", "q0"), ("q1", "q1")])
def test_each_bases_requests_answer_peft_greedy_text_for_that_base(http, demo_zoo, qwen_zoo, model, adapter):
    from transformers import AutoTokenizer

    qwen = model == QWEN or model.startswith("q")
    model_dir = qwen_zoo[0] if qwen else demo_zoo.model_dir
    adapter_dir = None if adapter is None else (qwen_zoo[1] if qwen else demo_zoo.adapters_dir) / adapter
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, f"{model}: the completion succeeds: {r.text}"
    want = _peft_text(model_dir, adapter_dir, AutoTokenizer.from_pretrained(model_dir))
    assert r.json()["choices"][0]["text"] == want, f"{model}: the text is PEFT's greedy text on its base"


def test_the_two_bases_tokenize_differently(demo_zoo, qwen_zoo):
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(demo_zoo.model_dir)
    qwen = AutoTokenizer.from_pretrained(qwen_zoo[0])
    assert llama(PROMPT).input_ids != qwen(PROMPT).input_ids, "the prompt encodes to other ids on each base"
    assert llama.chat_template != qwen.chat_template, "each base has its own chat template"


@pytest.mark.parametrize("model", ["a1", "q0"])
def test_each_bases_chats_are_rendered_with_its_template_and_answer_peft_greedy_text(http, demo_zoo, qwen_zoo,
                                                                                     model):
    from transformers import AutoTokenizer

    model_dir, adapters = (qwen_zoo[0], qwen_zoo[1]) if model.startswith("q") else (
        demo_zoo.model_dir, demo_zoo.adapters_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, f"{model}: the chat succeeds: {r.text}"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids), f"{model}: the prompt is its base's rendering"
    want = _peft_text(model_dir, adapters / model, tokenizer, ids)
    assert r.json()["choices"][0]["message"]["content"] == want, (
        f"{model}: the answer is PEFT's greedy text for its base's chat template")


def test_an_adapter_of_the_other_base_is_refused_where_it_is_registered(http, qwen_zoo):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "misplaced",
                                                 "lora_path": str(qwen_zoo[1] / "q0")})
    assert r.status_code == 400, f"a Qwen3 adapter registered on the Llama base is refused: {r.text}"
    message = r.json()["error"]["message"]
    assert "'misplaced'" in message, "the refusal names the adapter"
    assert QWEN in message, "the refusal names the base the adapter was trained for"
    assert LLAMA in message, "the refusal names the base that refused it"
    assert str(qwen_zoo[1]) not in message, "the refusal shows no server path"
    ok = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, "the Llama base keeps serving after the refusal"


def test_the_cluster_view_names_each_replicas_base(http, bases_zoos):
    view = http.get("/v1/cluster").json()
    bases = {name: {r["base"] for node in group["nodes"].values() for r in node["replicas"].values()}
             for name, group in view["groups"].items()}
    families = {arch: {str(zoo.model_dir)} for arch, zoo in bases_zoos.families.items()}
    assert bases == {"llama": {LLAMA}, "qwen": {QWEN}, **families}, "each group's replicas report their base"

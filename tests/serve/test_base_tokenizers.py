"""Several base models whose tokenizers differ, in the ingress without Ray: each request is encoded,
templated and detokenized with the tokenizer of the base it runs on.

Two replica groups: `llama` on the tiny demo checkpoint (the demo tokenizer) and `qwen` on a copy of
it whose tokenizer gives every piece another id and has another chat template (`other_tokenizer`).
The ingress's FastAPI app runs in process (`app_client.serving`) over a `GroupedDispatcher` whose two
groups are fake replicas recording the jobs they are sent. The Ray app of two bases with different
tokenizers is tests/serve/test_multi_base_e2e.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from app_client import FakeDispatcher, serving
from other_tokenizer import write_other_tokenizer

from lora_cluster.config import ServeConfig, load_config
from lora_cluster.engine import SamplingParams
from lora_cluster.errors import ConfigError
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.replica.model import load_tokenizers
from lora_cluster.serve.routing.group_bases import group_configs
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.replica_groups import replica_groups

TEXT = "the quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the river"}]


class GroupReplicas(FakeDispatcher):
    """One group's replicas: list `adapters`, answer as FakeDispatcher does, record every job."""

    def __init__(self, adapters: list[str]):
        super().__init__()
        self.adapters = adapters

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        return list(self.adapters) if method == "list_adapters" else "r1"


def _two_bases(llama: Path, qwen: Path) -> ServeConfig:
    """Group `llama` on the top-level model `llama`, group `qwen` on the base `qwen3`."""
    groups = [{"name": "llama"}, {"name": "qwen", "model": str(qwen), "served_model_name": "qwen3"}]
    return load_config({"model": str(llama), "served_model_name": "llama", "replica_groups": groups})


@pytest.fixture(scope="module")
def cluster(demo_zoo, tmp_path_factory) -> tuple[ServeConfig, dict[str, Any]]:
    """The two-base configuration and each base's tokenizer by API name, loaded as the ingress does."""
    other = tmp_path_factory.mktemp("other-base") / "qwen3-tiny"
    shutil.copytree(demo_zoo.model_dir, other)
    write_other_tokenizer(other)
    config = _two_bases(demo_zoo.model_dir, other)
    return config, load_tokenizers(group_configs(config))


@pytest.fixture
async def api(cluster):
    config, tokenizers = cluster
    llama, qwen = GroupReplicas(["a0", "a1"]), GroupReplicas(["q0", "q1"])
    dispatcher = GroupedDispatcher(list(zip(replica_groups(config), [llama, qwen], strict=True)))
    async with serving(tokenizers["llama"], dispatcher, config, tokenizers=tokenizers) as client:
        yield client, llama, qwen


def test_the_two_bases_tokenize_differently(cluster):
    _, tokenizers = cluster
    assert set(tokenizers) == {"llama", "qwen3"}, "one tokenizer per base, by the base's API name"
    llama, qwen = tokenizers["llama"], tokenizers["qwen3"]
    assert llama.encode(TEXT) != qwen.encode(TEXT), "the same text encodes to other ids on each base"
    assert llama.chat_template != qwen.chat_template, "each base has its own chat template"


@pytest.mark.parametrize(("model", "base"), [("llama", "llama"), ("a1", "llama"), ("qwen3", "qwen3"),
                                             ("q0", "qwen3")])
async def test_a_completion_is_encoded_with_its_bases_tokenizer(api, cluster, model, base):
    client, llama, qwen = api
    r = await client.post("/v1/completions", json={"model": model, "prompt": TEXT, "max_tokens": 2})
    assert r.status_code == 200, f"{model}: the completion succeeds: {r.text}"
    replicas = llama if base == "llama" else qwen
    assert [j.prompt for j in replicas.jobs] == [cluster[1][base].encode(TEXT)], (
        f"{model}: the prompt is encoded with {base}'s tokenizer and sent to {base}'s group")
    assert replicas.jobs[0].base == base, f"{model}: the job names the base its prompt was encoded for"


@pytest.mark.parametrize(("model", "base"), [("a0", "llama"), ("q1", "qwen3"), ("qwen3", "qwen3")])
async def test_a_chat_is_rendered_with_its_bases_chat_template(api, cluster, model, base):
    client, llama, qwen = api
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, f"{model}: the chat succeeds: {r.text}"
    tokenizer = cluster[1][base]
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    replicas = llama if base == "llama" else qwen
    assert replicas.jobs[0].prompt == tokenizer.encode(text, add_special_tokens=False), (
        f"{model}: the conversation is rendered with {base}'s chat template and tokenizer")


async def test_a_lorax_request_is_encoded_and_its_tokens_read_with_its_bases_tokenizer(api, cluster):
    client, _, qwen = api
    r = await client.post("/generate", json={"inputs": TEXT, "parameters": {
        "adapter_id": "q0", "max_new_tokens": 2, "details": True}})
    assert r.status_code == 200, f"the LoRAX request succeeds: {r.text}"
    tokenizer = cluster[1]["qwen3"]
    assert qwen.jobs[0].prompt == tokenizer.encode(TEXT), "the inputs are encoded with the Qwen3 tokenizer"
    token = r.json()["details"]["tokens"][0]
    assert token["text"] == tokenizer.decode([token["id"]]), "a token's text is the Qwen3 tokenizer's"
    assert token["text"] != cluster[1]["llama"].decode([token["id"]]), "which is not the Llama tokenizer's"


async def test_an_echoed_token_prompt_is_decoded_with_its_bases_tokenizer(api, cluster):
    client, _, _ = api
    ids = cluster[1]["qwen3"].encode(TEXT, add_special_tokens=False)
    r = await client.post("/v1/completions", json={"model": "qwen3", "prompt": ids, "max_tokens": 1,
                                                   "echo": True})
    assert r.status_code == 200, f"the completion succeeds: {r.text}"
    assert r.json()["choices"][0]["text"].startswith(TEXT), "the token prompt echoes as the Qwen3 text"


async def test_an_adapter_that_changed_base_after_tokenizing_is_refused_not_run_on_the_other_base(cluster):
    config, _ = cluster
    llama, qwen = GroupReplicas(["a0"]), GroupReplicas(["q0"])
    dispatcher = GroupedDispatcher(list(zip(replica_groups(config), [llama, qwen], strict=True)))
    job = GenerateJob(request_id="r", prompt=[1], adapter_id="q0", sampling=SamplingParams(), base="llama")
    with pytest.raises(ApiException) as refused:
        await dispatcher.start(job, "/")
    assert refused.value.error.status == 409, "a prompt tokenized for another base is a 409"
    assert "'q0'" in refused.value.error.message, "the refusal names the adapter"
    assert (llama.jobs, qwen.jobs) == ([], []), "and the job runs nowhere"


def test_a_base_whose_tokenizer_cannot_load_stops_the_start_naming_the_group(demo_zoo, tmp_path):
    broken = tmp_path / "private" / "broken-base"
    shutil.copytree(demo_zoo.model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    config_file = broken / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "NoSuch"}))
    config = _two_bases(demo_zoo.model_dir, broken)
    with pytest.raises(ConfigError) as refused:
        load_tokenizers(group_configs(config))
    message = str(refused.value)
    assert "replica group 'qwen'" in message, "the error names the group"
    assert "'qwen3'" in message, "and its base"
    assert str(tmp_path) not in message, "never a server path"

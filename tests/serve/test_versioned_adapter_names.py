"""Adapter versions at the ingress (no Ray): every load of a name is a version, `name@N` addresses one
in the OpenAI `model` field, LoRAX's `adapter_id` and the vLLM load/unload calls, the bare name is
the latest, `/v1/models` lists them, old versions are retired beyond the bound, and every adapter
response says which version answered in `x-lora-adapter-version`."""

from __future__ import annotations

from app_client import FakeDispatcher, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.serve.http.adapter_versions import VERSION_HEADER

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


def completion(model: str) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 2}


def version(n: int, path: str | None = None, inplace: bool = True) -> dict:
    return {"lora_name": "fin", "lora_path": path or f"/zoo/fin-{n}", "load_inplace": inplace}


async def test_a_load_in_place_creates_the_next_version_and_the_bare_name_follows():
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher) as client:
        first = await client.post(LOAD, json=version(1, inplace=False))
        again = await client.post(LOAD, json=version(2, inplace=False))
        second = await client.post(LOAD, json=version(2))
        bare = await client.post("/v1/completions", json=completion("fin"))
        pinned = await client.post("/v1/completions", json=completion("fin@1"))
        models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
    assert first.status_code == 200, f"the first load is version 1: {first.text}"
    assert again.status_code == 409, "a load of a loaded name without load_inplace is a conflict, as in vLLM"
    assert second.status_code == 200, f"load_inplace loads again: {second.text}"
    assert "version 2" in second.text, f"as version 2: {second.text}"
    assert bare.headers[VERSION_HEADER] == "2", "the bare name is answered by the latest version"
    assert pinned.headers[VERSION_HEADER] == "1", "fin@1 is still answered by version 1"
    jobs = [(job.adapter_id, job.adapter_path) for job in dispatcher.jobs]
    assert jobs == [("fin@2", "/zoo/fin-2"), ("fin", "/zoo/fin-1")], f"each version has its weights: {jobs}"
    assert {"fin", "fin@1", "fin@2"} <= set(models), f"/v1/models lists the name and each version: {models}"


async def test_old_versions_are_retired_beyond_the_bound():
    dispatcher = FakeDispatcher()
    config = ServeConfig(model="base", release_versions_kept=2)
    async with serving(FakeTokenizer(), dispatcher, config) as client:
        for n in (1, 2, 3):
            assert (await client.post(LOAD, json=version(n, inplace=n > 1))).status_code == 200, f"load {n}"
        retired = await client.post("/v1/completions", json=completion("fin@1"))
        kept = await client.post("/v1/completions", json=completion("fin@2"))
    unregistered = [args[0] for method, args in dispatcher.broadcasts if method == "unregister_adapter"]
    assert retired.status_code == 404, f"a retired version is not found: {retired.text}"
    assert retired.json()["error"]["code"] == "adapter_not_found", "as an unknown adapter"
    assert kept.status_code == 200, "the versions within the bound still answer"
    assert unregistered == ["fin"], f"the replicas drop the retired version: {unregistered}"


async def test_unload_takes_one_version_or_every_version():
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher) as client:
        await client.post(LOAD, json=version(1, inplace=False))
        await client.post(LOAD, json=version(2))
        one = await client.post(UNLOAD, json={"lora_name": "fin@2"})
        bare = await client.post("/v1/completions", json=completion("fin"))
        every = await client.post(UNLOAD, json={"lora_name": "fin"})
        gone = await client.post(UNLOAD, json={"lora_name": "fin"})
    assert one.status_code == 200, f"fin@2 unloads alone: {one.text}"
    assert bare.headers[VERSION_HEADER] == "1", "the bare name falls back to the latest kept version"
    assert every.status_code == 200, "the bare name unloads every version"
    assert gone.status_code == 404, "then nothing of it is left"


async def test_a_load_cannot_choose_a_version_number():
    async with serving(FakeTokenizer(), FakeDispatcher()) as client:
        refused = await client.post(LOAD, json={"lora_name": "fin@2", "lora_path": "/zoo/fin"})
    assert refused.status_code == 400, f"the version number is the load's to give: {refused.text}"


async def test_an_adapter_of_the_source_has_version_one_only():
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher) as client:
        one = await client.post("/v1/completions", json=completion("a3@1"))
        two = await client.post("/v1/completions", json=completion("a3@2"))
        lorax = await client.post("/generate", json={"inputs": "hi", "parameters": {
            "adapter_id": "a3", "max_new_tokens": 2}})
        base = await client.post("/v1/completions", json=completion("base"))
    assert one.status_code == 200 and dispatcher.jobs[0].adapter_id == "a3", "a3@1 is the adapter a3"
    assert one.headers[VERSION_HEADER] == "1", "and says it is version 1"
    assert two.status_code == 404, f"a3 has no version 2: {two.text}"
    assert lorax.headers[VERSION_HEADER] == "1", "LoRAX responses carry the version too"
    assert VERSION_HEADER not in base.headers, "the base model has no adapter version"


async def test_lorax_addresses_a_version():
    dispatcher = FakeDispatcher()
    async with serving(FakeTokenizer(), dispatcher) as client:
        await client.post(LOAD, json=version(1, inplace=False))
        await client.post(LOAD, json=version(2))
        answer = await client.post("/generate", json={"inputs": "hi", "parameters": {
            "adapter_id": "fin@1", "max_new_tokens": 2}})
    assert answer.status_code == 200, answer.text
    assert answer.headers[VERSION_HEADER] == "1", "adapter_id fin@1 is answered by version 1"
    assert dispatcher.jobs[-1].adapter_path == "/zoo/fin-1", "with version 1's weights"

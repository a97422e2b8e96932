"""A release through vLLM's load call (no Ray): `POST /v1/load_lora_adapter` of a loaded name with a
`release` object stages the new weights as the name's next version in a release, with the release
route's options, instead of replacing the version the bare name serves."""

from __future__ import annotations

from typing import Any

from app_client import FakeDispatcher, FakeStream, FakeTokenizer, outputs, serving

from lora_cluster.config import ServeConfig
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

CONFIG = ServeConfig(model="base")
LOAD = "/v1/load_lora_adapter"


async def ask(client: Any, user: str) -> str:
    answer = await client.post("/v1/completions", json={"model": "fin", "prompt": "hi", "max_tokens": 2,
                                                        "user": user})
    return answer.headers["x-lora-adapter-version"]


async def test_a_load_with_a_release_object_stages_the_version_instead_of_replacing_it():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-1"})
        loaded = await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-2",
                                               "release": {"steps": [25, 100], "step_min_requests": 1000}})
        releases = (await client.get("/v1/adapters/fin/releases")).json()["data"]
        versions = {await ask(client, f"user-{i}") for i in range(40)}
    assert loaded.status_code == 200, f"the load succeeds: {loaded.text}"
    assert loaded.text.startswith("Success: LoRA adapter 'fin' version 2 is in release rel-"), loaded.text
    assert "(canary, 25% of its traffic)" in loaded.text, f"the answer says its state: {loaded.text}"
    assert len(releases) == 1, f"the load created one release: {releases}"
    assert (releases[0]["stable_version"], releases[0]["candidate_version"]) == (1, 2), "v2 against v1"
    assert releases[0]["steps"] == [25.0, 100.0], "with the options the load gave"
    assert versions == {"1", "2"}, f"the bare name is split between both versions, not replaced: {versions}"


class RandomCandidate(FakeDispatcher):
    """Version 2 of `fin` answers gibberish; version 1 the x's of every fake answer."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id != "fin@2":
            return await super().start(job, route)
        first, *rest = [{**item, "text": "zq" if item["text"] else item["text"]} for item in outputs(job)]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


async def test_a_candidate_the_eval_gate_refuses_is_reported_by_the_load_and_serves_no_one():
    eval_set = [{"prompt": "hi", "expected": "xx"}]
    async with serving(FakeTokenizer(), RandomCandidate(), CONFIG) as client:
        await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-1"})
        loaded = await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-2",
                                               "release": {"eval_set": eval_set}})
        versions = {await ask(client, f"user-{i}") for i in range(20)}
    assert loaded.status_code == 200, f"the load itself worked: {loaded.text}"
    assert loaded.text.startswith("Refused: LoRA adapter 'fin' version 2"), f"it says refused: {loaded.text}"
    assert "(rolled_back, 0% of its traffic)" in loaded.text, loaded.text
    assert versions == {"1"}, "every user still gets version 1"


async def test_a_release_of_a_name_not_loaded_is_a_404_and_bad_options_a_400():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        unknown = await client.post(LOAD, json={"lora_name": "nobody", "lora_path": "/zoo/x", "release": {}})
        await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-1"})
        bad = await client.post(LOAD, json={"lora_name": "fin", "lora_path": "/zoo/fin-2",
                                            "release": {"steps": [50, 10]}})
        releases = (await client.get("/v1/adapters/fin/releases")).json()["data"]
    assert unknown.status_code == 404, f"nothing to release against: {unknown.text}"
    assert bad.status_code == 400, f"steps that do not increase to 100 are refused: {bad.text}"
    assert releases == [], "and no release was created"

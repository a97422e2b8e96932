"""The eval gate's `choices` and `schema` cases at the ingress (no Ray): each choice is scored by the
loglikelihood the replica reports for the prompt's tokens (one prefill per choice, asking for
prompt logprobs), each schema case is generated under its schema's constraint and checked against
it, both at `batch` priority on both versions; a candidate below the margin is refused."""

from __future__ import annotations

from typing import Any

from app_client import FakeDispatcher, FakeStream, FakeTokenizer, outputs, serving

from lora_cluster.config import ServeConfig
from lora_cluster.request import TokenLogprob
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

RELEASES = "/v1/adapters/fin/releases"
CONFIG = ServeConfig(model="base")
CHOICES = {"prompt": "The sky is", "choices": [" green", " blue"], "answer": 1}
SCHEMA = {"type": "object", "properties": {"score": {"type": "integer"}}, "required": ["score"]}
EVAL_SET = [CHOICES, {"prompt": "Rate it", "schema": SCHEMA}]


class Versions(FakeDispatcher):
    """A replica on which each version of `fin` (version 1 is registered as `fin`, 2 as `fin@2`)
    prefers one word and writes one document: a prompt ending with the preferred word gets logprob
    -0.1 per token, any other -2.0."""

    def __init__(self, prefers: dict[str, str], documents: dict[str, str]):
        super().__init__()
        self.prefers, self.documents = prefers, documents

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id not in self.prefers:
            return await super().start(job, route)
        self.jobs.append(job)
        item = outputs(job)[-1]
        text = "".join(chr(t) for t in job.prompt)
        if job.sampling.prompt_logprobs is not None:
            lp = -0.1 if text.endswith(self.prefers[job.adapter_id]) else -2.0
            item = {**item, "prompt_logprobs": [None] + [TokenLogprob(t, lp) for t in job.prompt[1:]]}
        elif job.sampling.guided is not None:
            item = {**item, "text": self.documents[job.adapter_id]}
        return Generation(job=job, replica="r1", hit=True, first={"replica": "r1", "hit": True, **item},
                          stream=FakeStream([]))


async def release(dispatcher: Versions, eval_set: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        first = {"lora_name": "fin", "lora_path": "/zoo/fin-1"}
        loaded = await client.post("/v1/load_lora_adapter", json=first)
        assert loaded.status_code == 200, f"version 1 loads: {loaded.text}"
        created = await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "eval_set": eval_set})
        events = [] if created.status_code != 200 else \
            (await client.get(f"{RELEASES}/{created.json()['id']}/events")).json()["data"]
    return created, events


async def test_a_candidate_that_picks_the_wrong_choice_and_breaks_the_schema_is_refused():
    dispatcher = Versions(prefers={"fin": " blue", "fin@2": " green"},
                          documents={"fin": '{"score": 3}', "fin@2": '{"score": "x"}'})
    created, events = await release(dispatcher, EVAL_SET)
    eval_jobs = [job for job in dispatcher.jobs if job.request_id.startswith("eval")]
    scored = [job for job in eval_jobs if job.sampling.prompt_logprobs == 0]
    guided = [job for job in eval_jobs if job.sampling.guided is not None]
    assert created.json()["state"] == "rolled_back", f"the candidate is refused: {created.text}"
    assert events[-1]["kind"] == "eval_failed", "by the eval gate"
    assert events[-1]["evidence"]["stable_score"] == 1.0, "the stable version passes both cases"
    assert events[-1]["evidence"]["candidate_score"] == 0.0, "the candidate fails both"
    assert events[-1]["evidence"]["kinds"] == ["choices", "schema"], "the evidence names the kinds run"
    assert len(scored) == 2 * len(CHOICES["choices"]), "each choice is one prefill on each version"
    assert {job.sampling.max_new_tokens for job in scored} == {1}, "a choice's prefill generates one token"
    assert len(guided) == 2, "the schema case runs once on each version"
    assert all(job.sampling.guided.text == '{"type":"object","properties":{"score":{"type":"integer"}},'
               '"required":["score"]}' for job in guided), "under the case's schema as its constraint"
    assert {job.priority_class for job in eval_jobs} == {"batch"}, "every case runs at batch priority"


async def test_a_candidate_as_good_as_the_stable_version_passes():
    dispatcher = Versions(prefers={"fin": " blue", "fin@2": " blue"},
                          documents={"fin": '{"score": 3}', "fin@2": '{"score": 4}'})
    created, events = await release(dispatcher, EVAL_SET)
    assert created.json()["state"] == "canary", f"the candidate enters its canary: {created.text}"
    assert events[1]["evidence"]["candidate_score"] == 1.0, "it passes both cases"


async def test_an_unconstrained_schema_case_runs_without_a_constraint():
    dispatcher = Versions(prefers={"fin": " blue", "fin@2": " blue"}, documents={})
    created, _ = await release(dispatcher, [{"prompt": "Rate it", "schema": SCHEMA, "constrained": False}])
    eval_jobs = [job for job in dispatcher.jobs if job.request_id.startswith("eval")]
    assert created.json()["state"] == "canary", "both versions fail it alike (their text is not JSON)"
    assert all(job.sampling.guided is None for job in eval_jobs), "no constraint is sent"


async def test_a_case_whose_schema_is_not_a_json_schema_is_a_400_before_any_load():
    dispatcher = Versions(prefers={}, documents={})
    created, _ = await release(dispatcher, [{"prompt": "Rate it", "schema": {"type": "nonsense"}}])
    assert created.status_code == 400, f"a bad schema is refused: {created.text}"
    assert "evaluation case 1" in created.json()["error"]["message"], "the message names the case"
    assert not [m for m, args in dispatcher.broadcasts if m == "register_adapter" and "fin@2" in str(args)], \
        "the candidate was not loaded"

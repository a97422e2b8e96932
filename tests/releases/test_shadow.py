"""Shadow traffic of a release (`serve.http.release_shadow`, no Ray): a share of the stable version's
greedy requests is copied to the candidate at the least urgent class after the live answer, never
returned to a client, compared token by token; a candidate whose copies disagree is rolled back by
the shadow gate, and a copy that fails is no evidence against the candidate."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
from app_client import FakeDispatcher, FakeStream, FakeTokenizer, outputs, serving

from lora_cluster.config import ServeConfig
from lora_cluster.errors import EngineOverloadedError
from lora_cluster.releases.gates import ShadowStats
from lora_cluster.request.output import TokenLogprob
from lora_cluster.request.sampling_params import SamplingParams
from lora_cluster.serve.http.adapter_versions import VERSION_HEADER
from lora_cluster.serve.http.release_shadow import MAX_IN_FLIGHT, Answer, check
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

RELEASES = "/v1/adapters/fin/releases"
CONFIG = ServeConfig(model="base", release_step_dwell_s=0, release_gate_min_requests=8)
STAY = {"lora_path": "/zoo/fin-2", "steps": [10, 100], "step_min_requests": 10_000, "shadow_percent": 100}
REQUESTS = 30
Send = Callable[[httpx.AsyncClient, int], Awaitable[httpx.Response]]


class OtherCandidate(FakeDispatcher):
    """Version 2 of `fin` answers other tokens than version 1 (a candidate that drifted)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id != "fin@2":
            return await super().start(job, route)
        self.jobs.append(job)
        first, *rest = [{**item, "token_ids": [7] * len(item["token_ids"]) if item["token_ids"] else None}
                        for item in outputs(job)]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


class ShedShadows(FakeDispatcher):
    """Every copy to the candidate is shed by the engine (overload)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.request_id.startswith("shadow"):
            raise EngineOverloadedError("the replica sheds its least urgent work")
        return await super().start(job, route)


async def completion(client: httpx.AsyncClient, i: int, temperature: float = 0.0,
                     stream: bool = False) -> httpx.Response:
    return await client.post("/v1/completions", json={
        "model": "fin", "prompt": "hi", "max_tokens": 4, "temperature": temperature, "stream": stream,
        "user": f"user-{i}"})


async def run_release(dispatcher: FakeDispatcher, temperature: float = 0.0, stream: bool = False,
                      send: Send | None = None, requests: int = REQUESTS,
                      settle: Callable[[], None] = lambda: None) -> tuple[list[Any], dict[str, Any]]:
    """A release that stays at 10% with every greedy stable request copied; `requests` requests of
    distinct users (`send`: one request; default: a completion); `settle` once they are answered;
    the answers and the release's status once the copies are done (bounded), with its `events`."""
    send = send or partial(completion, temperature=temperature, stream=stream)
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        await client.post("/v1/load_lora_adapter", json={"lora_name": "fin", "lora_path": "/zoo/fin-1"})
        release = (await client.post(RELEASES, json=STAY)).json()
        answers = [await send(client, i) for i in range(requests)]
        await asyncio.sleep(0.05)  # let the last copies start (tasks of their own)
        settle()
        for _ in range(100):  # until every started copy is compared, bounded
            status = (await client.get(f"{RELEASES}/{release['id']}")).json()
            compared = status["stats"]["shadow"]["requests"]
            if status["state"] != "canary" or compared == len(shadow_jobs(dispatcher)):
                break
            await asyncio.sleep(0.01)
        status["events"] = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
    return answers, status


def shadow_jobs(dispatcher: FakeDispatcher) -> list[GenerateJob]:
    return [job for job in dispatcher.jobs if job.request_id.startswith("shadow")]


async def test_a_share_of_the_stable_versions_greedy_requests_is_copied_to_the_candidate_and_compared():
    dispatcher = FakeDispatcher()
    answers, status = await run_release(dispatcher)
    stable_answers = [a for a in answers if a.headers[VERSION_HEADER] == "1"]
    copies = shadow_jobs(dispatcher)
    assert all(a.status_code == 200 for a in answers), "every live request is answered"
    assert len(copies) == len(stable_answers), "each stable answer was copied once (shadow_percent 100)"
    assert {job.adapter_id for job in copies} == {"fin@2"}, "the copies run on the candidate"
    assert {job.priority_class for job in copies} == {"batch"}, "at the least urgent class"
    assert status["stats"]["shadow"]["requests"] == len(copies), f"every copy was compared: {status}"
    assert status["stats"]["shadow"]["agreement"] == 1.0, "the same tokens agree fully"
    assert status["state"] == "canary", "an agreeing candidate holds its step"


async def test_a_candidate_whose_copies_disagree_is_rolled_back_by_the_shadow_gate():
    dispatcher = OtherCandidate()
    answers, status = await run_release(dispatcher)
    assert status["state"] == "rolled_back", f"the shadow gate rolled the release back: {status}"
    assert all(a.status_code == 200 for a in answers), "no live request failed meanwhile"


async def test_only_greedy_answered_requests_are_copied_and_a_shed_copy_is_no_evidence():
    sampled, shed = FakeDispatcher(), ShedShadows()
    await run_release(sampled, temperature=1.0)
    answers, status = await run_release(shed)
    assert shadow_jobs(sampled) == [], "a sampled request cannot be compared token by token: not copied"
    assert all(a.status_code == 200 for a in answers), "a shed copy never touches the live answer"
    assert status["state"] == "canary", f"and is no evidence against the candidate: {status}"
    assert status["stats"]["candidate"]["errors"] == 0, "no error was counted for the candidate"


def test_agreement_counts_equal_tokens_over_the_longer_answer():
    stats = ShadowStats()
    stats.record([1, 2, 3, 4], [1, 2, 9], 0.1, 0.3)
    assert stats.agreement == 0.5, "2 equal positions over 4 tokens"
    assert stats.to_dict()["candidate_ttft_s"] == 0.3, "the copies' TTFT is kept beside the live one's"


class OtherStreams(FakeDispatcher):
    """Version 1's streams send their tokens item by item but finish with other tokens in the final
    item (what the client was sent is what counts), and version 2 answers those other tokens."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        first, *rest = [{**item, "token_ids": [7] * len(item["token_ids"]) if item["token_ids"] else None}
                        for item in outputs(job)]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


class BrokenStreams(FakeDispatcher):
    """Every live stream fails after its first token (an engine error mid-stream)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.request_id.startswith("shadow"):
            return await super().start(job, route)
        self.jobs.append(job)
        first, second, *_ = outputs(job)
        error = {"error": {"status": 500, "type": "engine_error", "code": "engine_error",
                           "message": "the step failed"}}
        broken = FakeStream([{**second, **error}])
        return Generation(job=job, replica="r1", hit=True, first=first, stream=broken)


class HeldShadows(FakeDispatcher):
    """Every copy to the candidate waits on `release` (a candidate slower than the live traffic)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if not job.request_id.startswith("shadow"):
            return await super().start(job, route)
        self.jobs.append(job)  # started: held from here
        await asyncio.wait_for(self.release.wait(), 10)
        first, *rest = outputs(job)
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


async def chat(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={
        "model": "fin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "stream": True, "user": f"user-{i}"})


async def lorax(client: httpx.AsyncClient, i: int, route: str = "/generate") -> httpx.Response:
    return await client.post(route, json={"inputs": "hi", "parameters": {"adapter_id": "fin",
                                                                         "max_new_tokens": 4}},
                             headers={"x-lora-user": f"user-{i}"})


async def test_streamed_openai_requests_are_copied_after_the_stream_and_compared_with_the_tokens_sent():
    for send in (partial(completion, stream=True), chat):
        dispatcher = FakeDispatcher()
        answers, status = await run_release(dispatcher, send=send)
        stable = [a for a in answers if a.headers[VERSION_HEADER] == "1"]
        copies = shadow_jobs(dispatcher)
        assert all(a.text.endswith("data: [DONE]\n\n") for a in answers), "every live stream ends whole"
        assert len(copies) == len(stable), f"each stable stream was copied once: {send}"
        assert {job.stream for job in copies} == {False}, "a copy runs non-streamed"
        assert {job.priority_class for job in copies} == {"batch"}, "at the least urgent class"
        assert status["stats"]["shadow"]["requests"] == len(copies), f"every copy was compared: {status}"
        assert status["stats"]["shadow"]["agreement"] == 1.0, "the candidate's tokens equal the ones sent"


async def test_a_streamed_copy_is_compared_with_the_tokens_the_client_was_sent():
    answers, status = await run_release(OtherStreams(), stream=True)
    assert status["state"] == "rolled_back", (
        f"the stable version sent 120s item by item and the candidate answered 7s: no agreement ({status})")
    assert all(a.status_code == 200 for a in answers), "no live stream failed meanwhile"


async def test_lorax_requests_streamed_or_not_are_copied():
    for route in ("/generate", "/generate_stream", "/"):
        dispatcher = FakeDispatcher()
        answers, status = await run_release(dispatcher, send=partial(lorax, route=route))
        stable = [a for a in answers if a.headers[VERSION_HEADER] == "1"]
        copies = shadow_jobs(dispatcher)
        assert stable and len(copies) == len(stable), f"each stable {route} answer was copied once"
        assert {job.adapter_id for job in copies} == {"fin@2"}, "the copies run on the candidate"
        assert status["stats"]["shadow"]["agreement"] == 1.0, f"and agree with {route}'s answers: {status}"


async def test_a_stream_that_failed_is_not_copied():
    dispatcher = BrokenStreams()
    answers, _ = await run_release(dispatcher, stream=True)
    assert all('"engine_error"' in a.text for a in answers), "every live stream ended with its error event"
    assert shadow_jobs(dispatcher) == [], "a stream that did not finish has no answer to compare: not copied"


async def test_at_most_eight_copies_run_at_once_per_ingress_and_live_answers_never_wait_for_them():
    dispatcher = HeldShadows()
    sends = (partial(completion, stream=True), chat, lorax, partial(lorax, route="/generate_stream"),
             completion)
    held: list[int] = []
    answers, status = await run_release(
        dispatcher, send=lambda client, i: sends[i % len(sends)](client, i),
        settle=lambda: (held.append(len(shadow_jobs(dispatcher))), dispatcher.release.set()))
    stable = [a for a in answers if a.headers[VERSION_HEADER] == "1"]
    assert len(stable) > MAX_IN_FLIGHT, f"more stable answers than the bound: {len(stable)}"
    assert all(a.status_code == 200 for a in answers), "every live request was answered, copies held"
    assert held == [MAX_IN_FLIGHT], f"{MAX_IN_FLIGHT} copies were held at once, the others dropped: {held}"
    assert status["stats"]["shadow"]["requests"] == MAX_IN_FLIGHT, (
        f"the held copies were compared once the candidate answered: {status}")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class TruncatedJson(FakeDispatcher):
    """Both versions answer the same tokens, but version 2's text stops inside its JSON document (a
    candidate that runs out of tokens before its document is complete)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        *head, last = outputs(job)
        last = {**last, "text": '{"a": ' if job.adapter_id == "fin@2" else '{"a": 1}'}
        first, *rest = [*head, last]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


async def test_a_candidate_whose_copies_break_the_requests_json_schema_is_rolled_back_by_the_schema_gate():
    dispatcher = TruncatedJson()
    answers, status = await run_release(dispatcher, send=lambda client, i: client.post(
        "/v1/completions", json={"model": "fin", "prompt": "hi", "max_tokens": 4, "temperature": 0,
                                 "guided_json": SCHEMA, "user": f"user-{i}"}))
    shadow = status["stats"]["shadow"]
    assert status["state"] == "rolled_back", f"the shadow schema gate rolled the release back: {status}"
    assert shadow["agreement"] == 1.0, "the tokens agreed: the schema gate alone failed the step"
    assert shadow["schema_checked"] == shadow["requests"] >= 8, f"past the gate's minimum: {shadow}"
    assert (shadow["stable_schema_valid"], shadow["candidate_schema_valid"]) == (shadow["schema_checked"], 0)
    assert (shadow["stable_schema_valid_rate"], shadow["candidate_schema_valid_rate"]) == (1.0, 0.0)
    assert any("schema-valid rate" in event["reason"] for event in status["events"]), status["events"]
    assert all(a.status_code == 200 for a in answers), "no live request failed meanwhile"


async def test_copies_of_an_unconstrained_request_check_no_schema():
    _, status = await run_release(FakeDispatcher())
    assert status["stats"]["shadow"]["schema_checked"] == 0, "no JSON constraint, nothing checked"
    assert status["stats"]["shadow"]["logprob_divergence"] is None, "no logprobs asked, no divergence"


class Logprobs(FakeDispatcher):
    """Every token carries its logprob: -0.5 on version 1, -0.75 on version 2 (the same tokens)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        self.jobs.append(job)
        value = -0.75 if job.adapter_id == "fin@2" else -0.5
        items = [{**item, "delta_logprobs": [TokenLogprob(120, value, ((120, value),))],
                  "logprobs": [TokenLogprob(120, value, ((120, value),))] * len(item["token_ids"])
                  if item["token_ids"] else None} for item in outputs(job)]
        first, *rest = items
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


async def test_the_logprob_divergence_is_reported_when_the_live_request_asked_for_logprobs():
    for stream in (False, True):
        _, status = await run_release(Logprobs(), send=lambda client, i, stream=stream: client.post(
            "/v1/completions", json={"model": "fin", "prompt": "hi", "max_tokens": 4, "temperature": 0,
                                     "logprobs": 1, "stream": stream, "user": f"user-{i}"}))
        shadow = status["stats"]["shadow"]
        assert shadow["requests"] > 0, status
        assert shadow["logprob_tokens"] == 4 * shadow["requests"], f"every token compared: {shadow}"
        assert shadow["logprob_divergence"] == 0.25, f"|-0.5 - -0.75| per token (stream={stream}): {shadow}"
        assert status["state"] == "canary", "divergence is evidence, not a gate"


def test_logprob_divergence_covers_only_the_prefix_both_versions_generated_alike():
    stable = Answer([1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
    candidate = Answer([1, 2, 9], logprobs=[-0.2, -0.2, -0.1])
    job = GenerateJob("r", "hi", "fin@2", SamplingParams(temperature=0))
    gaps = check(job, stable, candidate).logprob_gaps
    assert gaps == pytest.approx((0.1, 0.0)), "positions after the first different token are not compared"
    assert check(job, stable, Answer([1, 2, 3])).logprob_gaps == (), "one side without logprobs: none"

"""Adapter releases at the ingress (no Ray): a release stages a candidate version against the bare
name's version, goes through every canary step to promotion on good live traffic, rolls back by
itself when the candidate fails, keeps each user on one version, obeys manual commands, and is
reachable only by the tenant that owns the adapter."""

from __future__ import annotations

from typing import Any

import pytest
from app_client import FakeDispatcher, FakeStream, FakeTokenizer, outputs, serving
from tenant_app import ADMIN_KEY, FIN_KEY, HR_KEY, bearer, tenant_app, tenants_yaml

from lora_cluster.config import ServeConfig
from lora_cluster.errors import EngineStepError
from lora_cluster.serve.http.adapter_versions import VERSION_HEADER
from lora_cluster.serve.http_errors import describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

RELEASES = "/v1/adapters/fin/releases"
# two steps, a few requests each, no dwell: a release runs its course within a bounded test loop
CONFIG = ServeConfig(model="base", release_canary_steps=[25, 100], release_step_min_requests=8,
                     release_step_dwell_s=0, release_gate_min_requests=8)
MAX_REQUESTS = 400
# end users the loops cycle through: some must fall in the candidate's share, sticky by user (at 25%,
# none of 40 does with odds 0.75^40 = 1e-5; with 20 users, 0.75^20 = 0.3%, it happened in CI)
USERS = 40


class FailingCandidate(FakeDispatcher):
    """A replica on which version 2 of `fin` fails every request (an engine error)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id == "fin@2":
            raise EngineStepError("the candidate's step failed")
        return await super().start(job, route)


class FailingMidStream(FakeDispatcher):
    """A replica on which version 2 of `fin` fails after its first item (an engine error event)."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        generation = await super().start(job, route)
        if job.adapter_id == "fin@2":
            failed = describe(EngineStepError("the candidate's step failed"))
            generation.stream = FakeStream([{"error": failed.to_dict()}])
        return generation


async def first_version(client: Any, **headers: str) -> None:
    loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": "fin", "lora_path": "/zoo/fin-1"},
                               headers=headers)
    assert loaded.status_code == 200, f"version 1 loads: {loaded.text}"


async def ask(client: Any, user: str) -> Any:
    return await client.post("/v1/completions", json={"model": "fin", "prompt": "hi", "max_tokens": 2,
                                                      "user": user})


async def test_a_good_candidate_goes_through_every_step_to_promotion():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        created = await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})
        assert created.status_code == 200, f"a release is created: {created.text}"
        release = created.json()
        assert (release["stable_version"], release["candidate_version"]) == (1, 2), "v2 against v1"
        assert release["percent"] == 25.0, "the candidate starts at the first step's share"
        seen: dict[str, set[str]] = {}
        for i in range(MAX_REQUESTS):
            user = f"user-{i % USERS}"
            answer = await ask(client, user)
            assert answer.status_code == 200, answer.text
            seen.setdefault(user, set()).add(answer.headers[VERSION_HEADER])
            status = (await client.get(f"{RELEASES}/{release['id']}")).json()
            if status["state"] == "promoted":
                break
        events = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
        bare = await ask(client, "anyone")
        pinned = await client.post("/v1/completions", json={"model": "fin@1", "prompt": "hi",
                                                            "max_tokens": 2})
    assert status["state"] == "promoted", f"the release is promoted within {MAX_REQUESTS} requests: {status}"
    assert [e["kind"] for e in events] == ["created", "eval_passed", "step_advanced", "promoted"], \
        f"every decision is in the audit log: {[e['kind'] for e in events]}"
    assert bare.headers[VERSION_HEADER] == "2", "after the promotion the bare name is version 2"
    assert pinned.headers[VERSION_HEADER] == "1", "fin@1 still answers with version 1"
    switched = {u for u, versions in seen.items() if len(versions) > 1}
    assert all(seen[u] == {"1", "2"} for u in switched), "a user only ever moves from v1 to v2"


async def _stream_ask(client: Any, user: str, api: str) -> tuple[int, str | None]:
    """A streamed request of the bare name through the OpenAI or the LoRAX route, read to its end."""
    if api == "openai":
        url, body = "/v1/completions", {"model": "fin", "prompt": "hi", "max_tokens": 2, "user": user,
                                        "stream": True}
    else:
        url, body = "/generate_stream", {"inputs": "hi", "parameters": {"adapter_id": "fin",
                                                                        "max_new_tokens": 2}}
    headers = {} if api == "openai" else {"x-lora-user": user}
    async with client.stream("POST", url, json=body, headers=headers) as answer:
        async for _ in answer.aiter_lines():
            pass
        return answer.status_code, answer.headers.get(VERSION_HEADER)


@pytest.mark.parametrize("api", ["openai", "lorax"])
async def test_streamed_requests_are_evidence_that_advances_and_rolls_back_a_release(api):
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        release = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})).json()
        for i in range(MAX_REQUESTS):
            code, _ = await _stream_ask(client, f"user-{i % USERS}", api)
            assert code == 200, f"a streamed request is served ({api})"
            status = (await client.get(f"{RELEASES}/{release['id']}")).json()
            if status["state"] == "promoted":
                break
    assert status["state"] == "promoted", f"streamed answers alone promote a good candidate ({api}): {status}"
    async with serving(FakeTokenizer(), FailingMidStream(), CONFIG) as client:
        await first_version(client)
        release = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})).json()
        for i in range(MAX_REQUESTS):
            await _stream_ask(client, f"user-{i % USERS}", api)
            status = (await client.get(f"{RELEASES}/{release['id']}")).json()
            if status["state"] == "rolled_back":
                break
        events = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
    assert status["state"] == "rolled_back", \
        f"streams that fail mid-way roll a candidate back ({api}): {status}"
    assert events[-1]["reason"].startswith("automatic: error rate"), "the audit log says why"


async def test_users_are_sticky_within_a_step():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})
        versions = {}
        for user in ("ann", "bob", "cy", "dee", "eve"):
            answers = {(await ask(client, user)).headers[VERSION_HEADER] for _ in range(3)}
            versions[user] = answers
    assert all(len(v) == 1 for v in versions.values()), f"one user sees one version: {versions}"


async def test_a_candidate_that_fails_live_is_rolled_back_automatically():
    async with serving(FakeTokenizer(), FailingCandidate(), CONFIG) as client:
        await first_version(client)
        release = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})).json()
        failed = 0
        for i in range(MAX_REQUESTS):
            answer = await ask(client, f"user-{i}")
            failed += answer.status_code != 200
            status = (await client.get(f"{RELEASES}/{release['id']}")).json()
            if status["state"] == "rolled_back":
                break
        events = (await client.get(f"{RELEASES}/{release['id']}/events")).json()["data"]
        after = [(await ask(client, f"later-{i}")).headers.get(VERSION_HEADER) for i in range(20)]
    assert status["state"] == "rolled_back", f"the failing candidate is rolled back: {status}"
    assert events[-1]["reason"].startswith("automatic: error rate"), "the audit log says why"
    assert events[-1]["percent"] == 25.0, "it was rolled back at the first step"
    assert failed == CONFIG.releases.release_gate_min_requests, \
        f"the rollback came with the request that gave enough evidence: {failed} failures"
    assert after == ["1"] * 20, "after the rollback every user gets version 1"


async def test_manual_commands_and_their_conflicts():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        release = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})).json()
        url = f"{RELEASES}/{release['id']}"
        second = await client.post(RELEASES, json={"lora_path": "/zoo/fin-3"})
        paused = await client.post(f"{url}/pause")
        rolled = await client.post(f"{url}/rollback")
        promote = await client.post(f"{url}/promote")
        unknown = await client.get(f"{RELEASES}/rel-nope")
        listed = (await client.get(RELEASES)).json()["data"]
        never = await client.post("/v1/adapters/nobody/releases", json={"lora_path": "/zoo/x"})
    assert second.status_code == 409, f"one release runs per name: {second.text}"
    assert paused.json()["state"] == "paused", "a release pauses"
    assert rolled.json()["state"] == "rolled_back", "and rolls back by hand"
    assert promote.status_code == 409, f"a rolled-back release cannot be promoted: {promote.text}"
    assert promote.json()["error"]["code"] == "release_conflict", "the conflict says so"
    assert unknown.status_code == 404, "an unknown release is a 404"
    assert [r["id"] for r in listed] == [release["id"]], "the listing shows the release"
    assert never.status_code == 404, "a name never loaded has nothing to release against"


async def test_a_tenant_reaches_only_its_own_adapters_releases(tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(tenants_yaml())
    url = "/v1/adapters/fin-a/releases"
    async with tenant_app(tenants_file, FakeDispatcher()) as client:
        admin = bearer(ADMIN_KEY)
        await client.post("/v1/load_lora_adapter", json={"lora_name": "fin-a", "lora_path": "/zoo/fin-1"},
                          headers=admin)
        by_tenant = await client.post(url, json={"lora_path": "/zoo/fin-2"}, headers=bearer(FIN_KEY))
        created = (await client.post(url, json={"lora_path": "/zoo/fin-2"}, headers=admin)).json()
        own = await client.get(f"{url}/{created['id']}", headers=bearer(FIN_KEY))
        other_sees = await client.get(f"{url}/{created['id']}", headers=bearer(HR_KEY))
        other_lists = await client.get(url, headers=bearer(HR_KEY))
        other_rolls = await client.post(f"{url}/{created['id']}/rollback", headers=bearer(HR_KEY))
        anonymous = await client.get(url)
        own_pause = await client.post(f"{url}/{created['id']}/pause", headers=bearer(FIN_KEY))
    assert by_tenant.status_code == 403, "a tenant's candidate at a server path outside the sources is a 403"
    assert own.status_code == 200, "the owning tenant sees its release"
    assert other_sees.status_code == 404, "another tenant does not see it"
    assert other_lists.status_code == 404, "nor list its adapter's releases"
    assert other_rolls.status_code == 404, "nor roll it back"
    assert anonymous.status_code == 401, "no key is a 401"
    assert own_pause.json()["state"] == "paused", "the owning tenant commands its release"


async def test_a_release_may_set_its_own_steps():
    async with serving(FakeTokenizer(), FakeDispatcher()) as client:
        await first_version(client)
        bad = await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "steps": [50, 20, 100]})
        own = await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "steps": [50, 100],
                                                "step_min_requests": 2, "step_dwell_s": 0})
        for i in range(40):  # 2 candidate requests per step: 8 users at 50% missed it 1 time in 28
            await ask(client, f"user-{i}")
            status = (await client.get(f"{RELEASES}/{own.json()['id']}")).json()
            if status["state"] == "promoted":
                break
    assert bad.status_code == 400, f"steps that do not increase are refused: {bad.text}"
    assert own.json()["steps"] == [50.0, 100.0], "the release runs the steps it was given"
    assert status["state"] == "promoted", f"with its own minimum and dwell it completes quickly: {status}"


class RandomCandidate(FakeDispatcher):
    """A replica on which version 2 of `fin` answers gibberish (random weights), version 1 the x's."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id != "fin@2":
            return await super().start(job, route)
        self.jobs.append(job)
        first, *rest = [{**item, "text": "zq" if item["text"] else item["text"]} for item in outputs(job)]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=FakeStream(rest))


EVAL_SET = [{"prompt": "hi", "expected": "xx"}, {"prompt": "hello", "expected": "xxx"}]


async def test_the_eval_gate_refuses_a_random_candidate_before_any_client_sees_it():
    dispatcher = RandomCandidate()
    async with serving(FakeTokenizer(), dispatcher, CONFIG) as client:
        await first_version(client)
        refused = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "eval_set": EVAL_SET})).json()
        answers = [(await ask(client, f"user-{i}")).headers[VERSION_HEADER] for i in range(20)]
        events = (await client.get(f"{RELEASES}/{refused['id']}/events")).json()["data"]
    eval_jobs = [job for job in dispatcher.jobs if job.request_id.startswith("eval")]
    assert refused["state"] == "rolled_back", f"the random candidate is refused: {refused}"
    assert events[-1]["kind"] == "eval_failed", "by the eval gate"
    assert events[-1]["evidence"]["candidate_score"] == 0.0, "with the candidate's score as evidence"
    assert answers == ["1"] * 20, "no client request reached the candidate"
    assert {job.priority_class for job in eval_jobs} == {"batch"}, "the evaluation runs at batch priority"
    assert len(eval_jobs) == 2 * len(EVAL_SET), "every case ran on both versions"


async def test_a_close_candidate_passes_the_eval_gate_and_a_bad_set_is_refused():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        bad = await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "eval_set": [{"expected": "x"}]})
        passed = (await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "eval_set": EVAL_SET})).json()
        events = (await client.get(f"{RELEASES}/{passed['id']}/events")).json()["data"]
    assert bad.status_code == 400, f"a case without a prompt is refused before anything loads: {bad.text}"
    assert passed["state"] == "canary", f"a candidate within the margin enters its canary: {passed}"
    assert events[1]["evidence"]["candidate_score"] == 1.0, "the eval event carries both scores"


async def test_a_version_in_a_running_release_cannot_be_unloaded_alone():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        await client.post(RELEASES, json={"lora_path": "/zoo/fin-2"})
        stable = await client.post("/v1/unload_lora_adapter", json={"lora_name": "fin@1"})
        candidate = await client.post("/v1/unload_lora_adapter", json={"lora_name": "fin@2"})
        whole = await client.post("/v1/unload_lora_adapter", json={"lora_name": "fin"})
        listed = (await client.get(RELEASES)).json()["data"]
    assert stable.status_code == 409, f"the stable version of a running release stays: {stable.text}"
    assert candidate.status_code == 409, f"so does its candidate: {candidate.text}"
    assert whole.status_code == 200, "the whole name unloads"
    assert listed == [], "and its releases go with it"


async def test_the_x_lora_user_header_keeps_a_user_on_one_version_in_every_api():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await first_version(client)
        await client.post(RELEASES, json={"lora_path": "/zoo/fin-2", "steps": [50, 100],
                                          "step_min_requests": 1000})
        seen: dict[str, set[str]] = {}
        for i in range(40):
            user = f"user-{i % (USERS // 2)}"  # 20 users at 50%: all on one side with odds 2e-6
            body = {"model": "fin", "prompt": "hi", "max_tokens": 2}
            openai = await client.post("/v1/completions", json=body, headers={"x-lora-user": user})
            lorax = await client.post("/generate", json={"inputs": "hi", "parameters": {
                "adapter_id": "fin", "max_new_tokens": 2}}, headers={"x-lora-user": user})
            versions = {openai.headers[VERSION_HEADER], lorax.headers[VERSION_HEADER]}
            seen.setdefault(user, set()).update(versions)
    assert all(len(versions) == 1 for versions in seen.values()), f"one user, one version: {seen}"
    assert {v for versions in seen.values() for v in versions} == {"1", "2"}, "both versions serve users"

"""Per-version release metrics: requests, errors and TTFT of the stable and the candidate version
of a running release, under labels bounded to those two versions per name and to
`metrics_max_adapter_labels` names; the series go when the release ends. Measured at the ingress
(no Ray) and read back from the ingress's `/metrics`."""

from __future__ import annotations

from typing import Any

from app_client import FakeDispatcher, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.errors import EngineStepError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.serve.ops.metrics import REGISTRY
from lora_cluster.serve.ops.release_metrics import ReleaseGauges, ReleaseMetrics
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation

REQUESTS = "lora_cluster_release_version_requests_total"
ERRORS = "lora_cluster_release_version_errors_total"
TTFT_COUNT = "lora_cluster_release_version_time_to_first_token_seconds_count"


def sample(name: str, adapter: str, version: int, role: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"adapter": adapter, "version": str(version), "role": role})


def test_only_the_two_versions_of_a_running_release_have_series():
    running = {"m-fin": (1, 2)}
    metrics = ReleaseMetrics(max_names=1)
    metrics.record("m-fin", 1, running.get, ok=True, ttft_s=0.2)
    metrics.record("m-fin", 2, running.get, ok=False)
    metrics.record("m-fin", 3, running.get, ok=True, ttft_s=0.1)  # pinned, outside the release
    metrics.record("m-none", 1, running.get, ok=True, ttft_s=0.1)  # no release
    assert sample(REQUESTS, "m-fin", 1, "stable") == 1.0, "the stable version's request is counted"
    assert sample(TTFT_COUNT, "m-fin", 1, "stable") == 1.0, "with its TTFT"
    assert sample(REQUESTS, "m-fin", 2, "candidate") == 1.0, "the candidate's failed request is counted"
    assert sample(ERRORS, "m-fin", 2, "candidate") == 1.0, "as an error"
    assert sample(TTFT_COUNT, "m-fin", 2, "candidate") is None, "a failure has no TTFT"
    assert sample(REQUESTS, "m-fin", 3, "stable") is None, "a version outside the release has no series"
    assert sample(REQUESTS, "m-none", 1, "stable") is None, "nor a name without a release"


def test_names_beyond_the_bound_have_no_series_and_an_ended_release_loses_its_own():
    running = {"b-one": (1, 2), "b-two": (4, 5)}
    metrics = ReleaseMetrics(max_names=1)
    metrics.record("b-one", 2, running.get, ok=True, ttft_s=0.1)
    metrics.record("b-two", 5, running.get, ok=True, ttft_s=0.1)
    assert metrics.names() == ["b-one"], "one name at most has series"
    assert sample(REQUESTS, "b-two", 5, "candidate") is None, "the second name is not counted"
    del running["b-one"]  # its release was promoted
    metrics.record("b-two", 5, running.get, ok=True, ttft_s=0.1)
    assert sample(REQUESTS, "b-one", 2, "candidate") is None, "the ended release's series are dropped"
    assert metrics.names() == ["b-two"], "and its place goes to the next name under release"


CONFIG = ServeConfig(model="base", release_canary_steps=[50, 100], release_step_min_requests=1000,
                     release_gate_min_requests=1000)


class FailsOnRequest(FakeDispatcher):
    """Version 2 of `mx` fails the request whose `x-request-id` is "fail"; every other one answers."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id == "mx@2" and job.http_request_id == "fail":
            raise EngineStepError("the candidate's step failed")
        return await super().start(job, route)


async def test_the_ingress_counts_each_version_of_a_release_on_its_metrics_endpoint():
    async with serving(FakeTokenizer(), FailsOnRequest(), CONFIG) as client:
        first = {"lora_name": "mx", "lora_path": "/zoo/mx-1"}
        loaded = await client.post("/v1/load_lora_adapter", json=first)
        assert loaded.status_code == 200, loaded.text
        await client.post("/v1/adapters/mx/releases", json={"lora_path": "/zoo/mx-2"})
        versions: dict[str, int] = {}
        for i in range(40):  # bounded: at 50% about half of 40 users reach the candidate
            answer: Any = await client.post("/v1/completions", json={"model": "mx", "prompt": "hi",
                                                                     "max_tokens": 2, "user": f"u{i}"})
            version = answer.headers.get("x-lora-adapter-version", "failed")
            versions[version] = versions.get(version, 0) + 1
        failed = await client.post("/v1/completions", json={"model": "mx@2", "prompt": "hi", "max_tokens": 2},
                                   headers={"x-request-id": "fail"})
        scraped = (await client.get("/metrics")).text
    lines = [line for line in scraped.splitlines() if line.startswith(REQUESTS) and 'adapter="mx"' in line]
    assert failed.status_code >= 500, f"the pinned candidate's request failed: {failed.text}"
    assert f'{REQUESTS}{{adapter="mx",role="stable",version="1"}} {float(versions["1"])}' in lines, \
        f"the stable version's requests: {lines}"
    assert f'{REQUESTS}{{adapter="mx",role="candidate",version="2"}} {float(versions["2"] + 1)}' in lines, \
        f"the candidate's requests, the failed one included: {lines}"
    assert f'{ERRORS}{{adapter="mx",role="candidate",version="2"}} 1.0' in scraped, "its error is counted"
    assert len(lines) == 2, "two series for the name: its stable version and its candidate"


class Clock:
    """A wall clock the test moves (Unix seconds)."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def gauges(book: ReleaseBook, clock: Clock, max_names: int = 10) -> dict[str, dict[tuple[str, ...], float]]:
    """Each release gauge's samples by label values, from one collection."""
    collected = ReleaseGauges(book, max_names, clock).collect()
    return {family.name: {tuple(s.labels.values()): s.value for s in family.samples} for family in collected}


def release_book(clock: Clock) -> ReleaseBook:
    """Six names' latest releases, started 100 s apart: canary (1%), evaluating, rolled back by the eval
    gate, by a live gate (two errors of the candidate), by hand, and promoted."""
    book = ReleaseBook(ReleaseSettings(steps=(1.0, 100.0), gate_min_requests=2), clock)
    decisions = {
        "g-canary": lambda r: r.eval_passed({}),
        "g-eval": lambda r: None,
        "g-evalfail": lambda r: r.eval_failed("the candidate scored 0.1 against 0.9", {}),
        "g-gate": lambda r: (r.eval_passed({}), [book.record("g-gate", 2, ok=False) for _ in range(2)]),
        "g-manual": lambda r: book.command("g-manual", r.id, "rollback"),
        "g-promoted": lambda r: book.command("g-promoted", r.id, "promote"),
    }
    for i, (name, decide) in enumerate(decisions.items()):  # each decided when it starts
        clock.now = 1000.0 + 100 * i
        decide(book.start(name, f"rel-{i}", 1, 2))
    return book


def test_the_release_gauges_show_each_running_release_in_its_step_and_each_rollback_with_its_cause():
    clock = Clock(0.0)
    book = release_book(clock)
    clock.now = 5000.0
    seen = gauges(book, clock)
    steps = seen["lora_cluster_release_step_seconds"]
    assert steps == {("g-canary", "canary"): 4000.0, ("g-eval", "evaluating"): 3900.0}, \
        f"seconds in the current step of the two running releases, by state: {steps}"
    shares = seen["lora_cluster_release_candidate_share_ratio"]
    assert shares == {("g-canary",): 0.01, ("g-eval",): 0.0}, f"the candidate's share of traffic: {shares}"
    rollbacks = seen["lora_cluster_release_rollback_timestamp_seconds"]
    assert rollbacks == {("g-evalfail", "eval"): 1200.0, ("g-gate", "gate"): 1300.0,
                         ("g-manual", "manual"): 1400.0}, f"when and why each was rolled back: {rollbacks}"


def test_the_release_gauges_keep_the_longest_stuck_and_the_latest_rollback_within_the_bound():
    clock = Clock(0.0)
    book = release_book(clock)
    clock.now = 5000.0
    seen = gauges(book, clock, max_names=1)
    assert list(seen["lora_cluster_release_step_seconds"]) == [("g-canary", "canary")], \
        "one name at most: the one longest in its step"
    assert list(seen["lora_cluster_release_rollback_timestamp_seconds"]) == [("g-manual", "manual")], \
        "one name at most: the latest rollback"


async def test_the_ingress_exports_the_release_gauges_on_its_metrics_endpoint():
    async with serving(FakeTokenizer(), FakeDispatcher(), CONFIG) as client:
        await client.post("/v1/load_lora_adapter", json={"lora_name": "mg", "lora_path": "/zoo/mg-1"})
        release = (await client.post("/v1/adapters/mg/releases", json={"lora_path": "/zoo/mg-2"})).json()
        running = (await client.get("/metrics")).text
        await client.post(f"/v1/adapters/mg/releases/{release['id']}/rollback")
        rolled_back = (await client.get("/metrics")).text
    assert 'lora_cluster_release_step_seconds{adapter="mg",state="canary"}' in running, \
        "the running release's time in its step is scraped"
    assert 'lora_cluster_release_candidate_share_ratio{adapter="mg"} 0.5' in running, "and its share"
    assert 'lora_cluster_release_rollback_timestamp_seconds{adapter="mg",cause="manual"}' in rolled_back, \
        "a rollback by hand is scraped with its cause"
    assert 'lora_cluster_release_step_seconds{adapter="mg"' not in rolled_back, \
        "a release that ended has no step gauge"

"""A release on four ingress replicas for real (Ray Serve, conftest's `tenants_app`, with its
`release_state_uri` folder: `shared_apps.tenants_config`): a tenant releases its own adapter with a
candidate from the adapter source, every ingress answers the same release at the same step, their live
evidence (and their shadow copies' comparisons) adds up in the shared state, and an ingress replica
killed in the middle of the release comes back (Serve starts a new one) and resumes it at the same step,
with its events. The release's metrics are in the live scrape: its per-version counters, its seconds in
the step and candidate share, and its rollback with the cause. Then the controllers: lora-cluster's
cluster controller, Ray Serve's own controller and the adapter registry are killed (Serve restarts them)
under a bounded loop of live requests of the released name; the release resumes at the same step with
its events, its evidence keeps adding up, and every request is answered. Last, the ingress running a
release's eval gate is killed mid-gate: another ingress takes the gate's lease once it expires and runs
the gate again, so the release does not stay evaluating.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import cluster_view, wait_until
from shared_apps import ADMIN, INGRESSES, RELEASER

from lora_cluster.serve.ops.ray_internals import serve_controller_name

pytestmark = pytest.mark.e2e

BOUND_S = 180.0  # every wait in this module is bounded
NAME = "a-rel"
URL = f"/v1/adapters/{NAME}/releases"
REQUESTS = 16
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_url(tenants_app):
    return tenants_app


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=BOUND_S, headers={"authorization": f"Bearer {ADMIN}"}) as c:
        yield c


def _ingress_actor(ingress_id: str):
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{ingress_id}") and "LoraIngress" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no live actor for ingress {ingress_id}")


def _statuses(http: httpx.Client, path: str, want: int, skip: frozenset[str] = frozenset(),
              most: int = 1000) -> dict[str, httpx.Response]:
    """GET `path` until `want` ingresses outside `skip` answered 200, or `most` calls or BOUND_S
    passed: the last 200 of each ingress (answers of a replica going away are skipped). A new
    replica takes Serve some seconds to start: after every 40 calls that missed, a pause."""
    seen: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + BOUND_S
    for i in range(most):
        if len(seen) >= want or time.monotonic() > deadline:
            break
        r = http.get(path)
        ingress = r.headers.get("x-lora-ingress", "?")
        if r.status_code == 200 and ingress not in skip:
            seen[ingress] = r
        if i % 40 == 39:
            time.sleep(2.0)
    return seen


def test_a_tenants_release_is_one_for_every_ingress_and_survives_an_ingress_restart(http, demo_zoo):
    first = {"lora_name": NAME, "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    body = {"lora_path": "a4", "steps": [50, 100], "step_min_requests": 1000, "step_dwell_s": 0,
            "shadow_percent": 50}
    created = http.post(URL, headers={"authorization": f"Bearer {RELEASER}"}, json=body)
    assert created.status_code == 200, f"the tenant releases its own adapter from the source: {created.text}"
    release = created.json()
    status_path = f"{URL}/{release['id']}"
    before = _statuses(http, status_path, INGRESSES)  # each status call reads the shared state
    greedy = {"model": NAME, "prompt": "the river", "max_tokens": 2, "temperature": 0}
    answers = [http.post("/v1/completions", json={**greedy, "user": f"user-{i}"}) for i in range(REQUESTS)]
    counted, shadowed = 0, 0
    deadline = time.monotonic() + 30  # every ingress writes its evidence within release_sync_s
    while (counted < REQUESTS or not shadowed) and time.monotonic() < deadline:
        stats = http.get(status_path).json()["stats"]
        counted = stats["candidate"]["requests"] + stats["stable"]["requests"]
        shadowed = stats["shadow"]["requests"]
        time.sleep(0.5)
    events = http.get(f"{status_path}/events").json()["data"]
    running_scrape = http.get("/metrics").text
    victim = next(iter(before))
    _kill(victim)
    after = _statuses(http, status_path, 1, skip=frozenset(before))
    events_after = _statuses(http, f"{status_path}/events", 1, skip=frozenset(before))
    pinned = _statuses(http, "/v1/models", 1, skip=frozenset(before))
    http.post(f"{status_path}/rollback")
    rollback = f'lora_cluster_release_rollback_timestamp_seconds{{adapter="{NAME}",cause="manual"}}'
    rolled_back_scrape = _scrape_until(http, rollback)
    http.post("/v1/unload_lora_adapter", json={"lora_name": NAME})
    assert [a.status_code for a in answers] == [200] * REQUESTS, "every request of the bare name is served"
    assert {a.headers["x-lora-adapter-version"] for a in answers} == {"1", "2"}, "both versions serve at 50%"
    assert counted == REQUESTS, f"the evidence of every ingress adds up to the {REQUESTS} requests: {counted}"
    assert shadowed >= 1, "shadow copies of the stable version's greedy answers ran on the candidate"
    assert len(before) == INGRESSES, f"every ingress answered the release's status: {sorted(before)}"
    views = {(r.json()["state"], r.json()["step"], r.json()["percent"]) for r in before.values()}
    assert views == {("canary", 0, 50.0)}, f"every ingress sees one release at one step: {views}"
    assert after, "a new ingress replica took the killed one's place and answered"
    resumed = next(iter(after.values())).json()
    assert (resumed["state"], resumed["step"], resumed["percent"]) == ("canary", 0, 50.0), (
        f"the new ingress resumes the release at the same step: {resumed}")
    assert next(iter(events_after.values())).json()["data"][:len(events)] == events, (
        "the audit log survives the restart, every event with its evidence")
    listed = [m["id"] for m in next(iter(pinned.values())).json()["data"]]
    assert f"{NAME}@2" in listed, f"the new ingress serves the candidate version: {listed}"
    assert f'lora_cluster_release_step_seconds{{adapter="{NAME}",state="canary"}}' in running_scrape, \
        "the scrape shows the running release's seconds in its step"
    assert f'lora_cluster_release_candidate_share_ratio{{adapter="{NAME}"}} 0.5' in running_scrape, \
        "and its candidate's share"
    assert rollback in rolled_back_scrape, "a manual rollback is scraped with its cause (any ingress)"
    # no request here fails for the version's sake: the errors counter has no series (test_release_metrics
    # scrapes one on the ingress)
    used = _release_names_used() - {"lora_cluster_release_version_errors_total"}
    missing = sorted(used - _exported(running_scrape) - _exported(rolled_back_scrape))
    assert not missing, f"release metrics the dashboard or alerts use that the live scrape lacks: {missing}"


def _release_names_used() -> set[str]:
    """The lora_cluster_release_* names the Grafana dashboard and the release alerts query."""
    paths = ("deploy/grafana/lora-cluster.json", "deploy/k8s/releases.yaml")
    texts = [(ROOT / path).read_text() for path in paths]
    return set(re.findall(r"\blora_cluster_release_[a-z0-9_]+", "\n".join(texts)))


def _exported(scrape: str) -> set[str]:
    """The sample names of a scrape."""
    lines = [line for line in scrape.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in lines}


def _scrape_until(http: httpx.Client, series: str) -> str:
    """GET /metrics until a scrape has `series` (the ingress that answers follows the shared state
    within release_sync_s), bounded; the last scrape."""
    deadline = time.monotonic() + 30
    scrape = http.get("/metrics").text
    while series not in scrape and time.monotonic() < deadline:
        time.sleep(0.5)
        scrape = http.get("/metrics").text
    return scrape


def _kill(ingress_id: str) -> None:
    import ray

    ray.kill(_ingress_actor(ingress_id), no_restart=True)


RESTART_NAME = "a-restart"
LOAD_REQUESTS = 800  # the live loop's bound in requests (and LOAD_S in seconds)
LOAD_S = 120.0
CLIENTS = 4  # at once: more than the LoRA replica's 2 slots, so that some requests park at the controller


def _live_traffic(base_url: str, stop: threading.Event) -> list[tuple[int, str]]:
    """Requests of the bare released name from CLIENTS threads, until `stop`, LOAD_REQUESTS or LOAD_S:
    (status, x-lora-adapter-version) of each."""
    answers: list[tuple[int, str]] = []
    deadline = time.monotonic() + LOAD_S
    lock = threading.Lock()

    def client(k: int) -> None:
        headers = {"authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=base_url, timeout=BOUND_S, headers=headers) as c:
            for i in range(LOAD_REQUESTS // CLIENTS):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                r = c.post("/v1/completions", json={"model": RESTART_NAME, "prompt": "the river",
                                                    "max_tokens": 4, "user": f"user-{k}-{i % 8}"})
                with lock:
                    answers.append((r.status_code, r.headers.get("x-lora-adapter-version", "")))

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        for future in [pool.submit(client, k) for k in range(CLIENTS)]:
            future.result(timeout=LOAD_S + BOUND_S)
    return answers


def _controller_actor(http: httpx.Client) -> str | None:
    """The cluster controller's actor name, None while it cannot be reached (a 503)."""
    r = http.get("/v1/cluster")
    return r.json()["controller"]["actor"] if r.status_code == 200 else None


def _actor_named(deployment: str):
    """The live actor of the one replica of `deployment` in the app."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"#{deployment}#" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no live actor of {deployment}")


def _serve_answers() -> bool:
    """Serve's controller answers (`serve.status()` calls it)."""
    from ray import serve

    return bool(serve.status().applications)


def _counted(http: httpx.Client, status_path: str) -> int:
    stats = http.get(status_path).json()["stats"]
    return stats["candidate"]["requests"] + stats["stable"]["requests"]


def test_killing_the_controllers_mid_release_resumes_it_at_its_step_and_fails_no_request(base_url, http,
                                                                                         demo_zoo):
    import ray

    first = {"lora_name": RESTART_NAME, "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    body = {"lora_path": str(demo_zoo.adapters_dir / "a4"), "steps": [50, 100], "step_min_requests": 100_000,
            "step_dwell_s": 0}
    created = http.post(f"/v1/adapters/{RESTART_NAME}/releases", json=body)
    assert created.status_code == 200, f"the release starts: {created.text}"
    status_path = f"/v1/adapters/{RESTART_NAME}/releases/{created.json()['id']}"
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as runner:
        load = runner.submit(_live_traffic, base_url, stop)
        try:
            wait_until(lambda: _counted(http, status_path) >= 8, BOUND_S, "live evidence in the shared state")
            before = http.get(status_path).json()
            events = http.get(f"{status_path}/events").json()["data"]
            controller = cluster_view(http)["controller"]["actor"]
            ray.kill(ray.get_actor(controller, namespace="serve"), no_restart=False)
            wait_until(lambda: _controller_actor(http) not in (None, controller), BOUND_S,
                       "Serve to start a new cluster controller")
            name, namespace = serve_controller_name()
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=False)
            wait_until(_serve_answers, BOUND_S, "Serve to restart its controller")
            registry = _actor_named("AdapterRegistry")
            ray.kill(registry, no_restart=False)  # the adapters loaded through the API, for every ingress
            counted_before = _counted(http, status_path)
            wait_until(lambda: _counted(http, status_path) >= counted_before + 8, BOUND_S,
                       "live evidence after both controllers' restarts")
        finally:
            stop.set()
            answers = load.result(timeout=LOAD_S + BOUND_S)
    after = http.get(status_path).json()
    events_after = http.get(f"{status_path}/events").json()["data"]
    http.post(f"{status_path}/rollback")
    http.post("/v1/unload_lora_adapter", json={"lora_name": RESTART_NAME})
    failed = [status for status, _ in answers if status != 200]
    assert not failed, f"no request fails while the controllers restart: {failed} of {len(answers)}"
    assert {version for _, version in answers} == {"1", "2"}, "both versions keep serving at 50%"
    assert (before["state"], before["step"]) == ("canary", 0), f"the release ran its first step: {before}"
    assert (after["state"], after["step"], after["percent"]) == ("canary", 0, 50.0), (
        f"the release resumes at the same step after both controllers restarted: {after}")
    assert events_after[:len(events)] == events, "the audit log is intact, every event with its evidence"
    counted = after["stats"]["candidate"]["requests"] + after["stats"]["stable"]["requests"]
    assert counted >= counted_before + 8, f"the step's evidence keeps adding up after the restarts: {counted}"


GATE_NAME = "a-gate"
EVAL_CASES = 40  # enough that the gate still runs when its ingress is killed (both versions, greedy)


def _evaluating_at(http: httpx.Client) -> tuple[str, str] | None:
    """(release id, ingress running its gate) while the latest release of GATE_NAME evaluates."""
    r = http.get(f"/v1/adapters/{GATE_NAME}/releases")
    data = r.json()["data"] if r.status_code == 200 else []
    if data and data[-1]["state"] == "evaluating" and data[-1]["lease"]:
        return data[-1]["id"], data[-1]["lease"]["owner"]
    return None


def test_an_eval_gate_whose_ingress_dies_is_run_again_by_another_ingress(base_url, http, demo_zoo):
    first = {"lora_name": GATE_NAME, "lora_path": str(demo_zoo.adapters_dir / "a3")}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200, "version 1 loads"
    cases = [{"prompt": f"the river {i}", "expected": "no version writes this"} for i in range(EVAL_CASES)]
    body = {"lora_path": str(demo_zoo.adapters_dir / "a4"), "eval_set": cases, "steps": [50, 100],
            "step_min_requests": 100_000}
    with concurrent.futures.ThreadPoolExecutor(1) as runner:
        creating = runner.submit(http.post, f"/v1/adapters/{GATE_NAME}/releases", json=body)
        release_id, owner = wait_until(lambda: _evaluating_at(http), BOUND_S, "the gate running somewhere")
        _kill(owner)
        try:
            created = creating.result(timeout=BOUND_S).status_code
        except httpx.HTTPError as exc:  # the ingress went away with the call
            created = type(exc).__name__
    status_path = f"/v1/adapters/{GATE_NAME}/releases/{release_id}"

    def judged() -> dict | None:
        r = http.get(status_path)
        return r.json() if r.status_code == 200 and r.json()["state"] != "evaluating" else None

    status = wait_until(judged, BOUND_S, "another ingress to run the gate again")
    events = http.get(f"{status_path}/events").json()["data"]
    http.post(f"{status_path}/rollback")
    http.post("/v1/unload_lora_adapter", json={"lora_name": GATE_NAME})
    kinds = [e["kind"] for e in events]
    taken = [e for e in events if e["kind"] == "gate_taken_over"]
    assert created != 200, f"the create call died with its ingress, mid-gate: {created}"
    assert status["state"] == "canary", f"the gate ran again elsewhere and passed (both score 0): {events}"
    assert kinds == ["created", "gate_taken_over", "eval_passed"], f"the audit log: {events}"
    assert taken[0]["evidence"]["previous_owner"] == owner, f"it names the dead ingress: {taken[0]}"
    assert taken[0]["evidence"]["owner"] != owner, "a live ingress took the gate over"

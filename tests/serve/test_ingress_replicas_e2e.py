"""Four ingress replicas for real (Ray Serve, the tiny demo zoo, one LoRA replica of two batch slots,
the cluster controller on, a tenants file: conftest's `tenants_app`, shared with test_quotas_e2e.py:
`shared_apps.tenants_config`): every response says which ingress answered (`x-lora-ingress`), and

* requests spread over the four ingresses;
* a tenant's requests_per_minute holds for the cluster, not per ingress;
* an adapter loaded through one ingress is listed and served by every ingress, a second load of its
  name through any ingress is a conflict, and an ingress that did not load it unloads it;
* a burst larger than the replica's slots parks in the cluster queue from several ingresses, and
  every request completes;
* every scrape of /metrics, whichever ingress answers it, counts the requests of all of them.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from shared_apps import ADMIN, FIN, INGRESSES, RPM

pytestmark = pytest.mark.e2e

BOUND_S = 120.0  # every wait in this module is bounded
BODY = {"model": "a1", "prompt": "the river", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def base_url(tenants_app):
    return tenants_app


def _post(url: str, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=BOUND_S) as client:
        return client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


def _get(url: str, path: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=BOUND_S) as client:
        return client.get(path, headers={"authorization": f"Bearer {ADMIN}"})


def _by_ingress(responses: list[httpx.Response]) -> dict[str, list[httpx.Response]]:
    out: dict[str, list[httpx.Response]] = {}
    for r in responses:
        out.setdefault(r.headers.get("x-lora-ingress", "?"), []).append(r)
    return out


def _from_every_ingress(call, most: int = 600) -> dict[str, list[httpx.Response]]:
    """Repeat `call` until every ingress has answered at least once, or `most` calls or BOUND_S have
    passed. Serve's proxy spreads requests by its own choice, which need not reach all four in 40,
    nor in 200 back-to-back calls on a loaded machine (seen once: its view of one replica's queue was
    stale), so after every 50 calls that missed an ingress the loop pauses for a second."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + BOUND_S
    while len(answers) < most and time.monotonic() < deadline:
        answers.append(call())
        if len(answers) >= 8 and len(_by_ingress(answers)) >= INGRESSES:
            break
        if len(answers) % 50 == 0:
            time.sleep(1.0)
    return _by_ingress(answers)


def test_four_ingress_replicas_run_and_requests_spread_over_them(base_url):
    from ray import serve

    status = serve.status().applications["tenants"].deployments["LoraIngress"]
    running = sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))
    assert running == INGRESSES, f"{INGRESSES} ingress replicas serve the app: {status.replica_states}"
    # rounds of 40 until every ingress answered (a proxy learns of a new replica within a few
    # seconds of it running), bounded in count and time
    answers: list = []
    deadline = time.monotonic() + 60
    while len(answers) < 400 and time.monotonic() < deadline:
        answers += [_post(base_url, "/v1/completions", BODY) for _ in range(40)]
        if len({r.headers.get("x-lora-ingress") for r in answers}) >= INGRESSES:
            break
    assert all(r.status_code == 200 for r in answers), f"every request is served: {answers[-1].text}"
    spread = Counter(r.headers.get("x-lora-ingress") for r in answers)
    assert None not in spread, "every response names the ingress that answered it"
    assert len(spread) == INGRESSES, f"{len(answers)} requests went through every ingress: {spread}"


def test_a_tenant_quota_holds_across_the_ingresses(base_url):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        burst = list(pool.map(lambda _: _post(base_url, "/v1/completions", BODY, FIN), range(3 * RPM)))
    ok = [r for r in burst if r.status_code == 200]
    refused = [r for r in burst if r.status_code == 429]
    assert len(ok) + len(refused) == len(burst), f"each is served or refused: {[r.text for r in burst]}"
    assert len(_by_ingress(burst)) > 1, "the burst went through several ingresses"
    assert len(ok) <= RPM + 1, (
        f"{len(ok)} of {len(burst)} requests passed: the {RPM}/min quota is shared by the {INGRESSES} "
        "ingresses (one quota each would let up to four times as many through), plus at most one refill")
    assert all("requests_per_minute" in r.json()["error"]["message"] for r in refused), "429s name the limit"


def test_an_adapter_loaded_through_one_ingress_is_served_by_all(base_url, demo_zoo):
    loaded = _post(base_url, "/v1/load_lora_adapter",
                   {"lora_name": "reg-a3", "lora_path": str(demo_zoo.adapters_dir / "a3")})
    assert loaded.status_code == 200, f"the load succeeds: {loaded.text}"
    loader = loaded.headers["x-lora-ingress"]
    listings = _from_every_ingress(lambda: _get(base_url, "/v1/models"))
    assert len(listings) == INGRESSES, f"the listings came from every ingress: {sorted(listings)}"
    for ingress, answers in listings.items():
        for r in answers:
            assert "reg-a3" in [m["id"] for m in r.json()["data"]], f"ingress {ingress} lists the adapter"
    served = _from_every_ingress(lambda: _post(base_url, "/v1/completions", {**BODY, "model": "reg-a3"}))
    assert len(served) == INGRESSES, f"the requests went through every ingress: {sorted(served)}"
    for ingress, answers in served.items():
        assert [r.status_code for r in answers] == [200] * len(answers), f"ingress {ingress} serves it"
    again = [_post(base_url, "/v1/load_lora_adapter", {"lora_name": "reg-a3", "lora_path": "/nowhere"})
             for _ in range(8)]
    assert [r.status_code for r in again] == [409] * 8, (
        f"a second load is a conflict through every ingress: {[(r.status_code, r.text) for r in again]}"
    )
    for _ in range(40):  # until an ingress other than the loader answers the unload
        unload = _post(base_url, "/v1/unload_lora_adapter", {"lora_name": "reg-a3"})
        if unload.headers.get("x-lora-ingress") != loader or unload.status_code != 200:
            break
        _post(base_url, "/v1/load_lora_adapter",
              {"lora_name": "reg-a3", "lora_path": str(demo_zoo.adapters_dir / "a3")})
    assert unload.headers.get("x-lora-ingress") != loader, "an ingress other than the loader answered"
    assert unload.status_code == 200, f"it unloads what another ingress loaded: {unload.text}"
    gone = [_post(base_url, "/v1/completions", {**BODY, "model": "reg-a3"}) for _ in range(8)]
    assert [r.status_code for r in gone] == [404] * 8, "no ingress serves it after the unload"


def test_requests_parked_from_several_ingresses_all_complete(base_url):
    body = {**BODY, "max_tokens": 24, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        burst = list(pool.map(lambda _: _post(base_url, "/v1/completions", body), range(24)))
    assert [r.status_code for r in burst] == [200] * 24, f"every request completes: {burst[-1].text}"
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in burst), "each with all its tokens"
    views: dict[str, dict] = {}
    deadline = time.monotonic() + BOUND_S
    while len(views) < INGRESSES and time.monotonic() < deadline:
        r = _get(base_url, "/v1/cluster")
        assert r.status_code == 200, f"/v1/cluster answers: {r.text}"
        views[r.headers["x-lora-ingress"]] = r.json()["ingress"]["admission"]
    parked = {ingress: counts.get("parked", 0) for ingress, counts in views.items()}
    assert sum(1 for n in parked.values() if n) >= 2, f"requests parked from several ingresses: {views}"
    for ingress, counts in views.items():
        assert counts.get("parked", 0) == counts.get("granted", 0) + counts.get("preempting", 0) \
            + counts.get("fallback", 0), f"ingress {ingress}: every parked request was granted: {counts}"


def _scrape(url: str) -> tuple[str, float, dict[str, float]]:
    """(the ingress that answered, its lora_cluster_requests_total of /v1/completions, hub gauges)."""
    r = _get(url, "/metrics")
    assert r.status_code == 200, f"/metrics answers: {r.text[:200]}"
    completions, hub = 0.0, {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "lora_cluster_requests_total" and s.labels.get("route") == "/v1/completions":
                completions += s.value
            elif s.name.startswith("lora_cluster_metrics_hub_"):
                hub[s.name] = s.value
    return r.headers["x-lora-ingress"], completions, hub


def test_every_scrape_of_metrics_counts_the_requests_of_every_ingress(base_url):
    n = 24
    answers = [_post(base_url, "/v1/completions", BODY) for _ in range(n)]
    assert [r.status_code for r in answers] == [200] * n, f"every request is served: {answers[-1].text}"
    assert len(_by_ingress(answers)) > 1, "the requests went through several ingresses"
    deadline = time.monotonic() + BOUND_S  # each ingress's figures reach the hub within its push period
    while True:
        scrapes = [_scrape(base_url) for _ in range(8)]
        answered = {ingress for ingress, _, _ in scrapes}
        totals = {total for _, total, _ in scrapes}
        summed = {hub.get("lora_cluster_metrics_hub_ingresses") for _, _, hub in scrapes}
        if (len(answered) > 1 and len(totals) == 1 and summed == {INGRESSES}) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert len(answered) > 1, f"several ingresses answered the scrapes: {scrapes}"
    assert len(totals) == 1, f"every scrape, whichever ingress answered, reports the same total: {scrapes}"
    assert totals.pop() >= n, f"that total counts the {n} requests spread over the ingresses: {scrapes}"
    assert all(hub.get("lora_cluster_metrics_hub_up") == 1 for _, _, hub in scrapes), (
        f"each scrape is the hub's sum: {scrapes}")
    assert summed == {INGRESSES}, f"each sums the {INGRESSES} ingresses: {scrapes}"

"""Tenant quotas on one real Ray Serve app with four ingress replicas sharing one quota ledger (conftest's
`tenants_app`, shared with test_ingress_replicas_e2e.py: `shared_apps.tenants_config`, this module's
tenants `quota-fin` and `quota-hr` its own): a tenant at 3x its requests_per_minute is held to it across
the replicas (every 429 with Retry-After) while another tenant is served."""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import httpx
import pytest
from shared_apps import INGRESSES, QUOTA_ADMIN, QUOTA_FIN, QUOTA_HR, RPM

from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import ServeConfig


@pytest.fixture(scope="module")
def ingresses(tenants_app):
    return tenants_app


@pytest.mark.e2e
def test_the_ingress_replicas_share_one_quota(ingresses, tmp_path):
    from ray import serve

    body = {"model": "a1", "prompt": "the river", "max_tokens": 1, "temperature": 0}

    def post(key: str) -> httpx.Response:
        with httpx.Client(base_url=ingresses, timeout=60) as client:
            return client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})

    def timed(key: str) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        return post(key), time.perf_counter() - start

    post(QUOTA_HR)  # warm: the adapter is loaded, the ingresses have their leases
    idle = [timed(QUOTA_HR)[1] for _ in range(6)]  # the other tenant's latency before the burst
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        burst = [pool.submit(post, QUOTA_FIN) for _ in range(3 * RPM)]
        during = [timed(QUOTA_HR) for _ in range(6)]  # ... and while finance runs at 3x its quota
        fin = [f.result() for f in burst]
    hr = [r for r, _ in during]
    status = serve.status().applications["tenants"].deployments["LoraIngress"]
    running = sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))
    assert running == INGRESSES, f"{INGRESSES} ingress replicas serve the app: {status.replica_states}"
    ok = [r for r in fin if r.status_code == 200]
    refused = [r for r in fin if r.status_code == 429]
    assert len(ok) + len(refused) == len(fin), f"every request is served or refused: {[r.text for r in fin]}"
    assert len(ok) <= RPM + 1, (
        f"{len(ok)} of {len(fin)} requests passed: the {RPM}/min quota is shared by the {INGRESSES} ingress "
        f"replicas (separate quotas would let up to {INGRESSES} times as many through), plus at most one "
        "refill")
    assert refused and all("retry-after" in r.headers for r in refused), "every 429 carries Retry-After"
    assert all("requests_per_minute" in r.json()["error"]["message"] for r in refused), "each names the limit"
    assert [r.status_code for r in hr] == [200] * 6, "the other tenant is served meanwhile"
    target = build_sla_classes(ServeConfig()).default  # hr's class: its file names none
    slowest, p50 = max(t for _, t in during), statistics.median(t for _, t in during)
    assert slowest <= target.ttft_s, (
        f"the other tenant's requests (1 token) stay within the {target.name} class's {target.ttft_s:g} s "
        f"target while finance is throttled: slowest {slowest * 1e3:.0f} ms, p50 {p50 * 1e3:.0f} ms "
        f"(idle p50 {statistics.median(idle) * 1e3:.0f} ms)")
    with httpx.Client(base_url=ingresses, timeout=60) as client:
        missing = tmp_path / "no-such-adapter"
        load = client.post("/v1/load_lora_adapter", headers={"x-api-key": QUOTA_ADMIN},
                           json={"lora_name": "a-new", "lora_path": str(missing)})
        anonymous = client.post("/v1/completions", json=body)
    assert load.status_code == 404, f"loading a missing path is a 404: {load.text}"
    assert str(tmp_path) not in load.text, f"the 404 does not show the server's path: {load.text}"
    assert anonymous.status_code == 401, "no key: 401 through the real proxy too"

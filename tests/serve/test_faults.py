"""Faults injected for real (issue 10, part 3): S3 going away, corrupt adapters, a replica process
killed mid-stream, and 3x the cluster's rated load.

* The adapter store against moto's S3 server behind a failure-injecting TCP proxy: the server dies
  in the middle of a download; after `breaker_source_failures` failures in a row cold loads fail at
  once with a 503 naming the source (scheme and bucket only), cached adapters keep serving, and once
  the server is back the half-open probe closes the breaker.
* One Ray Serve application (two LoRA replicas, controller off, adapters from S3 through the proxy):
  a corrupt adapter pushed under an existing name is a 400, never a 500; S3 stopped mid-load
  answers 503 with Retry-After, resident adapters keep serving, and S3 restarted serves again; a
  replica actor killed (`ray.kill`) mid-stream ends that stream with an SSE error event while the
  non-streaming requests it held are retried on the other replica (none is lost), and Serve's new
  replica serves; at 3x the rated QPS every request is answered 200, 429 or 503 with Retry-After,
  none hangs, and the Ray processes' RSS stays flat over a second round.
Every wait is bounded. Fault counts and lost requests are printed (`-s`) for the report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from helpers import FakeClock, poll
from remote_sources import TcpProxy

from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import AdapterLoadError, AdapterSourceUnavailableError
from lora_cluster.serve.http_errors import describe
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy

pytestmark = [pytest.mark.e2e, pytest.mark.own_ray]

BOUND_S = 60.0  # no request or wait in this module takes longer
BIG = "a2"  # rank 32, ~262 KB of weights: a download the proxy can cut in the middle
PROMPT = "the quick brown fox"


# ----- the store's source breaker (no Ray) ----------------------------------------------------


@pytest.fixture(scope="module")
def shapes(demo_model_dir: Path):
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


def test_s3_down_opens_the_source_breaker_and_a_probe_closes_it(s3, s3_proxy, demo_adapters_dir, shapes,
                                                                 tmp_path) -> None:
    for aid in ("a0", "a1", BIG, "a3"):
        s3.upload(demo_adapters_dir / aid, f"zoo/{aid}")
    s3.point_at(s3_proxy.endpoint)
    clock = FakeClock()  # the breaker's cool-down passes when the test says so, not with the machine's speed
    store = TieredAdapterStore([f"s3://{s3.bucket}/zoo"], AdmissionPolicy(shapes, 64),
                               disk_cache_dir=tmp_path / "disk", fetch_retries=0, fetch_timeout_s=5,
                               source_breaker_failures=2, source_breaker_cooldown_s=1.0, clock=clock)
    store.load("a0")
    s3_proxy.die_after = 64 << 10  # S3 goes away 64 KB into the next response
    with pytest.raises(AdapterLoadError) as first:
        store.load(BIG)
    assert not isinstance(first.value, AdapterSourceUnavailableError), "the first failure is S3's own"
    with pytest.raises(AdapterLoadError):
        store.load("a1")  # connection refused: the second failure in a row opens the breaker
    s3_proxy.restart()  # S3 is back, but the breaker is open until its cool-down has passed
    connections = s3_proxy.connections
    with pytest.raises(AdapterSourceUnavailableError) as fast:
        store.load("a3")
    assert s3_proxy.connections == connections, "an open source breaker fails a cold load without calling S3"
    error = describe(fast.value)
    assert (error.status, error.code) == (503, "source_unavailable"), f"503 source_unavailable: {error}"
    assert f"s3://{s3.bucket} " in error.message, f"the error names the source: {error.message}"
    assert "127.0.0.1" not in error.message and "zoo" not in error.message, \
        f"no endpoint or key prefix in the error: {error.message}"
    assert error.retry_after_header()["retry-after"] == "1", "Retry-After: the cool-down left"
    assert store.load("a0").adapter_id == "a0", "a cached adapter keeps serving while the breaker is open"
    clock.advance(1.0)
    assert store.load("a3").adapter_id == "a3", "after the cool-down one probe load reaches S3 again"
    assert s3_proxy.connections > connections, "the probe went to S3"
    assert store.snapshot()["breakers"][f"s3://{s3.bucket}"]["state"] == "closed", "the probe closed it"
    assert store.load(BIG).adapter_id == BIG, "the adapter cut mid-download loads once S3 is back"
    print("\nFAULTS store: S3 killed mid-download 1x, refused 2 loads; lost after restart: 0")


# ----- one Serve application: S3 through a proxy, two replicas, controller off -------------------


@pytest.fixture(scope="module")
def bucket(moto_endpoint, demo_adapters_dir):
    import boto3

    client = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                   region_name="us-east-1").client("s3", endpoint_url=moto_endpoint)
    name = f"faults-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=name)
    for folder in sorted(p for p in demo_adapters_dir.iterdir() if p.is_dir()):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.put_object(Bucket=name, Key=f"zoo/{folder.name}/{path.relative_to(folder).as_posix()}",
                              Body=path.read_bytes())
    return name, client


@pytest.fixture(scope="module")
def proxy(moto_endpoint):
    host, port = moto_endpoint.removeprefix("http://").split(":")
    p = TcpProxy((host, int(port)))
    yield p
    p.kill()


@pytest.fixture(scope="module")
def server(ray_app, demo_zoo, bucket, proxy, tmp_path_factory):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_MAX_ATTEMPTS": "1"}
    config = {
        "model": str(demo_zoo.model_dir), "adapter_source": [f"s3://{bucket[0]}/zoo"],
        "disk_cache_dir": str(tmp_path_factory.mktemp("disk")), "num_replicas": 2, "num_cpus": 1,
        "controller": False, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 4,
        "max_ongoing_requests": 8, "max_queued_requests": 8, "routing_stats_period_s": 0.2,
        "fetch_retries": 1, "fetch_backoff_s": 0.05, "fetch_timeout_s": 5.0,
        "breaker_source_failures": 2, "breaker_source_cooldown_s": 1.0, "breaker_cooldown_s": 1.0,
    }
    with ray_app(config, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=BOUND_S) as client:
        yield client


def _complete(http: httpx.Client, model: str | None, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return http.post("/v1/completions", json=body)


def _is_answer(r: httpx.Response) -> bool:
    """200, or 429/503 with Retry-After: what an overloaded or degraded server may answer."""
    return r.status_code == 200 or (r.status_code in (429, 503) and "retry-after" in r.headers)


def test_corrupt_adapter_pushed_under_an_existing_name_is_a_400(http, bucket) -> None:
    name, client = bucket
    good = client.get_object(Bucket=name, Key="zoo/a7/adapter_model.safetensors")["Body"].read()
    client.put_object(Bucket=name, Key="zoo/a7/adapter_model.safetensors", Body=b"\x00garbage" * 64)
    r = _complete(http, "a7")
    assert r.status_code == 400, f"a corrupt adapter is a 400, not a 5xx: {r.status_code} {r.text}"
    assert r.json()["error"]["code"] == "invalid_adapter", f"named as an invalid adapter: {r.text}"
    assert _complete(http, "a3").status_code == 200, "other adapters keep serving"
    client.put_object(Bucket=name, Key="zoo/a7/adapter_model.safetensors", Body=good)
    r = _complete(http, "a7")
    assert r.status_code == 200, f"the repaired adapter loads (a failed load is not cached): {r.text}"
    print("\nFAULTS corrupt push: 1 injected, answered 400, 0 lost")


def test_s3_stopped_mid_load_answers_503_and_serves_again_after_restart(http, bucket, proxy) -> None:
    warm = _complete(http, "a0")
    assert warm.status_code == 200, f"a0 loads while S3 is up: {warm.text}"
    proxy.die_after = 64 << 10  # S3 dies in the middle of the next large download
    answers = [_complete(http, aid) for aid in (BIG, "a5", "a6", "a8", "a9", "a10")]
    for r in answers:
        assert r.status_code == 503 and "retry-after" in r.headers, \
            f"a cold load while S3 is down: 503 with Retry-After, got {r.status_code} {r.text}"
    codes = [r.json()["error"]["code"] for r in answers]
    assert "source_unavailable" in codes, f"repeated failures open a source breaker: {codes}"
    opened = next(r.json()["error"]["message"] for r in answers
                  if r.json()["error"]["code"] == "source_unavailable")
    assert f"s3://{bucket[0]} " in opened and "127.0.0.1" not in opened, f"names the bucket only: {opened}"
    for _ in range(3):
        r = _complete(http, "a0")
        assert r.status_code == 200, f"a resident adapter keeps serving while S3 is down: {r.text}"
    proxy.restart()
    answers_after: list[httpx.Response] = []

    def served() -> bool:
        answers_after.append(r := _complete(http, BIG))
        if r.status_code == 200:
            return True
        assert _is_answer(r), f"only 503 with Retry-After while the breakers probe: {r.status_code}"
        time.sleep(float(r.headers.get("retry-after", "1")))
        return False

    poll(served, BOUND_S, interval_s=0)
    r = answers_after[-1]
    assert r.status_code == 200, f"S3 restarted: the adapter cut mid-load serves: {r.text}"
    print(f"\nFAULTS S3: stopped mid-load 1x, {len(answers)} cold loads answered 503 ({codes}), "
          "restarted, 0 lost")


def _replica_actor(replica_id: str):
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{replica_id}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no live actor for replica {replica_id}")


def _replica_ids() -> set[str]:
    """Ids of the live LoRA replica actors."""
    import ray

    names = [a["name"].split("#") for a in ray.util.list_named_actors(all_namespaces=True)]
    return {parts[-1] for parts in names if len(parts) == 3 and "Replica" in parts[1]}


def _retries(http: httpx.Client) -> float:
    """lora_cluster_generation_retries_total of the ingress."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("lora_cluster_generation_retries_total "):
            return float(line.split()[1])
    raise AssertionError("/metrics has no lora_cluster_generation_retries_total")


def _replica_states() -> dict[str, int]:
    """Serve's count of the LoRA replicas by state ("RUNNING", "STARTING", ...)."""
    from ray import serve

    app = serve.status().applications["lora"]
    states: dict[str, int] = {}
    for name, deployment in app.deployments.items():
        if "Replica" in name:
            for state, n in deployment.replica_states.items():
                states[str(state)] = states.get(str(state), 0) + n
    return states


def test_replica_killed_mid_stream(http, server) -> None:
    import ray

    body = {"model": "a1", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events: list[dict] = []
    with httpx.Client(base_url=server, timeout=BOUND_S) as streamer, \
            streamer.stream("POST", "/v1/completions", json=body) as stream, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert stream.status_code == 200, "the stream starts"
        victim = stream.headers["x-lora-replica"]
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        events.append(json.loads(first.removeprefix("data: ")))
        retries_before = _retries(http)
        held = [pool.submit(_complete, http, "a1", 480, ignore_eos=True) for _ in range(2)]
        time.sleep(0.3)  # both are on the victim (a1 is resident there), generating
        ray.kill(_replica_actor(victim), no_restart=True)
        tail = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        results = [f.result(timeout=BOUND_S) for f in held]
    payloads = [json.loads(t) for t in tail if t != "[DONE]"]
    assert any("error" in p for p in payloads), f"the broken stream ends with an error event: {tail[-3:]}"
    error = next(p["error"] for p in payloads if "error" in p)
    assert error["code"] in ("no_replica", "aborted", "engine_unavailable"), f"a 503-kind error: {error}"
    assert tail and tail[-1] == "[DONE]", "the stream is still terminated properly"
    lost = [r for r in results if r.status_code != 200]
    assert not lost, f"non-streaming requests on the killed replica are retried: {[r.text for r in lost]}"
    assert all(r.headers["x-lora-replica"] != victim for r in results), "the other replica served them"
    assert _retries(http) > retries_before, "the ingress counted the retries"
    seen: dict[str, object] = {}

    def replaced() -> bool:  # both facts from one call: checked one after the other they raced (CI, once)
        seen.update(others=len(_replica_ids() - {victim}), states=_replica_states())
        return seen["others"] == 2 and seen["states"] == {"RUNNING": 2}

    assert poll(replaced, 180, interval_s=0.5), \
        f"Serve starts a new replica in place of the killed one, and it is running: {seen}"
    served_by: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # more than one replica's batch slots at once

        def both_serve() -> bool:
            batch = list(pool.map(lambda i: _complete(http, f"a{i % 16}", 32, ignore_eos=True), range(8)))
            assert all(_is_answer(r) for r in batch), \
                f"after the restart: 200, 429/503 + Retry-After: {[(r.status_code, r.text) for r in batch]}"
            served_by.update(r.headers["x-lora-replica"] for r in batch if r.status_code == 200)
            return len(served_by - {victim}) >= 2

        poll(both_serve, 2 * BOUND_S, interval_s=0)
    assert len(served_by - {victim}) == 2, f"the new replica serves too: {served_by}"
    print(f"\nFAULTS replica kill: 1 killed mid-stream, 1 stream ended with an error event, "
          f"{len(results)} in-flight non-streaming retried, 0 lost")


def _ray_rss_mib() -> float:
    """RSS of this test's Ray processes: every descendant of this process (GCS, raylet, the workers
    of the replicas, ingress, proxy and Serve controller)."""
    import psutil

    total = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / (1 << 20)


async def _open_loop(base_url: str, qps: float, n: int) -> list[int | str]:
    """`n` requests sent at `qps` whatever the answers; each result: its status (429/503 only with
    Retry-After), or the name of its exception."""
    async with httpx.AsyncClient(base_url=base_url, timeout=BOUND_S,
                                 limits=httpx.Limits(max_connections=512)) as client:
        async def one(i: int) -> int | str:
            await asyncio.sleep(i / qps)
            body = {"model": f"a{i % 4}", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                return type(exc).__name__
            if r.status_code in (429, 503) and "retry-after" not in r.headers:
                return f"{r.status_code} without Retry-After"
            return r.status_code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_three_times_rated_qps_is_answered_without_hangs_or_5xx(http, server) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # rated: 8 clients, one per batch slot
        # the first pass warms the adapters and the paths up; a rate taken with it counted once in CI
        # so low that 3x of it was all served. The faster of two timed passes is the rated load.
        warm = list(pool.map(lambda i: _complete(http, f"a{i % 4}"), range(8)))
        rated, rated_qps = [], 0.0
        for _ in range(2):
            start = time.monotonic()
            rated += list(pool.map(lambda i: _complete(http, f"a{i % 4}"), range(32)))
            rated_qps = max(rated_qps, 32 / (time.monotonic() - start))
    assert all(r.status_code == 200 for r in warm + rated), "at the rated load every request is served"
    qps = 3 * rated_qps
    n = min(300, int(qps * 6))
    rounds, rss = [], [_ray_rss_mib()]
    for _ in range(2):
        rounds.append(asyncio.run(_open_loop(server, qps, n)))
        rss.append(_ray_rss_mib())
    for results in rounds:
        bad = [s for s in results if s not in (200, 429, 503)]
        assert not bad, f"every request is answered 200, 429 or 503 with Retry-After, none hangs: {bad[:5]}"
    refused = [s for s in rounds[0] + rounds[1] if s in (429, 503)]
    assert refused, "3x the rated load is refused in part"
    assert rss[2] - rss[1] < 100, f"RSS of the Ray processes stays flat over the second round: {rss} MiB"
    counts = [{s: r.count(s) for s in (200, 429, 503)} for r in rounds]
    print(f"\nOVERLOAD rated {rated_qps:.1f} req/s, sent {n} at {qps:.1f} req/s twice: {counts}; "
          f"RSS MiB before/after rounds: {[round(x) for x in rss]}")

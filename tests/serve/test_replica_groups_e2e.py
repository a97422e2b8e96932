"""Replica groups on Ray: one app with two groups of one replica each on this machine: `fin` serves
adapters a0..a3, `ops` is the catch-all. A burst on `fin` (more requests than its batch slots, so
its cluster queue fills) must not make `ops` requests wait behind its queue (their p50 stays far
below `fin`'s; on 2 shared cores `ops` still slows with the CPU the burst takes, which a test does
not time closely: docs/bench_sla.md measures latencies), and every response's
`x-lora-replica` must name a replica of the request's group (replica ids are mapped to groups with
`/debug/replicas`, where each replica reports its group)."""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import httpx
import pytest

FIN = ["a0", "a1", "a2", "a3"]
OPS = ["a8", "a9"]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def grouped_app(ray_app, demo_zoo):
    config = {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "num_cpus": 1,
        "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 4, "max_num_batched_tokens": 256,
        "max_ongoing_requests": 8, "routing_stats_period_s": 0.5, "controller_report_period_s": 0.25,
        "replica_groups": [{"name": "fin", "adapters": ["a[0-3]"]}, {"name": "ops"}],
    }
    with ray_app(config, name="groups") as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _complete(http: httpx.Client, adapter: str, max_tokens: int) -> tuple[float, str, int, float]:
    """(latency s, replica that served, status, end time) of one greedy completion."""
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"model": adapter, "prompt": PROMPT, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    end = time.monotonic()
    return end - t0, r.headers.get("x-lora-replica", ""), r.status_code, end


def _ops_latencies(http: httpx.Client, rounds: int) -> list[tuple[float, str, int, float]]:
    return [_complete(http, OPS[i % len(OPS)], 8) for i in range(rounds)]


@pytest.mark.e2e
def test_a_burst_on_one_group_stays_in_it_and_leaves_the_other_groups_latency(grouped_app):
    http = grouped_app
    for adapter in FIN + OPS:  # warm-up: every adapter on its group's device, both routers created
        assert _complete(http, adapter, 2)[2] == 200, f"{adapter}: the warm-up request succeeds"
    time.sleep(1.5)  # the replicas' reports reach the routers
    replicas = http.get("/debug/replicas").json()["replicas"]
    group_of = {rid: stats["group"] for rid, stats in replicas.items()}
    assert sorted(group_of.values()) == ["fin", "ops"], f"one replica per group reports: {group_of}"

    baseline = _ops_latencies(http, 12)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # 16 at once on 4 batch slots: queued
        burst = [pool.submit(_complete, http, FIN[i % len(FIN)], 48) for i in range(32)]
        time.sleep(0.5)  # the burst is running and queueing
        during = _ops_latencies(http, 12)
        burst_done = [f.result(timeout=300) for f in burst]

    fin_served = {r[1] for r in burst_done}
    ops_served = {r[1] for r in baseline + during}
    assert all(r[2] == 200 for r in burst_done), "every burst request succeeds"
    assert all(r[2] == 200 for r in baseline + during), "every ops request succeeds"
    assert {group_of.get(rid) for rid in fin_served} == {"fin"}, (
        f"every fin request ran on a fin replica: {fin_served} vs {group_of}")
    assert {group_of.get(rid) for rid in ops_served} == {"ops"}, (
        f"every ops request ran on an ops replica: {ops_served} vs {group_of}")
    views = http.get("/v1/cluster").json()["groups"]
    for name, view in views.items():
        in_view = {rid for node in view["nodes"].values() for rid in node["replicas"]}
        assert {group_of.get(rid) for rid in in_view} == {name}, (
            f"the {name} group's cluster controller knows only {name} replicas: {in_view} vs {group_of}")
    assert views["fin"]["ingress"]["admission"].get("parked", 0) > 0, (
        "the fin burst overflowed fin's batch slots into fin's own cluster queue")
    assert views["ops"]["ingress"]["admission"].get("parked", 0) == 0, (
        "no ops request waited in a cluster queue during the fin burst")
    assert max(r[3] for r in burst_done) > max(r[3] for r in during), (
        "the fin burst was still running when the last ops request of the comparison ended")
    # latency is a benchmark's figure (printed here, never asserted: the 2 cores are shared); the
    # isolation it reflects is asserted above: ops ran only on ops replicas, while the burst ran,
    # and never waited in a cluster queue
    base = [r[0] for r in baseline]
    p50_base, p50_during = statistics.median(base), statistics.median(r[0] for r in during)
    fin_p50 = statistics.median(r[0] for r in burst_done)
    print(f"\nops p50 idle {p50_base * 1e3:.1f} ms, during the fin burst {p50_during * 1e3:.1f} ms; "
          f"fin burst p50 {fin_p50 * 1e3:.1f} ms, longest {max(r[0] for r in burst_done):.2f} s")

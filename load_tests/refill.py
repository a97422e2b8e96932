"""Refill test (not a pytest test): does the engine's batch stay full once requests queue in the
cluster? Many closed-loop clients against a running server, while `/v1/cluster` is sampled.

    RAY_AUTH_MODE=disabled .venv/bin/serve run serve_config.yaml &      # or any running server
    .venv/bin/python -m load_tests.refill --url http://127.0.0.1:8000 --clients 128 --seconds 40

`--clients` closed-loop clients (each sends its next request when the last one is answered; more
clients than the replicas' batch slots, so requests park in the cluster queue) send `/v1/completions`
requests (`--max-tokens` tokens, adapters a0..a{N-1} by Zipf(1.1) plus the base model, one in four
streamed) for `--seconds`. Every `--sample-s` the script reads `/v1/cluster` and records, per
replica, the requests its engine runs and holds waiting, its reported capacity (admission capacity
plus admission window) and the cluster queue's depth. It prints one line of figures: answers per
second, answers by status, latency p50/p99, and the means of those samples. A freed slot that idles
until the controller's grant arrives shows as a mean batch well below the replicas' `max_num_seqs`
while the queue holds requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

import httpx

from load_tests.soak import one, percentile, zipf_models


async def sample(client: httpx.AsyncClient, stop: float, period_s: float) -> list[dict[str, Any]]:
    """`/v1/cluster` every `period_s` until `stop`: {running, waiting, capacity, max_num_seqs, queue}."""
    samples = []
    while time.monotonic() < stop:
        try:
            view = (await client.get("/v1/cluster")).json()
        except (httpx.HTTPError, ValueError):
            view = None
        if view and "nodes" in view:
            replicas = [r for node in view["nodes"].values() for r in node["replicas"].values()]
            samples.append({"running": sum(r["running"] for r in replicas),
                            "waiting": sum(r["waiting"] for r in replicas),
                            "capacity": sum(r["capacity"] for r in replicas),
                            "max_num_seqs": sum(r["max_num_seqs"] or 0 for r in replicas),
                            "queue": view["queue"]["depth"]})
        await asyncio.sleep(period_s)
    return samples


async def run(args: argparse.Namespace) -> dict[str, Any]:
    models = zipf_models(args.adapters, args.base_model, random.Random(args.seed))
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, limits=limits) as client:
        statuses: Counter[str] = Counter()
        latencies: list[float] = []
        stop = time.monotonic() + args.seconds

        async def worker(k: int) -> None:
            i = k
            while time.monotonic() < stop:
                status, seconds = await one(client, models[i % len(models)], i % 4 == 0, args.max_tokens)
                statuses[status] += 1
                if status == "200":
                    latencies.append(seconds)
                i += args.clients
        start = time.monotonic()
        sampler = asyncio.create_task(sample(client, stop, args.sample_s))
        await asyncio.gather(*(worker(k) for k in range(args.clients)))
        elapsed = time.monotonic() - start
        samples = await sampler
    queued = [s for s in samples if s["queue"] > 0]

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        return round(statistics.fmean(r[key] for r in rows), 1) if rows else None
    return {"answers_per_s": round(statuses["200"] / elapsed, 2), "statuses": dict(statuses),
            "p50_ms": round(1000 * percentile(latencies, 50)) if latencies else None,
            "p99_ms": round(1000 * percentile(latencies, 99)) if latencies else None,
            "samples": len(samples), "samples_with_queue": len(queued),
            "max_num_seqs": samples[0]["max_num_seqs"] if samples else None,
            "mean_running": mean("running", samples), "mean_running_while_queued": mean("running", queued),
            "mean_waiting": mean("waiting", samples), "mean_capacity": mean("capacity", samples),
            "mean_queue": mean("queue", samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--base-model", default="demo", help="the base model's name in the API")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="printed with the figures (e.g. the setting changed)")
    args = p.parse_args(argv)
    print(json.dumps({"label": args.label, "clients": args.clients, "seconds": args.seconds,
                      **asyncio.run(run(args))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A new replica's cold start with demand prefetch on and off, live (no Ray): its requests' adapter
loads, and what prefetch costs a live load's wait for a loader worker.

    python benchmarks/bench_demand_prefetch.py [--seeds 0,1] [--out docs/bench_demand_prefetch.md]

Setup: the tiny demo zoo's adapters on S3 (a moto server on 127.0.0.1) behind a proxy that caps each
response at `--rate` bytes/s (a slow source on purpose: a scale model of 128 MiB adapters at 100 MB/s,
1.3 s each, with the demo's ~0.1-0.3 MB adapters); one replica's `TieredAdapterStore` as the replica
builds it (shipped defaults), a real `FetchQueue` with the engine's loader workers for its requests'
loads (priority 0, as the engine queues them), and the cluster controller's own policy
(`cluster.controller.Controller`) holding the demand history of the rest of the cluster: one report
of `--history` requests drawn from the same Zipf popularity as the replica's traffic.

The replica joins at t = 0 (a scale-up, a replacement, a rollout); its requests arrive after a lead
time (`--leads`: 0, requests at once; 5 s, a replica started ahead of its traffic: a scale-up planned
ahead, or a rollout's new replica before the router shifts to it), open
loop (Poisson, `--rps`, `--seconds`). With prefetch on, its `DemandPrefetch` (shipped defaults:
`prefetch_bytes_per_s`, `prefetch_max_bytes`, `prefetch_hot_period_s`) polls the controller's hot
list and runs its loop, yielding to the live loads; off, nothing else runs. Per run: the requests that
loaded from S3, the requests' load time (submit to weights; a host hit is ~0), the share over 1 s,
a live load's wait for a worker (submit to start), and what prefetch fetched. Times are wall-clock
on the machine named below, shared with other work (its load average is printed): the count of
requests that loaded from S3 is the robust figure, the times vary between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common

WORKERS = 2  # the engine's adapter loader workers (`AdapterResidency`'s fetch queue)


class CappedProxy:
    """A TCP proxy whose every response is held to `rate` bytes/s (a slow link)."""

    def __init__(self, target: tuple[str, int], rate: float):
        self.target, self.rate = target, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, capped: bool) -> None:
        sent, start = 0, time.monotonic()
        try:
            while data := src.recv(16 << 10):
                dst.sendall(data)
                sent += len(data)
                if capped:
                    time.sleep(max(0.0, start + sent / self.rate - time.monotonic()))
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()


class ControllerHot:
    """The controller policy's hot list, in process (what `ControllerHotList` asks the actor)."""

    def __init__(self, core: Any):
        self.core = core

    async def hot(self, k: int) -> list[tuple[str, int]] | None:
        return self.core.hot_adapters(k)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def run(args: argparse.Namespace, ids: list[str], shapes: Any, seed: int, prefetch: bool,
        lead_s: float) -> dict[str, float]:
    import torch

    from lora_cluster.cluster.controller import Controller
    from lora_cluster.cluster.reports import ReplicaReport
    from lora_cluster.cluster.sla import SlaClasses
    from lora_cluster.config import EngineConfig
    from lora_cluster.engine.adapters.fetch_queue import FetchQueue
    from lora_cluster.serve.replica.demand_prefetch import DemandPrefetch
    from lora_cluster.store import TieredAdapterStore

    rng = random.Random(seed)
    weights = zipf_weights(len(ids), args.zipf)
    history = rng.choices(ids, weights, k=args.history)
    core = Controller(SlaClasses())
    demand = {a: history.count(a) for a in set(history)}
    core.report(ReplicaReport("others", "n0", capacity=8, max_num_seqs=8, max_loras=8, running=0, waiting=0,
                              free_adapter_slots=8, adapter_requests=demand))
    with tempfile.TemporaryDirectory() as cache:
        config = EngineConfig(model=args.model, adapter_source=["s3://bench/zoo"], disk_cache_dir=cache)
        store = TieredAdapterStore.from_config(config, shapes, torch.device("cpu"))
        queue = FetchQueue(WORKERS, max_prefetches=64)

        class Live:
            def live_fetches(self) -> int:
                return queue.live()

        p = DemandPrefetch(ControllerHot(core), store, Live(), bytes_per_s=float(config.prefetch_bytes_per_s),
                           max_bytes=min(int(config.prefetch_max_bytes), int(config.host_cache_bytes)),
                           period_s=config.prefetch_hot_period_s)
        stop = threading.Event()

        async def loop() -> None:
            p.start()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            p.stop()

        looper = threading.Thread(target=lambda: asyncio.run(loop()), daemon=True)
        if prefetch:
            looper.start()
        time.sleep(lead_s)  # the replica runs before its first request: prefetch alone meanwhile
        records: list[dict[str, float]] = []
        lock = threading.Lock()

        def load(adapter_id: str, submitted: float) -> None:
            started = time.monotonic()
            before = store.stats.snapshot()["source"]["loads"]
            store.load(adapter_id)
            store.load_abandoned(adapter_id)  # no device here: the host copy is an ordinary entry again
            with lock:
                records.append({"wait": started - submitted, "load": time.monotonic() - submitted,
                                "s3": float(store.stats.snapshot()["source"]["loads"] > before)})

        t0, at, futures = time.monotonic(), 0.0, []
        while True:
            at += rng.expovariate(args.rps)
            if at >= args.seconds:
                break
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            aid = rng.choices(ids, weights)[0]
            submitted = time.monotonic()
            futures.append(queue.submit(lambda a, s=submitted: load(a, s), aid, 0))
        for f in futures:
            f.result(timeout=120)
        stop.set()
        if prefetch:
            looper.join(timeout=10)
        queue.close()
        store.close()
    loads = sorted(r["load"] for r in records)
    waits = [r["wait"] for r in records]
    return {"requests": len(records), "s3": sum(r["s3"] for r in records),
            "load_mean_ms": 1e3 * statistics.fmean(loads), "load_p50_ms": 1e3 * common.percentile(loads, 0.5),
            "load_p99_ms": 1e3 * common.percentile(loads, 0.99),
            "over_1s": 100 * sum(x > 1.0 for x in loads) / len(loads),
            "wait_mean_ms": 1e3 * statistics.fmean(waits),
            "wait_p99_ms": 1e3 * common.percentile(waits, 0.99),
            "prefetched": p.counts["prefetched"], "prefetched_mb": p.counts["prefetched_bytes"] / 1e6,
            "paused": p.counts["paused"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--adapters", type=int, default=48)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--rps", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--leads", default="0,5", help="seconds the replica runs before its first request")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=256e3, help="bytes/s of each S3 response")
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-prefetch-zoo")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import boto3
    import torch
    from moto.server import ThreadedMotoServer

    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.engine.model.model_loader import load_base_model

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    zoo = build_demo_zoo(args.zoo, num_adapters=args.adapters, size="tiny", seed=0)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="bench")
    ids = sorted(p.name for p in zoo.adapters_dir.iterdir() if p.is_dir())
    for aid in ids:
        for f in (zoo.adapters_dir / aid).iterdir():
            if f.is_file():
                client.put_object(Bucket="bench", Key=f"zoo/{aid}/{f.name}", Body=f.read_bytes())
    sizes = [sum(f.stat().st_size for f in (zoo.adapters_dir / a).iterdir()) for a in ids]
    proxy = CappedProxy((host, port), args.rate)
    os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint
    args.model = str(zoo.model_dir)
    shapes = load_base_model(args.model, dtype=torch.float32, device=torch.device("cpu")).dims.shapes()
    rng = random.Random(0)
    rng.shuffle(ids)  # popularity rank is not the ids' order
    lines = common.header("A new replica's cold start, demand prefetch on and off (live store, no Ray)",
                          "python benchmarks/bench_demand_prefetch.py " + " ".join(argv or sys.argv[1:]),
                          level=2, changed={}, machine_note=f" (load average {common.load_avg()})")
    lines += [f"- workload: {len(ids)} adapters ({min(sizes) / 1e3:.0f}-{max(sizes) / 1e3:.0f} kB) on S3 "
              f"capped at {args.rate / 1e3:.0f} kB/s per response; Zipf {args.zipf:g}; {args.rps:g} req/s "
              f"for {args.seconds:g} s after the replica's start and a lead time; controller history "
              f"{args.history} requests; {WORKERS} loader workers",
              "", "| seed | prefetch | lead s | requests | from S3 | load mean ms | p50 ms | p99 ms "
              "| over 1 s | wait for a worker, mean ms | p99 ms | prefetched (MB) | paused ticks |",
              "|" + "---|" * 13]
    leads = [float(x) for x in args.leads.split(",")]
    for seed in (int(s) for s in args.seeds.split(",")):
        for prefetch, lead in [(False, 0.0)] + [(True, lead) for lead in leads]:
            m = run(args, ids, shapes, seed, prefetch, lead)
            pf = f"{m['prefetched']} ({m['prefetched_mb']:.1f})" if prefetch else "-"
            lines.append(f"| {seed} | {'on' if prefetch else 'off'} | {lead:g} | {m['requests']} "
                         f"| {m['s3']:.0f} | {m['load_mean_ms']:.0f} | {m['load_p50_ms']:.0f} "
                         f"| {m['load_p99_ms']:.0f} | {m['over_1s']:.1f}% | {m['wait_mean_ms']:.1f} "
                         f"| {m['wait_p99_ms']:.0f} | {pf} "
                         f"| {m['paused'] if prefetch else '-'} |")
            print(lines[-1], file=sys.stderr, flush=True)
    server.stop()
    common.emit("\n".join(lines), args.out, title="bench_demand_prefetch", doc=__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the time of one short completion goes on Serve's HTTP path: a timeline per request.

Starts the same app as `bench_router.py` (tiny demo model, one LoRA replica), sends --requests
non-streaming completions one at a time, each with its own `x-request-id`, and records
`time.perf_counter()` (CLOCK_MONOTONIC, one clock for every process of the machine) at fixed points in
the client, the ingress and the replica. The points are wrappers installed in every Ray worker by a
`worker_process_setup_hook` (nothing in the package changes); each process appends its points to a
file of its own, and the script prints the p50 and mean of every step between consecutive points.

  client send -> ingress middleware    proxy (uvicorn, Serve's proxy actor) and the Ray call into the ingress
  body read                            the ingress fetching the request body back from the proxy (Serve)
  middleware -> route                  FastAPI: body parse, validation, dependencies (auth)
  route -> dispatch                    checks, tokenization, job building
  dispatch -> engine                   router, the Ray call into the replica, the replica's preamble
  engine                               AsyncEngine.generate: first output, last output
  engine -> ingress                    the reply's way back to the ingress
  ingress after the reply              JSON body, headers, middlewares
  response -> client                   Serve's way back through the proxy to the client

`--serve-mode throughput` runs the app in Ray Serve's throughput-optimized mode (HAProxy, direct
ingress, gRPC between deployments: lora_cluster/serve/ops/serve_mode.py). There the first step is httpx,
HAProxy and the ingress replica's own HTTP server, the body is read in the ingress itself, and the
call into the replica and the reply travel over gRPC.

Run: RAY_AUTH_MODE=disabled python benchmarks/profile_http.py [--requests 150] [--max-tokens 8]
     [--serve-mode default|throughput]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_router import REASONS, SETTINGS
from common import changed_settings, load_avg, serve_mode, start_serve

PROMPT = "the river runs past a quiet town where people trade bread"
ADAPTER = "a3"
POINTS = ["c_send", "mw_in", "rcv_in", "rcv_out", "route_in", "enc_in", "enc_out", "start_in", "ae_in",
          "ae_first", "ae_fin", "start_out", "resp_start", "mw_out", "c_recv"]


def install(folder: str) -> None:
    """Wrap the timeline's points in this process (the workers' setup hook); points go to `folder`."""
    from lora_cluster.engine import async_engine
    from lora_cluster.serve.http import body_limits, context, ingress, openai_schemas
    from lora_cluster.serve.ops import logs
    from lora_cluster.serve.routing import dispatch

    out = open(os.path.join(folder, f"{os.getpid()}.tsv"), "a", buffering=1)  # noqa: SIM115

    def rec(rid: str | None, label: str) -> None:
        out.write(f"{rid}\t{label}\t{time.perf_counter():.6f}\n")

    metrics_call = ingress.MetricsMiddleware.__call__

    async def metrics_mw(self: Any, scope: dict, receive: Any, send: Any) -> None:
        rid = logs.request_id()
        rec(rid, "mw_in")

        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                rec(rid, "resp_start")
            await send(message)

        try:
            await metrics_call(self, scope, receive, watched)
        finally:
            rec(rid, "mw_out")

    limits_call = body_limits.BodyLimitsMiddleware.__call__

    async def limits_mw(self: Any, scope: dict, receive: Any, send: Any) -> None:
        rid = logs.request_id()

        async def timed_receive() -> dict:
            rec(rid, "rcv_in")
            message = await receive()
            rec(rid, "rcv_out")
            return message

        await limits_call(self, scope, timed_receive, send)

    def around(cls: Any, name: str, label: str) -> None:
        original = getattr(cls, name)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec(logs.request_id(), f"{label}_in")
            try:
                return await original(*args, **kwargs)
            finally:
                rec(logs.request_id(), f"{label}_out")

        setattr(cls, name, wrapper)

    check = openai_schemas.CompletionRequest.check

    def timed_check(self: Any, limits: Any) -> None:
        rec(logs.request_id(), "route_in")
        check(self, limits)

    generate = async_engine.AsyncEngine.generate

    def timed_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        rid = logs.request_id()

        async def outputs() -> Any:
            rec(rid, "ae_in")
            first = True
            async for output in generate(self, *args, **kwargs):
                if first:
                    rec(rid, "ae_first")
                    first = False
                if output.finished:
                    rec(rid, "ae_fin")
                yield output

        return outputs()

    ingress.MetricsMiddleware.__call__ = metrics_mw
    body_limits.BodyLimitsMiddleware.__call__ = limits_mw
    around(context.ApiContext, "encode", "enc")
    around(dispatch.Dispatcher, "start", "start")
    openai_schemas.CompletionRequest.check = timed_check
    async_engine.AsyncEngine.generate = timed_generate


def steps(folder: Path, skip: int) -> dict[tuple[str, str], list[float]]:
    """Milliseconds between consecutive points of each request (after the first `skip` requests)."""
    points: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            rid, label, t = line.split("\t")
            if rid.startswith("rq") and int(rid[2:]) >= skip:
                points[rid].setdefault(label, float(t))
    out: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for seen in points.values():
        present = [p for p in POINTS if p in seen]
        for a, b in itertools.pairwise(present):
            out[(a, b)].append(1000 * (seen[b] - seen[a]))
        out[("c_send", "c_recv")].append(1000 * (seen["c_recv"] - seen["c_send"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-bench-zoo")
    ap.add_argument("--serve-mode", choices=("default", "throughput"), default="default")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    mode = contextlib.ExitStack()
    mode.enter_context(serve_mode(args.serve_mode))  # before Ray starts: its controller and replicas read it

    import httpx
    import ray
    from ray import serve

    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.serve.app import build_app

    folder = Path(tempfile.mkdtemp(prefix="profile-http-"))
    zoo = build_demo_zoo(args.zoo, num_adapters=16, size="tiny", seed=0)
    cfg = {"model": str(zoo.model_dir), "adapter_source": [str(zoo.adapters_dir)], **SETTINGS,
           "num_replicas": 1}
    hook = lambda: install(str(folder))  # noqa: E731  (pickled by value into every worker)
    root = start_serve(4, runtime_env={"worker_process_setup_hook": hook})
    serve.run(build_app(cfg), name="profile", route_prefix="/")
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}
    skip = 10
    with open(folder / "client.tsv", "a", buffering=1) as out, \
            httpx.Client(base_url=root, timeout=60) as client:
        for i in range(args.requests + skip):
            rid = f"rq{i}"
            out.write(f"{rid}\tc_send\t{time.perf_counter():.6f}\n")
            r = client.post("/v1/completions", json=body, headers={"x-request-id": rid})
            out.write(f"{rid}\tc_recv\t{time.perf_counter():.6f}\n")
            if r.status_code != 200:
                raise SystemExit(f"request {rid} failed: {r.status_code} {r.text}")
    serve.shutdown()
    ray.shutdown()
    mode.close()

    print(f"load average {load_avg()}; {args.requests} requests; serve mode {args.serve_mode}; settings "
          "changed from the shipped defaults: " + "; ".join(
              f"{k} ({why})" for k, why in changed_settings(SETTINGS, REASONS).items()))
    print("| step | p50 ms | mean ms |\n|---|---:|---:|")
    for (a, b), ms in steps(folder, skip).items():
        print(f"| {a} -> {b} | {statistics.median(ms):.2f} | {statistics.fmean(ms):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Router overhead: end-to-end latency of a short completion through Ray Serve vs the engine directly.

One request at a time (no batching effects), the same prompt, adapter and greedy parameters
everywhere, the adapter already resident. Each of --requests rounds (after 10 warm-up rounds) runs
every path once, interleaved, so that load changes on a shared machine hit all paths alike:

  engine          Engine.generate([prompt]) in this process: the model's own time
  async-engine    AsyncEngine.generate in this process: plus the loop thread and asyncio hand-off
  handle          LoraReplica through a deployment handle with LoraAffinityRouter (driver -> replica),
                  no HTTP; the unary `complete` call the ingress sends a non-streaming job as
  handle-stream   the same through the `generate` Ray streaming generator, one item per token
  http            POST /v1/completions on the Serve HTTP proxy: proxy -> ingress (FastAPI, parsing,
                  tokenization) -> router -> replica -> back
  http-stream     the same with stream=true, time to the first SSE token and to [DONE]

The router's overhead is `http - engine` (and `handle - async-engine` for the Ray hop alone).

--serve-mode picks how Ray Serve runs the app: `default` (Serve's proxy actor on the port), or
`throughput` (Ray Serve's throughput-optimized mode with HAProxy, `private_throughput_mode` in
lora_cluster/serve/ops/serve_mode.py, with HAProxy's files and side ports private to the run).
--compare-modes N runs the whole benchmark 2N times in child processes, default and throughput in
turn, each on a fresh Ray, and reports every run and the best run of each mode.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_router.py [--requests 200] [--max-tokens 8]
     [--serve-mode default|throughput] [--compare-modes N] [--out docs/bench_router.md [--append]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import changed_settings, header, load_avg, serve_mode, start_serve, summary

PROMPT = "the river runs past a quiet town where people trade bread"
ADAPTER = "a3"


# what the app changes from the shipped defaults, and why (printed in the report)
SETTINGS = {"max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 8}
REASONS = {
    "max_loras": "one adapter is used; fewer slots make a smaller app on the 2-core machine",
    "max_lora_rank": "the demo adapters' largest rank",
    "max_num_seqs": "one request at a time never fills more than one sequence slot",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-bench-zoo")
    ap.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    ap.add_argument("--append", action="store_true", help="append the report to --out")
    ap.add_argument("--serve-mode", choices=("default", "throughput"), default="default")
    ap.add_argument("--compare-modes", type=int, default=0, metavar="N",
                    help="run default and throughput in turn, N times each, and compare")
    ap.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # a child's samples
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.compare_modes:
        return _compare(args)
    mode = contextlib.ExitStack()
    mode.enter_context(serve_mode(args.serve_mode))  # before Ray starts: its controller and replicas read it

    import httpx
    import ray
    from ray import serve

    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.engine import AsyncEngine, SamplingParams, build_engine
    from lora_cluster.serve.app import build_app
    from lora_cluster.serve.protocol import GenerateJob

    zoo = build_demo_zoo(args.zoo, num_adapters=16, size="tiny", seed=0)
    cfg = {"model": str(zoo.model_dir), "adapter_source": [str(zoo.adapters_dir)], **SETTINGS}
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    root = start_serve(4)
    serve.run(build_app({**cfg, "num_replicas": 1}), name="bench", route_prefix="/")
    handles: dict[str, Any] = {}  # made in the event loop: in throughput mode they route on the caller's
    engine = build_engine(**cfg)  # two engines: Engine is single-threaded and AsyncEngine owns its own
    aengine = AsyncEngine(build_engine(**cfg))
    ids = engine.tokenize(PROMPT)
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}
    client = httpx.Client(base_url=root, timeout=60)
    ttft: list[float] = []

    def via_engine() -> None:
        engine.generate([PROMPT], [ADAPTER], sampling)

    async def via_async_engine() -> None:
        async for _ in aengine.generate(PROMPT, ADAPTER, sampling):
            pass

    async def via_handle(stream: bool = False) -> None:
        job = GenerateJob(request_id=os.urandom(8).hex(), prompt=ids, adapter_id=ADAPTER, sampling=sampling,
                          stream=stream)
        if not handles:
            handles["unary"] = serve.get_deployment_handle("LoraReplica", app_name="bench")
            handles["stream"] = handles["unary"].options(stream=True)
        if not stream:
            await handles["unary"].complete.remote(job)
            return
        async for _ in handles["stream"].generate.remote(job):
            pass

    def via_http() -> None:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-lora-adapter-hit"] == "true", r.text

    def via_http_stream() -> None:
        t0 = time.perf_counter()
        first = None
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: "):
                    first = time.perf_counter() - t0
        ttft.append(first)

    paths = {"engine": via_engine, "async-engine": via_async_engine, "handle": via_handle,
             "handle-stream": lambda: via_handle(True), "http": via_http, "http-stream": via_http_stream}
    results: dict[str, list[float]] = {name: [] for name in paths}

    async def rounds() -> None:
        # interleaved: every round runs each path once, so load changes on the machine hit all alike
        for i in range(args.requests + 10):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                out = fn()
                if asyncio.iscoroutine(out):
                    await out
                if i >= 10:
                    results[name].append(time.perf_counter() - t0)
            if i == 9:
                ttft.clear()  # warm-up done
        await serve.shutdown_async()  # on the loop the handles' routers run on

    asyncio.run(rounds())
    client.close()
    ray.shutdown()
    mode.close()
    aengine.shutdown()
    engine.close()

    if args.json:
        args.json.write_text(json.dumps({"results": results, "ttft": ttft, "load": os.getloadavg()}))
        return 0
    report = _report(args, results, ttft)
    print(report)
    _write(args, report)
    return 0


def _write(args: argparse.Namespace, report: str) -> None:
    if args.out:
        with args.out.open("a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + report)


def _compare(args: argparse.Namespace) -> int:
    """Run the benchmark in child processes, default and throughput in turn, `args.compare_modes` times
    each; report every run's p50s and the full table of each mode's best run (lowest http - engine)."""
    runs: list[tuple[str, dict]] = []
    folder = Path(tempfile.mkdtemp(prefix="bench-router-modes-"))
    for i in range(args.compare_modes):
        for mode in ("default", "throughput"):
            out = folder / f"{i}-{mode}.json"
            cmd = [sys.executable, __file__, "--requests", str(args.requests), "--max-tokens",
                   str(args.max_tokens), "--zoo", str(args.zoo), "--serve-mode", mode, "--json", str(out)]
            subprocess.run(cmd, check=True)
            runs.append((mode, json.loads(out.read_text())))
            print(f"run {len(runs)} ({mode}) done", file=sys.stderr)
    report = _compare_report(args, runs)
    print(report)
    _write(args, report)
    return 0


def _compare_report(args: argparse.Namespace, runs: list[tuple[str, dict]]) -> str:
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    p50 = lambda run, path: summary(run["results"][path])["p50"]  # noqa: E731
    over = lambda run: p50(run, "http") - p50(run, "engine")  # noqa: E731
    command = (f"RAY_AUTH_MODE=disabled python benchmarks/bench_router.py --requests {args.requests} "
               f"--max-tokens {args.max_tokens} --compare-modes {args.compare_modes}")
    lines = [
        *header("Serve modes: default vs throughput-optimized (alternating runs)", command, level=2,
                machine_note=f"; load average during the run {load_avg()}",
                changed=changed_settings(SETTINGS, REASONS)),
        "- each run: the benchmark above on a fresh Ray in a child process, modes in turn "
        "(default, throughput, default, ...); `throughput` = `THROUGHPUT_MODE_ENV` "
        "(`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, `RAY_SERVE_ENABLE_HA_PROXY=1`, serve/ops/serve_mode.py)",
        "",
        "| run | mode | load (1 min) | engine p50 | async-engine p50 | handle p50 | http p50 "
        "| http-stream p50 | http - engine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (mode, run) in enumerate(runs, 1):
        lines.append(f"| {i} | {mode} | {run['load'][0]:.1f} | {ms(p50(run, 'engine'))} | "
                     f"{ms(p50(run, 'async-engine'))} | {ms(p50(run, 'handle'))} | {ms(p50(run, 'http'))} | "
                     f"{ms(p50(run, 'http-stream'))} | +{ms(over(run))} |")
    for mode in ("default", "throughput"):
        best = min((run for m, run in runs if m == mode), key=over)
        lines += ["", f"Best `{mode}` run (lowest `http` - `engine`):", "",
                  "| path | mean ms | p50 ms | p90 ms | p99 ms | p50 over engine ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        engine_p50 = p50(best, "engine")
        for name, samples in best["results"].items():
            p = summary(samples)
            lines.append(f"| {name} | {ms(p['mean'])} | {ms(p['p50'])} | {ms(p['p90'])} | {ms(p['p99'])} | "
                         f"{ms(p['p50'] - engine_p50)} |")
        if best["ttft"]:
            p = summary(best["ttft"])
            lines.append(f"| http-stream, first token | {ms(p['mean'])} | {ms(p['p50'])} | {ms(p['p90'])} | "
                         f"{ms(p['p99'])} | |")
    return "\n".join(lines) + "\n"


def _report(args: argparse.Namespace, results: dict[str, list[float]], ttft: list[float]) -> str:
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    engine_p50 = summary(results["engine"])["p50"]
    command = (f"RAY_AUTH_MODE=disabled python benchmarks/bench_router.py --requests {args.requests} "
               f"--max-tokens {args.max_tokens} --serve-mode {args.serve_mode}"
               f"{' --out ' + str(args.out) if args.out else ''}")
    lines = [
        *header("Router overhead: a short completion through Ray Serve vs the engine directly", command,
                machine_note=f"; load average during the run {load_avg()}",
                changed=changed_settings(SETTINGS, REASONS)),
        f"- workload: the tiny demo model, adapter {ADAPTER} (resident), a {len(PROMPT.split())}-word "
        "prompt, "
        f"{args.max_tokens} greedy tokens (EOS ignored), one request at a time, {args.requests} requests per "
        "path, interleaved round by round after 10 warm-up rounds; 1 LoRA replica.",
        "",
        "| path | mean ms | p50 ms | p90 ms | p99 ms | p50 over engine ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, samples in results.items():
        p = summary(samples)
        lines.append(f"| {name} | {ms(p['mean'])} | {ms(p['p50'])} | {ms(p['p90'])} | {ms(p['p99'])} | "
                     f"{ms(p['p50'] - engine_p50)} |")
    if ttft:
        p = summary(ttft)
        lines.append(f"| http-stream, first token | {ms(p['mean'])} | {ms(p['p50'])} | {ms(p['p90'])} | "
                     f"{ms(p['p99'])} | |")
    lines += [
        "",
        "Paths: `engine` = `Engine.generate` in-process; `async-engine` = `AsyncEngine` in-process (loop "
        "thread); `handle` = a Serve deployment handle to the replica through `LoraAffinityRouter` (no "
        "HTTP; the unary `complete` call, as the ingress sends a non-streaming job), `handle-stream` = the "
        "same through the `generate` streaming generator, one item per token; `http` = "
        "`POST /v1/completions` via the Serve proxy and the FastAPI ingress; "
        "`http-stream` = the same with `stream: true`.",
        "",
    ]
    p50 = {name: summary(samples)["p50"] for name, samples in results.items()}
    lines += [
        f"Reading (p50): a short completion through Serve's HTTP path takes {ms(p50['http'])} ms against "
        f"{ms(p50['engine'])} ms for the engine alone, i.e. {ms(p50['http'] - p50['engine'])} ms of serving "
        f"overhead: {ms(p50['handle'] - p50['async-engine'])} ms for the Ray hop to the replica through "
        f"the request router (`handle` - `async-engine`) and {ms(p50['http'] - p50['handle'])} ms for the "
        "HTTP proxy, the FastAPI ingress (validation, tokenization) and the second hop (`http` - "
        f"`handle`). Streaming every token costs {ms(p50['http-stream'] - p50['http'])} ms more for "
        f"{args.max_tokens} tokens (one message per token on two Ray hops while the path keeps up). "
        "The overhead is per request, not per token of a non-streaming request, so it shrinks relative "
        "to a real model's generation time; on this 2-core machine it competes with the engine for CPU.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

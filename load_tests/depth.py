"""Where a backlog's capacity goes (not a pytest test): closed-loop throughput against a running server
at several depths (clients in flight), with the CPU milliseconds each role spent per completed request.

    RAY_AUTH_MODE=disabled .venv/bin/serve run serve_config.yaml &      # or any running server
    .venv/bin/python load_tests/depth.py --url http://127.0.0.1:8000 --ray-root-pid $!

For each `--depths` entry, that many closed-loop clients (each sends its next request when the
last one is answered; the soak's requests, none streamed: `/v1/completions`, `--max-tokens` tokens,
adapters a0..a{N-1} by Zipf(1.1) plus the base model) run for `--seconds`. A row gives the 200s per
second, the p50 latency, and the CPU milliseconds per completed request of the LoRA replicas, the
ingress replicas, the cluster controller, Serve's HTTP proxy, the other Ray processes and this
client, read from /proc before and after the step (`--ray-root-pid` restricts the processes to one
server's tree). On a machine whose cores the client shares with the server, the last column is
capacity the server does not get: a deeper backlog costs the client CPU, whichever way the server
queues it. `--client aiohttp` sends the same requests with aiohttp instead of httpx (as
`load_tests/soak.py --client`), to see how much of that cost is the client library's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections import Counter

import psutil
from soak import closed_loop, http_client, percentile, ray_processes, zipf_models

ROLES = ("replicas", "ingress", "controller", "proxy", "ray", "client")


def cpu_seconds(root_pid: int | None) -> Counter[str]:
    """role -> CPU seconds (user + system) so far of the server's processes and of this client. Serve's
    controller actor and proxy are split out of the other Ray processes by their process titles."""
    out: Counter[str] = Counter()
    for role, procs in ray_processes(root_pid).items():
        for proc in procs:
            try:
                title = " ".join(proc.cmdline())
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if role == "ray" and "ClusterController" in title:
                role_of = "controller"
            elif role == "ray" and "ProxyActor" in title:
                role_of = "proxy"
            else:
                role_of = role
            out[role_of] += times.user + times.system
    own = psutil.Process().cpu_times()
    out["client"] = own.user + own.system
    return out


async def depths(args: argparse.Namespace) -> list[str]:
    models = zipf_models(args.adapters, args.base_model, random.Random(args.seed))
    lines = ["| clients | 200/s | p50 ms | other answers | CPU ms per request: "
             + " | ".join(ROLES) + " |", "|---|---|---|---|" + "---|" * len(ROLES)]
    print("\n".join(lines), flush=True)
    async with http_client(args.client, args.url, max(args.depths), args.timeout_s) as client:
        await closed_loop(client, models, min(args.depths), args.warmup_s, args.max_tokens)
        for depth in args.depths:
            before = await asyncio.to_thread(cpu_seconds, args.ray_root_pid)
            statuses, latencies = await closed_loop(client, models, depth, args.seconds, args.max_tokens)
            after = await asyncio.to_thread(cpu_seconds, args.ray_root_pid)
            done = max(1, statuses["200"])
            per = " | ".join(f"{1000 * (after[r] - before[r]) / done:.1f}" for r in ROLES)
            other = {k: v for k, v in statuses.items() if k != "200"} or "none"
            rate, p50 = statuses["200"] / args.seconds, 1000 * percentile(latencies, 50)
            row = f"| {depth} | {rate:.1f} | {p50:.0f} | {other} | {per} |"
            print(row, flush=True)
            lines.append(row)
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256, 8],
                   help="closed-loop clients of each step, in order")
    p.add_argument("--seconds", type=float, default=40.0, help="seconds per step")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="a first step at the smallest depth, not shown")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--base-model", default="demo", help="the base model's name in the API")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--client", choices=("httpx", "aiohttp"), default="httpx",
                   help="the HTTP client library (httpx: as the first depth runs of docs/soak.md; "
                        "load_tests/soak.py defaults to aiohttp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-root-pid", type=int, default=None,
                   help="count only the descendants of this process (e.g. `serve run`'s pid)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    asyncio.run(depths(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

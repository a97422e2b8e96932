"""Controller calls per parked request on the live app: parks coalesced per shard (`serve.routing.park_link`).

The app is the shipped one (`serve.app.build_app`, the demo zoo's tiny model and adapters, the shipped
defaults: one LoRA replica of 32 slots, one controller), served by Ray Serve on 127.0.0.1. Each round
sends `--burst` completions at once (`--max-tokens` greedy tokens, EOS ignored, adapters a0..a7 in
turn): those beyond the replica's room park in the cluster queue. Per round, from `GET /v1/cluster`:
the requests the ingress parked (`ingress.admission.parked`) and the ingresses' calls to the
controller by method (`controller.calls`). Calls per parked request = (`admit_many` + `grants` +
`admit`) / parked; before coalescing, every park was one `admit` call held until its grant (1.0 by
construction). `cancel_ticket` (a grant given back) is listed, not counted per park; the
placement fetch (`ingress_view`, every `placement_period_s` whatever the load) is not counted.

Also per round, the controller's CPU: its Serve replica process's CPU time (user + system, from the
operating system) from the burst's start until its last answer and 0.5 s more, and that over the
parked requests, an upper bound on what a park costs the controller (the replicas' reports, the
ticks and the health checks meanwhile are in it); beside it, the process's idle rate (3 s measured
before the rounds). On a shared machine both are noisy.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_park_calls.py [--rounds 3] [--burst 128]
     [--max-tokens 16] [--out docs/bench_park_calls.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import changed_settings, emit, header, load_avg, start_serve

ADAPTERS = 8
IDLE_S = 3.0  # the controller process's idle CPU rate is measured this long
PER_PARK = ("admit_many", "grants", "admit")  # the calls a park makes (admit: the uncoalesced one)
REASONS = {"demo_dir": "a scratch folder for the demo zoo, not the user's cache"}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"demo_dir": args.demo_dir}


async def cluster(http: Any) -> tuple[Counter[str], int]:
    """The controller's calls by method and the ingress's parked requests, so far."""
    view = (await http.get("/v1/cluster")).json()
    return Counter(view["controller"].get("calls", {})), int(view["ingress"]["admission"].get("parked", 0))


async def burst(http: Any, n: int, max_tokens: int, bound_s: float) -> Counter[int]:
    """`n` completions at once; their status codes."""

    async def one(i: int) -> int:
        body = {"model": f"a{i % ADAPTERS}", "prompt": "the river", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        return (await http.post("/v1/completions", json=body)).status_code

    codes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), bound_s)
    return Counter(codes)


def controller_process() -> Any:
    """The controller's Serve replica process on this machine."""
    import psutil

    return next(p for p in psutil.process_iter(["cmdline"])
                if "ClusterController" in " ".join(p.info["cmdline"] or ()))


def cpu_s(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def run(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    rows = []
    controller = controller_process()
    limits = httpx.Limits(max_connections=args.burst + 8)
    async with httpx.AsyncClient(base_url=base, timeout=args.bound_s, limits=limits) as http:
        await burst(http, ADAPTERS, args.max_tokens, args.bound_s)  # warm-up: every adapter loaded once
        idle_from, idle_t0 = cpu_s(controller), time.perf_counter()
        await asyncio.sleep(IDLE_S)
        idle_rate = (cpu_s(controller) - idle_from) / (time.perf_counter() - idle_t0)
        print(f"controller idle CPU: {idle_rate * 1e3:.1f} ms/s", file=sys.stderr)
        for _ in range(args.rounds):
            calls_before, parked_before = await cluster(http)
            started, cpu_before = time.perf_counter(), cpu_s(controller)
            codes = await burst(http, args.burst, args.max_tokens, args.bound_s)
            wall_s = time.perf_counter() - started
            await asyncio.sleep(0.5)  # the last grants polls answer
            cpu = cpu_s(controller) - cpu_before
            calls_after, parked_after = await cluster(http)
            calls = calls_after - calls_before
            rows.append({"parked": parked_after - parked_before, "calls": calls, "codes": codes,
                         "wall_s": wall_s, "cpu_s": cpu, "idle_rate": idle_rate})
    return rows


def policies() -> str:
    """Whether the policy modules ran compiled or from their sources (`lora_cluster.compiled`)."""
    import lora_cluster.cluster.controller as controller_module
    from lora_cluster.compiled import is_compiled

    if is_compiled(controller_module):
        return "compiled (mypyc), as installed"
    return ("Python sources (no compiled build here, or LORA_CLUSTER_PURE_PYTHON=1): the call counts are "
            "the same; the controller's CPU is higher than compiled (docs/scale.md#compiled-policies)")


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    command = "RAY_AUTH_MODE=disabled python benchmarks/bench_park_calls.py " + " ".join(sys.argv[1:])
    lines = header("Controller calls per parked request (live, coalesced parks)", command.strip(),
                   level=1, changed=changed_settings(settings(args), REASONS))
    lines += [f"- policy modules: {policies()}",
              f"- load average (1 / 5 / 15 min) at the end: {load_avg()}",
              f"- workload: {args.rounds} rounds of {args.burst} completions at once, {args.max_tokens} "
              f"tokens each, adapters a0..a{ADAPTERS - 1}", "",
              "| round | answers | parked | admit_many | grants | admit | calls per parked request | "
              "cancel_ticket | controller CPU ms (per parked request) | controller idle CPU ms/s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    total_calls = total_parked = 0
    for k, row in enumerate(rows, 1):
        calls, parked = row["calls"], row["parked"]
        per_park = sum(calls[m] for m in PER_PARK)
        total_calls, total_parked = total_calls + per_park, total_parked + parked
        answers = ", ".join(f"{n} x {code}" for code, n in sorted(row["codes"].items()))
        ratio = f"{per_park / parked:.2f}" if parked else "-"
        cpu = f"{row['cpu_s'] * 1e3:.0f}" + (f" ({row['cpu_s'] / parked * 1e3:.2f})" if parked else "")
        lines.append(f"| {k} | {answers} | {parked} | {calls['admit_many']} | {calls['grants']} | "
                     f"{calls['admit']} | {ratio} | {calls['cancel_ticket']} | "
                     f"{cpu} | {row['idle_rate'] * 1e3:.1f} | {row['wall_s']:.1f} |")
    if total_parked:
        lines += ["", f"All rounds: {total_calls} calls for {total_parked} parked requests, "
                      f"**{total_calls / total_parked:.2f} controller calls per parked request** "
                      "(1.00 with one `admit` call per park)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--bound-s", type=float, default=300.0, help="longest one round may take")
    parser.add_argument("--demo-dir", default=str(Path(tempfile.gettempdir()) / "lora-cluster-bench-zoo"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve

    from lora_cluster.serve.app import build_app

    base = start_serve(4, address="local")
    try:
        serve.run(build_app(settings(args)), name="park-calls", route_prefix="/")
        rows = asyncio.run(run(base, args))
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    emit(report(rows, args), args.out)


if __name__ == "__main__":
    main()

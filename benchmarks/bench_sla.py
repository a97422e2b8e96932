"""SLA classes under overload: the cluster controller against Ray Serve's own FIFO queue, on real Serve.

What is measured (project issue 8), on this machine, with the demo zoo's base model (~88M Llama,
float32, CPU) served by 2 LoRA replicas (1 CPU each, `max_num_seqs` 4, so 8 batch slots in all;
`less_urgent_prefill_chunk` 32 in every mode, so that a step that an interactive request waits for is short):

1. Rated load: closed loop at full concurrency (as many clients as batch slots, each sending its
   next request when the previous one ends) on the controller-off app; the completion rate over the
   measured window is the rate the 2 replicas sustain without queues growing.
2. SLA runs: open-loop Poisson arrivals at 1x, 2x and 3x the rated load for `--duration` seconds
   each, classes drawn 20% `interactive`, 50% `standard`, 30% `batch` (header `x-lora-priority`),
   adapters Zipf(1.1) over a0..a7, prompts of 8-32 words, 16-48 greedy output tokens (EOS ignored),
   every request streamed so that TTFT (send -> first SSE token event) is measured by the client.
   The same seeded arrival sequence is offered to every mode at one load; modes alternate in order
   from one load to the next. After the arrival window the requests still open get `--drain`
   seconds; then they are cancelled (client disconnect) and counted as *cut off*. Modes (one Serve
   application each, all deployed side by side, only one loaded at a time):

     on      `controller: true`, the default config: admission capacity = `max_num_seqs`; a request
             no replica has room for is parked in the cluster queue (class, then deadline order,
             aging) and granted to a replica when one frees a slot; `interactive` tickets preempt
             less urgent work at once (top_class_preempt_after_fraction 0), `standard` ones after
             half their TTFT target; the controller may refuse a ticket whose target it predicts
             cannot be met (429, Retry-After).
     off     `controller: false` and `max_ongoing_requests` = `max_num_seqs`: requests beyond the
             batch slots wait in Ray Serve's own router queue, first come first served.
     engine  (optional) `controller: false` with the default `max_ongoing_requests` (64): requests
             wait in each replica's engine queue, which orders by class priority and preempts.
     on-eager (optional, diagnostic) `on` with `preempt_after_fraction` 0.1 instead of 0.5.

   Per class: requests sent, completed, refused (429/503 with Retry-After), cut off, errors, p50 and
   p99 TTFT and SLO attainment = requests whose first token came within the class's TTFT target /
   requests sent (a refused, failed or cut-off request without its first token in time counts as
   not attained). A cut-off request without a first token contributes its wait so far, a lower
   bound, to the percentiles (marked >=). `batch` has no target: its column says "-". For `on`, the
   controller's and the ingress's counters from GET /v1/cluster (deltas over the run) and the
   largest cluster-queue depth seen (polled every 2 s), and what the controller still holds 2 s after
   the cut-off (tickets queued, slots counted as taken): a clean run leaves nothing. Engine preemption
   counts are not exposed by the API (EngineStats.num_preemptions is in neither the routing stats
   nor /metrics).
3. Slow path: all 8 slots are filled with `standard` base-model requests (sent 0.15 s apart, so that
   the request router spreads them 4 and 4), then one more 1-token request is sent; it waits (parked
   in the cluster queue with the controller, in Serve's queue without). Its latency from the first
   blocker's end (client side) to its own first token, on vs off, alternating; a round where a
   blocker queued or the probe was not parked is run again.
4. Fast path: the tiny demo model (so that the model's own time and its noise are small), 2
   replicas per app, one 1-token non-streaming request at a time (every request takes the fast path;
   checked with the ingress's counters), on and off alternating in each round; p50/p99 per mode and
   the median of the paired differences. Plus the CPU time of each app's processes over that phase,
   and, in process, the cost of `ClusterAdmission.admit` on the fast path against no controller.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_sla.py [--duration 50] [--drain 30]
     [--loads 1,2,3] [--modes on,off] [--phases sla,slow,fast] [--rated R] [--out docs/bench_sla.md]
     [--dump requests.jsonl]
`--dump` writes every SLA-run request as a JSON line (class, adapter, status, completion id, serving
replica, adapter hit, and its send / first token / end times on the machine's monotonic clock), to
line up with server-side timestamps when looking for where a request's time went.
Every load loop is bounded in requests and time; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import code_version, load_avg, now, percentile, serve_mode, start_serve
from sla_client import get_json, new_session, wait_idle, warm_up
from sla_paths import admission_micro, app_cpu_seconds, cpu_delta, fast_path, slow_path
from sla_phases import RunResult, closed_loop, sla_run, uncontended
from sla_report import class_stats, dump_outcomes, report
from sla_setup import MODE_CONFIG, NUM_REPLICAS, SLOTS, app_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals per SLA run")
    ap.add_argument("--drain", type=float, default=30.0, help="seconds after the arrivals before cut-off")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 3.0])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["on", "off"])
    ap.add_argument("--phases", type=lambda s: s.split(","), default=["sla", "slow", "fast"])
    ap.add_argument("--rated", type=float, default=None, help="rated load (requests/s); default: measure")
    ap.add_argument("--rated-seconds", type=float, default=30.0)
    ap.add_argument("--interactive-ttft", type=float, default=1.0)
    ap.add_argument("--standard-ttft", type=float, default=5.0)
    ap.add_argument("--slow-rounds", type=int, default=6)
    ap.add_argument("--blocker-tokens", type=int, default=24)
    ap.add_argument("--fast-rounds", type=int, default=300)
    ap.add_argument("--fast-warmup", type=int, default=20)
    ap.add_argument("--size", choices=["tiny", "base"], default="base")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zoo-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--dump", type=Path, default=None,
                    help="write every SLA-run request here, one JSON object a line (see `dump_outcomes`)")
    ap.add_argument("--serve-mode", choices=("default", "throughput"), default="default",
                    help="`throughput`: Ray Serve's throughput-optimized mode (direct ingress behind "
                    "HAProxy, `THROUGHPUT_MODE_ENV` of serve/ops/serve_mode.py) instead of its HTTP proxy")
    args = ap.parse_args()
    unknown = set(args.modes) - set(MODE_CONFIG)
    if unknown or ("fast" in args.phases and not {"on", "off"} <= set(args.modes)):
        ap.error(f"modes are {sorted(MODE_CONFIG)}; the fast phase needs on and off (unknown: {unknown})")
    if not args.rated and "off" not in args.modes and "sla" in args.phases:
        ap.error("the rated load is measured on `off`: include it or give --rated")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with serve_mode(args.serve_mode):  # before Ray starts: its controller and replicas read it
        return asyncio.run(run(args))


async def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.serve.app import build_app

    t_start = time.monotonic()
    meta: dict[str, Any] = {"date": now(), "load_start": load_avg(), "warmup_refused": {},
                            "code": code_version()}
    classes = [{"name": "interactive", "priority": 0, "ttft_s": args.interactive_ttft, "tpot_s": 0.2},
               {"name": "standard", "priority": 1, "ttft_s": args.standard_ttft, "tpot_s": 0.5},
               {"name": "batch", "priority": 2}]
    targets = {c["name"]: c.get("ttft_s") for c in classes}
    root = start_serve(2 * NUM_REPLICAS * len(args.modes) + 2, address="local")
    runs: list[RunResult] = []
    slow = fast = None
    try:
        bases = {m: f"{root}/{m}" for m in args.modes}
        sessions = {m: new_session() for m in args.modes}
        if {"sla", "slow"} & set(args.phases):
            zoo = build_demo_zoo(args.zoo_dir / f"lora-cluster-bench-sla-zoo-{args.size}", num_adapters=16,
                                 size=args.size, seed=0)
            for mode in args.modes:
                t0 = time.monotonic()
                serve.run(build_app(app_config(zoo, mode, classes)), name=f"sla-{mode}",
                          route_prefix=f"/{mode}")
                print(f"[bench_sla] app {mode} up in {time.monotonic() - t0:.0f} s", flush=True)
                meta["warmup_refused"][mode] = await warm_up(sessions[mode], bases[mode])
            unc = await uncontended(sessions, bases, random.Random(args.seed))
            meta["uncontended"] = {m: statistics.median(v) for m, v in unc.items()}
            if {"on", "off"} <= set(unc):
                meta["uncontended_diff"] = statistics.median(a - b for a, b in zip(unc["on"], unc["off"],
                                                                                   strict=True))
            print(f"[bench_sla] uncontended TTFT {meta['uncontended']}", flush=True)
        if "sla" in args.phases:
            rated = args.rated
            if not rated:
                await wait_idle(sessions["off"], bases["off"], False)
                detail = await closed_loop(sessions["off"], bases["off"], SLOTS, 8.0, args.rated_seconds,
                                           args.seed + 1)
                meta["rated_detail"], rated = detail, detail["rate"]
                print(f"[bench_sla] rated load {detail}", flush=True)
            meta["rated"] = rated
            for i, load in enumerate(args.loads):
                order = args.modes if i % 2 == 0 else list(reversed(args.modes))
                for mode in order:
                    result = await sla_run(sessions[mode], bases[mode], mode, load, rated, args,
                                           seed=args.seed + 100 + i)
                    runs.append(result)
                    print(f"[bench_sla] {load:g}x {mode}: " + "; ".join(
                        f"{c} {class_stats(result.outcomes, c, t)}" for c, t in targets.items())
                        + f"; counters {result.counters}; depth {result.max_depth}; after {result.after}",
                        flush=True)
        if "slow" in args.phases:
            slow = await slow_path(sessions, bases, args.slow_rounds, args.blocker_tokens)
            print(f"[bench_sla] slow path {slow}", flush=True)
        if "fast" in args.phases:
            for mode in args.modes:
                serve.delete(f"sla-{mode}")
            tiny = build_demo_zoo(args.zoo_dir / "lora-cluster-bench-sla-zoo-tiny", num_adapters=16,
                                  size="tiny", seed=0)
            fast_bases = {m: f"{root}/fast-{m}" for m in ("on", "off")}
            fast_sessions = {m: sessions[m] for m in ("on", "off")}
            for mode in ("on", "off"):
                serve.run(build_app(app_config(tiny, mode, classes)), name=f"fast-{mode}",
                          route_prefix=f"/fast-{mode}")
                meta["warmup_refused"][f"fast-{mode}"] = await warm_up(fast_sessions[mode], fast_bases[mode])
            before = await get_json(fast_sessions["on"], f"{fast_bases['on']}/v1/cluster")
            cpu0, t0 = {m: app_cpu_seconds(f"fast-{m}") for m in ("on", "off")}, time.monotonic()
            lat = await fast_path(fast_sessions, fast_bases, args.fast_rounds, args.fast_warmup)
            cpu1, phase_s = {m: app_cpu_seconds(f"fast-{m}") for m in ("on", "off")}, time.monotonic() - t0
            after = await get_json(fast_sessions["on"], f"{fast_bases['on']}/v1/cluster")
            b, a = before["ingress"]["admission"], after["ingress"]["admission"]
            counts = {k: int(a.get(k, 0)) - int(b.get(k, 0)) for k in sorted(set(a) | set(b))}
            cpu = {m: cpu_delta(cpu0[m], cpu1[m]) for m in cpu1}
            fast = {"lat": lat, "cpu": cpu, "micro": await admission_micro(20_000), "counts": counts,
                    "phase_s": phase_s}
            print(f"[bench_sla] fast path p50 on {percentile(lat['on'], 0.5):.4f} off "
                  f"{percentile(lat['off'], 0.5):.4f}; counts {counts}; cpu {cpu}", flush=True)
        for s in sessions.values():
            await s.close()
    finally:
        serve.shutdown()
        ray.shutdown()
    meta["wall_min"] = (time.monotonic() - t_start) / 60
    text = report(args, meta, runs, targets, slow, fast)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.dump:
        dump_outcomes(args.dump, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

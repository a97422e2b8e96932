"""bench_sla's load phases: the rated load (a closed loop at full concurrency), the SLA runs (seeded
Poisson arrivals at a multiple of it, then a bounded drain, then the cut-off), and the uncontended
TTFT of one request at a time. Every loop is bounded in requests and time."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common import percentile
from sla_client import HTTP_TIMEOUT_S, Outcome, get_json, held_slots, stream_one, wait_idle
from sla_setup import uses_controller
from sla_workload import Req, make_request

POLL_S = 2.0


async def closed_loop(session: Any, base: str, concurrency: int, warm_s: float, measure_s: float,
                      seed: int) -> dict[str, Any]:
    """`concurrency` clients back to back; completions per second within the measured window."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    w0, w1 = t0 + warm_s, t0 + warm_s + measure_s
    outcomes: list[Outcome] = []

    async def client() -> None:
        while time.perf_counter() < w1:
            out = Outcome(make_request(rng))
            outcomes.append(out)
            await asyncio.wait_for(stream_one(session, base, out), HTTP_TIMEOUT_S)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    inside = [o for o in outcomes if o.completed and w0 <= o.done <= w1]
    bad = [o for o in outcomes if not o.completed]
    ttfts = [o.first - o.sent for o in inside if o.first is not None]
    return {"rate": len(inside) / measure_s, "completed": len(inside), "not_completed": len(bad),
            "statuses": sorted({o.status for o in bad}, key=str), "ttft_p50": percentile(ttfts, 0.5),
            "service_p50": percentile([o.done - o.sent for o in inside], 0.5),
            "tokens_per_s": sum(o.req.max_tokens for o in inside) / measure_s}


@dataclass
class RunResult:
    mode: str
    load: float
    rate: float
    outcomes: list[Outcome]
    wall_s: float
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    max_depth: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    load_avg: float = 0.0  # 1-minute load average at the end of the arrivals


async def open_loop(session: Any, base: str, rate: float, duration: float, drain: float, seed: int,
                    poll: Callable[[], Any] | None = None) -> tuple[list[Outcome], float]:
    """Poisson arrivals at `rate` for `duration` s, then at most `drain` s for the open requests, then
    the rest are cancelled. Returns the outcomes and the wall time."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, Req]] = []
    t = rng.expovariate(rate)
    cap = int(rate * duration * 1.5) + 20  # bound on requests whatever the draw
    while t < duration and len(arrivals) < cap:
        arrivals.append((t, make_request(rng)))
        t += rng.expovariate(rate)
    outcomes = [Outcome(req) for _, req in arrivals]
    tasks: list[asyncio.Task[Outcome]] = []
    start = time.perf_counter()
    poller = asyncio.get_running_loop().create_task(poll()) if poll is not None else None
    for (at, _), out in zip(arrivals, outcomes, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.get_running_loop().create_task(stream_one(session, base, out)))
    remaining = start + duration + drain - time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=max(0.1, remaining)) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    if poller is not None:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    return outcomes, wall


async def sla_run(session: Any, base: str, mode: str, load: float, rated: float, args: argparse.Namespace,
                  seed: int) -> RunResult:
    controller = uses_controller(mode)
    before = await wait_idle(session, base, controller)
    max_depth: dict[str, Any] = {"depth": 0, "by_class": {}, "oldest_wait_s": 0.0}

    async def poll() -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                q = (await get_json(session, f"{base}/v1/cluster"))["queue"]
            except Exception as exc:  # a failed poll is reported, not fatal
                max_depth["poll_error"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            if q["depth"] > max_depth["depth"]:
                max_depth.update(depth=q["depth"], by_class=q["by_class"])
            max_depth["oldest_wait_s"] = max(max_depth["oldest_wait_s"], q["oldest_wait_s"])

    outcomes, wall = await open_loop(session, base, load * rated, args.duration, args.drain, seed,
                                     poll if controller else None)
    result = RunResult(mode, load, load * rated, outcomes, wall, max_depth=max_depth if controller else {},
                       load_avg=os.getloadavg()[0])
    t_end = time.monotonic()
    if controller:  # what the controller holds once the cut-off clients are gone
        await asyncio.sleep(2.0)
        view = await get_json(session, f"{base}/v1/cluster")
        held, busy = held_slots(view)
        result.after["2 s after the cut-off"] = {"queued": view["queue"]["depth"], "slots held": held,
                                                 "running or waiting": busy}
    try:
        after = await wait_idle(session, base, controller)
        result.after["idle after s"] = round(time.monotonic() - t_end, 1)
    except RuntimeError as exc:
        result.after["not idle"] = str(exc)
        after = await get_json(session, f"{base}/v1/cluster") if controller else {}
    if controller:
        for part, key in (("controller", "counts"), ("ingress", "admission")):
            b, a = before[part][key], after[part][key]
            result.counters[part] = {k: int(a.get(k, 0)) - int(b.get(k, 0)) for k in sorted(set(a) | set(b))}
        result.after["ingress in flight"] = after["ingress"]["in_flight"]
        result.after["controller restarted"] = after["controller"]["up_s"] < before["controller"]["up_s"]
    return result


async def uncontended(sessions: dict[str, Any], bases: dict[str, str], rng: random.Random,
                      n: int = 20) -> dict[str, list[float]]:
    """TTFT of one streamed request at a time: the same `n` requests to every mode, interleaved."""
    out: dict[str, list[float]] = {m: [] for m in bases}
    for i in range(n):
        req = make_request(rng, "standard")
        for mode in list(bases) if i % 2 == 0 else list(reversed(bases)):
            o = Outcome(req)
            await asyncio.wait_for(stream_one(sessions[mode], bases[mode], o), HTTP_TIMEOUT_S)
            if o.first is None:
                raise RuntimeError(f"uncontended request failed: {o}")
            out[mode].append(o.first - o.sent)
    return out

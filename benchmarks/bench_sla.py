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
import contextlib
import datetime
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_NUM_SEQS = 4
NUM_REPLICAS = 2
SERVE_MODE_NOTE = {"default": "its HTTP proxy", "throughput": "direct ingress behind HAProxy"}
SLOTS = MAX_NUM_SEQS * NUM_REPLICAS
ADAPTERS = [f"a{i}" for i in range(8)]
ZIPF_S = 1.1
CLASS_MIX = (("interactive", 0.2), ("standard", 0.5), ("batch", 0.3))
PROMPT_WORDS = (8, 32)
OUTPUT_TOKENS = (16, 48)
TEXT = ("the river runs past a quiet town where people trade bread fish salt and wool in the morning "
        "light while children play near old stone walls and boats drift slowly under a grey sky that "
        "promises rain before evening comes over the hills")
WORDS = tuple(TEXT.split(" "))
POLL_S = 2.0
IDLE_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 60.0


# ----- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    cls: str
    adapter: str
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    req: Req
    sent: float = 0.0
    status: int | None = None
    retry_after: str | None = None
    first: float | None = None
    done: float | None = None
    error: str | None = None
    cut_off: float | None = None  # when it was cancelled (perf_counter), None: it ended on its own
    response_id: str | None = None  # the completion's `id` (its first event), for --dump
    replica: str | None = None  # the `x-lora-replica` header
    hit: str | None = None  # the `x-lora-adapter-hit` header

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done is not None and self.error is None

    @property
    def refused(self) -> bool:
        return self.status in (429, 503)

    @property
    def failed(self) -> bool:
        """An answer other than 200/429/503, an exception, or an error event mid-stream."""
        return self.error is not None or (self.status is not None and self.status not in (200, 429, 503))

    def ttft(self) -> tuple[float, bool] | None:
        """(TTFT, censored): the wait so far when it was cut off without a first token."""
        if self.first is not None:
            return self.first - self.sent, False
        if self.cut_off is not None and self.status in (None, 200) and self.error is None:
            return self.cut_off - self.sent, True
        return None


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def make_request(rng: random.Random, cls: str | None = None) -> Req:
    if cls is None:
        cls = rng.choices([c for c, _ in CLASS_MIX], [p for _, p in CLASS_MIX])[0]
    adapter = rng.choices(ADAPTERS, zipf_weights(len(ADAPTERS), ZIPF_S))[0]
    words = [rng.choice(WORDS) for _ in range(rng.randint(*PROMPT_WORDS))]
    return Req(cls, adapter, " ".join(words), rng.randint(*OUTPUT_TOKENS))


def body(req: Req, stream: bool = True) -> dict[str, Any]:
    return {"model": req.adapter, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


# ----- the client --------------------------------------------------------------------------------


async def stream_one(session: Any, base: str, out: Outcome) -> Outcome:
    """Send `out.req` streamed; fills `out` in place (so a cancelled request keeps what it got)."""
    import aiohttp

    out.sent = time.perf_counter()
    try:
        async with session.post(f"{base}/v1/completions", json=body(out.req),
                                headers={"x-lora-priority": out.req.cls}) as r:
            out.status, out.retry_after = r.status, r.headers.get("Retry-After")
            out.replica, out.hit = r.headers.get("x-lora-replica"), r.headers.get("x-lora-adapter-hit")
            if r.status != 200:
                await r.read()
                return out
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    out.done = time.perf_counter()
                    break
                if line.startswith(b'data: {"error"'):
                    out.error = line[6:200].decode(errors="replace").strip()
                    continue
                if out.first is None:
                    out.first = time.perf_counter()
                    with contextlib.suppress(ValueError):
                        out.response_id = json.loads(line[6:]).get("id")
    except asyncio.CancelledError:
        out.cut_off = time.perf_counter()
        raise
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def post_json(session: Any, url: str, payload: dict[str, Any], headers: dict[str, str]) -> int:
    async with session.post(url, json=payload, headers=headers) as r:
        await r.read()
        return r.status


async def get_json(session: Any, url: str) -> dict[str, Any]:
    import aiohttp

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as r:
        if r.status != 200:
            raise RuntimeError(f"GET {url}: {r.status} {(await r.text())[:300]}")
        return await r.json()


def new_session() -> Any:
    import aiohttp

    # no connection limit: a client-side pool limit would be a hidden queue inside the measured TTFT
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=HTTP_TIMEOUT_S))


def held_slots(view: dict[str, Any]) -> tuple[int, int]:
    """(slots the controller counts as taken, requests the replicas report running or waiting)."""
    reps = [r for node in view.get("nodes", {}).values() for r in node["replicas"].values()]
    return (sum(int(r["capacity"]) - int(r["free"]) for r in reps),
            sum(int(r["running"]) + int(r["waiting"]) for r in reps))


async def wait_idle(session: Any, base: str, controller: bool) -> dict[str, Any]:
    """Until the app's replicas run and queue nothing and, with the controller, its queue is empty and
    it counts every slot as free; bounded (RuntimeError naming what is left)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        reps = (await get_json(session, f"{base}/debug/replicas"))["replicas"]
        busy = sum(int(r["num_running"]) + int(r["num_waiting"]) for r in reps.values())
        view = await get_json(session, f"{base}/v1/cluster") if controller else {}
        depth = view.get("queue", {}).get("depth", 0)
        held = held_slots(view)[0] if controller else 0
        if busy == 0 and depth == 0 and held == 0:
            return view
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} not idle after {IDLE_TIMEOUT_S:.0f} s: {busy} requests in the "
                               f"engines, {depth} in the cluster queue, {held} slots held by the controller")
        await asyncio.sleep(0.5)


# ----- phases ------------------------------------------------------------------------------------


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
            "statuses": sorted({o.status for o in bad}, key=str), "ttft_p50": pick(sorted(ttfts), 0.5),
            "service_p50": pick(sorted(o.done - o.sent for o in inside), 0.5),
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


async def slow_path(sessions: dict[str, Any], bases: dict[str, str], rounds: int,
                    blocker_tokens: int) -> dict[str, dict[str, Any]]:
    """Fill every slot, then send one 1-token request that must wait for one to free (see above).
    A round counts only if all blockers ran when the probe was sent (none queued, none finished)
    and, with the controller, the probe was parked; otherwise it is run again (at most twice)."""
    results: dict[str, dict[str, Any]] = {m: {"rows": [], "invalid": 0, "why": []} for m in bases}
    for i in range(rounds):
        order = list(bases) if i % 2 == 0 else list(reversed(bases))
        for mode in order:
            for _ in range(3):
                row = await slow_path_round(sessions[mode], bases[mode], uses_controller(mode),
                                            blocker_tokens)
                if "why" not in row:
                    results[mode]["rows"].append(row)
                    break
                results[mode]["invalid"] += 1
                results[mode]["why"].append(row["why"])
    return results


async def slow_path_round(session: Any, base: str, controller: bool,
                          blocker_tokens: int) -> dict[str, Any]:
    await wait_idle(session, base, controller)
    await asyncio.sleep(1.5)  # the routing stats and reports show the idle replicas
    # the base model (no adapter), one blocker every 0.15 s: sent all at once (or for adapters), the
    # request router may put 5-6 of them on one replica with the controller on (max_ongoing_requests
    # 64), where they wait in the engine while the other replica has free slots (see the reading)
    model = (await get_json(session, f"{base}/v1/models"))["data"][0]["id"]
    blockers = [Outcome(Req("standard", model, " ".join(WORDS[:12]), blocker_tokens)) for _ in range(SLOTS)]
    tasks = []
    for o in blockers:
        tasks.append(asyncio.create_task(stream_one(session, base, o)))
        await asyncio.sleep(0.15)
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while any(o.first is None and o.done is None and o.error is None and o.status in (None, 200)
              for o in blockers) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    all_running = all(o.first is not None and o.done is None for o in blockers)
    parked0 = (await get_json(session, f"{base}/v1/cluster"))["ingress"]["admission"].get("parked", 0) \
        if controller else 0
    probe = Outcome(Req("standard", model, " ".join(WORDS[:10]), 1))
    await asyncio.wait_for(asyncio.gather(stream_one(session, base, probe), *tasks), HTTP_TIMEOUT_S)
    parked = (await get_json(session, f"{base}/v1/cluster"))["ingress"]["admission"].get("parked", 0) \
        - parked0 if controller else 0
    if not (probe.completed and all(o.completed for o in blockers)):
        raise RuntimeError(f"slow-path round failed: probe {probe}, blockers {[o.status for o in blockers]}")
    freed = min(o.done for o in blockers if o.done is not None)
    if not all_running or probe.sent >= freed or (controller and parked != 1):
        return {"why": f"all blockers running {all_running}, probe sent {probe.sent - freed:+.2f} s after "
                       f"the first blocker ended, probe parked {parked}"}
    return {"after_free": probe.first - freed, "ttft": probe.first - probe.sent}


async def fast_path(sessions: dict[str, Any], bases: dict[str, str], rounds: int,
                    warmup: int) -> dict[str, list[float]]:
    """One 1-token non-streaming request at a time, modes alternating within each round."""
    lat: dict[str, list[float]] = {m: [] for m in bases}
    req = Req("standard", "a1", "the river runs past a quiet town", 1)
    for i in range(warmup + rounds):
        order = list(bases) if i % 2 == 0 else list(reversed(bases))
        for mode in order:
            t0 = time.perf_counter()
            status = await asyncio.wait_for(
                post_json(sessions[mode], f"{bases[mode]}/v1/completions", body(req, stream=False),
                          {"x-lora-priority": req.cls}), HTTP_TIMEOUT_S)
            dt = time.perf_counter() - t0
            if status != 200:
                raise RuntimeError(f"{mode}: fast-path request answered {status}")
            if i >= warmup:
                lat[mode].append(dt)
    return lat


async def admission_micro(n: int) -> dict[str, float]:
    """In process: seconds per request of ClusterAdmission's fast path (admit, started, finished)
    with a controller handle (never called: every request finds room) and without one."""
    import threading

    from lora_cluster.serve.admission import ClusterAdmission

    lock = threading.Lock()
    published = {f"r{k}": {"max_num_seqs": MAX_NUM_SEQS, "num_running": 1, "num_waiting": 0}
                 for k in range(NUM_REPLICAS)}

    def stats() -> dict[str, dict[str, Any]]:  # as affinity.replica_stats: a copy under a lock
        with lock:
            return dict(published)

    out: dict[str, float] = {}
    for name, handle in (("on", object()), ("off", None)):
        adm = ClusterAdmission(handle, capacity=None, replica_stats=stats, timeout_s=300.0)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                granted = await adm.admit(sla_class="standard", adapter_id="a1", arrived_at=0.0)
                assert granted is None
                adm.started("r0", granted=False)
                adm.finished("r0")
            best = min(best, (time.perf_counter() - t0) / n)
        out[name] = best
    return out


# ----- process CPU -------------------------------------------------------------------------------


def app_cpu_seconds(app: str) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each Ray process of Serve app `app`: pid -> (deployment, seconds). Found
    by process title, which Ray changes while a task runs (`LoraIngress.handle_request...`)."""
    import psutil

    cpu: dict[int, tuple[str, float]] = {}
    tag = f"ServeReplica:{app}:"
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if tag not in cmd:
                continue
            deployment = cmd.split(tag, 1)[1].split()[0].split(".")[0]
            t = p.cpu_times()
            cpu[p.pid] = (deployment, t.user + t.system)
        except (psutil.Error, IndexError):
            continue
    return cpu


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two `app_cpu_seconds`, by deployment (processes present in both)."""
    out: dict[str, float] = {}
    for pid, (deployment, seconds) in after.items():
        if pid in before:
            out[deployment] = out.get(deployment, 0.0) + seconds - before[pid][1]
    return out


# ----- statistics and the report -----------------------------------------------------------------


def pick(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def censored_pct(samples: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """Nearest-rank percentile of (value, is_lower_bound) samples; True when it is only a lower bound."""
    if not samples:
        return math.nan, False
    s = sorted(samples)
    i = min(len(s) - 1, int(q * len(s)))
    return s[i][0], any(c for _, c in s[: i + 1])


def fmt_s(value: float, lower_bound: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return f"{'>=' if lower_bound else ''}{value:.2f}"


def class_stats(outcomes: list[Outcome], cls: str, target: float | None) -> dict[str, Any]:
    mine = [o for o in outcomes if o.req.cls == cls]
    samples = [t for o in mine if (t := o.ttft()) is not None]
    attained = sum(1 for o in mine if o.first is not None and o.error is None
                   and target is not None and o.first - o.sent <= target)
    return {
        "sent": len(mine), "completed": sum(o.completed for o in mine),
        "refused": sum(o.refused for o in mine),
        "refused_no_retry_after": sum(o.refused and not o.retry_after for o in mine),
        "cut_off": sum(o.cut_off is not None and not o.completed and not o.refused for o in mine),
        "failed": sum(o.failed for o in mine),
        "p50": censored_pct(samples, 0.5), "p99": censored_pct(samples, 0.99),
        "attainment": None if target is None or not mine else attained / len(mine),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = f", {int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem = ""
    return f"{cpu}, {os.cpu_count()} cores{mem}, no GPU"


def code_version() -> str:
    """The commit the library was measured at, and whether lora_cluster/ differs from it."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lora_cluster"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"commit {head or 'unknown'}" + (" with uncommitted changes in lora_cluster/" if dirty else "")


def load_avg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def report(args: argparse.Namespace, meta: dict[str, Any], runs: list[RunResult],
           targets: dict[str, float | None], slow: dict[str, list[dict[str, float]]] | None,
           fast: dict[str, Any] | None) -> str:
    import ray
    import torch

    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    cmd = "RAY_AUTH_MODE=disabled python benchmarks/bench_sla.py " + " ".join(sys.argv[1:])
    lines = [
        "# Cluster controller: SLA classes under overload", "",
        f"- date: {meta['date']}",
        f"- machine: {machine()}; load average at the start {meta['load_start']}, at the end {load_avg()}",
        f"- software: Python {sys.version.split()[0]}, torch {torch.__version__}, Ray {ray.__version__}; "
        f"lora-cluster at {meta['code']}",
        f"- command: `{cmd.strip()}` ({meta['wall_min']:.1f} min)",
        f"- served: demo zoo `{args.size}` model, {NUM_REPLICAS} LoRA replicas x 1 CPU, max_num_seqs "
        f"{MAX_NUM_SEQS} ({SLOTS} batch slots), max_loras 8, less_urgent_prefill_chunk 32; Ray Serve "
        f"{args.serve_mode} mode ({SERVE_MODE_NOTE[args.serve_mode]}); modes: "
        + "; ".join(f"`{m}` {json.dumps(MODE_CONFIG[m])}" for m in args.modes),
        f"- workload: prompts of {PROMPT_WORDS[0]}-{PROMPT_WORDS[1]} words, {OUTPUT_TOKENS[0]}-"
        f"{OUTPUT_TOKENS[1]} output tokens (greedy, EOS ignored), adapters Zipf({ZIPF_S}) over "
        f"{ADAPTERS[0]}..{ADAPTERS[-1]}, classes " + ", ".join(f"{int(100 * p)}% {c}" for c, p in CLASS_MIX)
        + f"; streamed; Poisson arrivals for {args.duration:g} s per run, then {args.drain:g} s to drain, "
        "then cut off",
        "- TTFT targets (the servers' `sla_classes`, the same for every mode): "
        + ", ".join(f"{c} {'none' if t is None else f'{t:g} s'}" for c, t in targets.items()),
    ]
    if any(meta["warmup_refused"].values()):
        lines.append("- warm-up requests refused with 429 (sent again): " + ", ".join(
            f"{m} {n}" for m, n in meta["warmup_refused"].items()))
    if meta.get("uncontended"):
        lines.append("- uncontended TTFT (one streamed request at a time, the same 20 to each mode, p50): "
                     + ", ".join(f"{m} {ms(v)} ms" for m, v in meta["uncontended"].items())
                     + (f"; on - off, median of the paired differences {ms(meta['uncontended_diff'])} ms"
                        if "uncontended_diff" in meta else ""))
    if meta.get("rated_detail"):
        d = meta["rated_detail"]
        lines.append(f"- rated load: {meta['rated']:.2f} requests/s ({d['tokens_per_s']:.0f} output "
                     f"tokens/s), closed loop at {SLOTS} clients for {args.rated_seconds:g} s on `off` "
                     f"(p50 TTFT {ms(d['ttft_p50'])} ms, p50 request {d['service_p50']:.2f} s, "
                     f"{d['not_completed']} not completed)")
    elif meta.get("rated"):
        lines.append(f"- rated load: {meta['rated']:.2f} requests/s (given with --rated)")
    if runs:
        lines += ["", "TTFT in seconds; attainment = first token within the class target / requests sent "
                  "(refused, failed and cut-off requests count as missed).", "",
                  "| load | mode | class | sent | completed | refused | cut off | errors | p50 TTFT | "
                  "p99 TTFT | attainment |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for run in runs:
            for cls, target in targets.items():
                s = class_stats(run.outcomes, cls, target)
                att = "-" if s["attainment"] is None else f"{100 * s['attainment']:.1f}%"
                refused = f"{s['refused']}" + (f" ({s['refused_no_retry_after']} no Retry-After)"
                                               if s["refused_no_retry_after"] else "")
                lines.append(f"| {run.load:g}x ({run.rate:.2f}/s) | {run.mode} | {cls} | {s['sent']} | "
                             f"{s['completed']} | {refused} | {s['cut_off']} | {s['failed']} | "
                             f"{fmt_s(*s['p50'])} | {fmt_s(*s['p99'])} | {att} |")
        lines += ["", "| load | mode | wall s | completed/s in the run | machine load avg | controller "
                  "counters (delta) | ingress admission (delta) | max cluster queue | after the run |",
                  "|---|---|---:|---:|---:|---|---|---|---|"]
        for run in runs:
            done = sum(o.completed for o in run.outcomes)
            counters = run.counters.get("controller", {})
            ctrl = ", ".join(f"{k} {v}" for k, v in counters.items() if k != "reports")
            ing = ", ".join(f"{k} {v}" for k, v in run.counters.get("ingress", {}).items())
            depth = (f"{run.max_depth['depth']} {json.dumps(run.max_depth['by_class'])}, oldest wait "
                     f"{run.max_depth['oldest_wait_s']:.1f} s" if run.max_depth else "-")
            if run.max_depth.get("poll_error"):
                depth += f" (poll error: {run.max_depth['poll_error']})"
            after = json.dumps(run.after) if run.after else "-"
            lines.append(f"| {run.load:g}x | {run.mode} | {run.wall_s:.0f} | {done / run.wall_s:.2f} | "
                         f"{run.load_avg:.1f} | {ctrl or '-'} | {ing or '-'} | {depth} | {after} |")
        errors = sorted({o.error for run in runs for o in run.outcomes if o.error})
        statuses = sorted({o.status for run in runs for o in run.outcomes if o.failed and o.status})
        if errors or statuses:
            lines += ["", f"Errors seen: statuses {statuses}; " + "; ".join(errors[:5])]
    if slow:
        lines += ["", f"Slow path: {SLOTS} `standard` blockers ({args.blocker_tokens} tokens) fill every "
                  "slot, then one 1-token `standard` request is sent; its first token after the first "
                  "blocker's end (client side); rounds alternate between the modes; a round counts only "
                  "if every blocker was running when the probe was sent and (on) the probe was parked.", "",
                  "| mode | rounds (invalid) | p50 ms after a slot frees | min ms | max ms | p50 TTFT ms |",
                  "|---|---|---:|---:|---:|---:|"]
        for mode, res in slow.items():
            rows = res["rows"]
            if not rows:
                lines.append(f"| {mode} | 0 ({res['invalid']}) | - | - | - | - |")
                continue
            after = sorted(r["after_free"] for r in rows)
            ttft = sorted(r["ttft"] for r in rows)
            lines.append(f"| {mode} | {len(rows)} ({res['invalid']}) | {ms(pick(after, 0.5))} | "
                         f"{ms(after[0])} | {ms(after[-1])} | {ms(pick(ttft, 0.5))} |")
    if fast:
        lat, cpu, micro, counts = fast["lat"], fast["cpu"], fast["micro"], fast["counts"]
        n = len(next(iter(lat.values())))
        lines += ["", f"Fast path: tiny demo model, {NUM_REPLICAS} replicas per app, one 1-token "
                  f"non-streaming request at a time, {n} rounds (after {args.fast_warmup} warm-up "
                  "rounds), on and off alternating in each round.", "",
                  "| mode | p50 ms | p90 ms | p99 ms | mean ms | "
                  f"app CPU s over the {fast['phase_s']:.0f} s phase |",
                  "|---|---:|---:|---:|---:|---|"]
        for mode, samples in lat.items():
            s = sorted(samples)
            c = cpu.get(mode, {})
            lines.append(f"| {mode} | {ms(pick(s, 0.5))} | {ms(pick(s, 0.9))} | {ms(pick(s, 0.99))} | "
                         f"{ms(statistics.fmean(s))} | {sum(c.values()):.1f} ("
                         + ", ".join(f"{k} {v:.1f}" for k, v in sorted(c.items())) + ") |")
        if {"on", "off"} <= set(lat):
            diffs = sorted(a - b for a, b in zip(lat["on"], lat["off"], strict=True))
            lo, hi = bootstrap_median_ci(diffs)
            on, off = sorted(lat["on"]), sorted(lat["off"])
            lines += ["", f"- on - off: median of paired differences {ms(pick(diffs, 0.5))} ms (95% "
                      f"bootstrap interval {ms(lo)} to {ms(hi)} ms); p50 "
                      f"{ms(pick(on, 0.5) - pick(off, 0.5))} ms; p99 "
                      f"{ms(pick(on, 0.99) - pick(off, 0.99))} ms",
                      f"- the `on` ingress's admission counters over the phase: {json.dumps(counts)}",
                      f"- in process, `ClusterAdmission` admit + started + finished per request: on "
                      f"{1e6 * micro['on']:.2f} µs, off {1e6 * micro['off']:.2f} µs"]
    return "\n".join(lines) + "\n"


def dump_outcomes(path: Path, runs: list[RunResult]) -> None:
    """One JSON line per SLA-run request: mode, load, class, adapter, max_tokens, HTTP status, the
    completion id, the serving replica and hit headers, and its times in seconds on the machine's
    monotonic clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux, as the servers' `time.monotonic`,
    so they line up with server-side timestamps): sent, first token, done, cut off (null: none)."""
    with path.open("w") as f:
        for run in runs:
            for o in run.outcomes:
                f.write(json.dumps({
                    "mode": run.mode, "load": run.load, "cls": o.req.cls, "adapter": o.req.adapter,
                    "max_tokens": o.req.max_tokens, "status": o.status, "id": o.response_id,
                    "replica": o.replica, "hit": o.hit, "sent": o.sent, "first": o.first, "done": o.done,
                    "cut_off": o.cut_off, "error": o.error}) + "\n")


def bootstrap_median_ci(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps)]


# ----- main --------------------------------------------------------------------------------------

MODE_CONFIG: dict[str, dict[str, Any]] = {
    "on": {"controller": True},
    "off": {"controller": False, "max_ongoing_requests": MAX_NUM_SEQS},
    "engine": {"controller": False},
    # diagnostic: the controller with urgent tickets preempting after 10% of their target instead of 50%
    "on-eager": {"controller": True, "preempt_after_fraction": 0.1},
}


def uses_controller(mode: str) -> bool:
    return bool(MODE_CONFIG[mode].get("controller", True))


def app_config(zoo: Any, mode: str, classes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": str(zoo.model_dir), "adapter_source": [str(zoo.adapters_dir)],
            "num_replicas": NUM_REPLICAS, "num_cpus": 1, "max_loras": 8, "max_lora_rank": 32,
            "max_num_seqs": MAX_NUM_SEQS, "sla_classes": classes, "less_urgent_prefill_chunk": 32,
            **MODE_CONFIG[mode]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def warm_up(session: Any, base: str) -> int:
    """Every adapter used, on both replicas (a few concurrent requests per adapter). A refused request
    (429, see the reading in docs/benchmarks.md) is sent again after a pause; returns how many were."""
    reqs = [Req("standard", a, "the river runs past a quiet town", 4) for a in ADAPTERS for _ in (0, 1)]
    refused = 0
    for k in range(0, len(reqs), SLOTS):
        todo = reqs[k:k + SLOTS]
        for _ in range(5):
            outs = [Outcome(r) for r in todo]
            await asyncio.wait_for(asyncio.gather(*(stream_one(session, base, o) for o in outs)),
                                   HTTP_TIMEOUT_S)
            bad = [o for o in outs if not o.completed]
            if any(not o.refused for o in bad):
                raise RuntimeError(f"warm-up failed on {base}: {bad[0]}")
            refused += len(bad)
            todo = [o.req for o in bad]
            if not todo:
                break
            await asyncio.sleep(1.0)
        if todo:
            raise RuntimeError(f"warm-up on {base}: still refused after 5 tries")
    return refused


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
                    "HAProxy, `THROUGHPUT_MODE_ENV` of serve/serve_mode.py) instead of its HTTP proxy")
    args = ap.parse_args()
    unknown = set(args.modes) - set(MODE_CONFIG)
    if unknown or ("fast" in args.phases and not {"on", "off"} <= set(args.modes)):
        ap.error(f"modes are {sorted(MODE_CONFIG)}; the fast phase needs on and off (unknown: {unknown})")
    if not args.rated and "off" not in args.modes and "sla" in args.phases:
        ap.error("the rated load is measured on `off`: include it or give --rated")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.serve_mode == "throughput":  # before Ray starts: its controller and replicas read them
        from lora_cluster.serve.serve_mode import private_throughput_mode

        with private_throughput_mode():
            return asyncio.run(run(args))
    return asyncio.run(run(args))


async def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.serve.app import build_app

    t_start = time.monotonic()
    meta: dict[str, Any] = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                            "load_start": load_avg(), "warmup_refused": {}, "code": code_version()}
    classes = [{"name": "interactive", "priority": 0, "ttft_s": args.interactive_ttft, "tpot_s": 0.2},
               {"name": "standard", "priority": 1, "ttft_s": args.standard_ttft, "tpot_s": 0.5},
               {"name": "batch", "priority": 2}]
    targets = {c["name"]: c.get("ttft_s") for c in classes}
    port = free_port()
    ray.init(address="local", num_cpus=2 * NUM_REPLICAS * len(args.modes) + 2, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    runs: list[RunResult] = []
    slow = fast = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        root = f"http://127.0.0.1:{port}"
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
            print(f"[bench_sla] fast path p50 on {pick(sorted(lat['on']), 0.5):.4f} off "
                  f"{pick(sorted(lat['off']), 0.5):.4f}; counts {counts}; cpu {cpu}", flush=True)
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

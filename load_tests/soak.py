"""Soak test (not a pytest test): N minutes at the rated load against a running server, reporting the
Ray processes' RSS and open file descriptors and the request latency over time.

    RAY_AUTH_MODE=disabled .venv/bin/serve run serve_config.yaml &      # or any running server
    .venv/bin/python load_tests/soak.py --url http://127.0.0.1:8000 --minutes 10 --ray-root-pid $!

Rated load: unless `--qps` is given, the script first measures it. `--concurrency` closed-loop
clients for `--calibrate-s` seconds (each sends its next request when the last one is answered)
give the saturation rate: what the server completes at full capacity. Open-loop arrivals at that
rate are past the knee (a queue at utilisation 1 grows without bound, whatever the server), so the
rated QPS is the knee: Poisson arrivals at `--knee-fractions` of the saturation rate, lowest first,
`--knee-step-s` seconds each, and the rated QPS is the highest step that held: every answer a 200,
p99 latency within `--knee-p99-s`, and no upward latency trend over the step (the last third's
median at most `--knee-growth` times the first third's): a backlog that grows by a few requests a
second stays under any p99 bound for a short step but shows as that trend. A step that fails is run
once more before the search stops (`--knee-retries`): on a machine shared with other work one slow
minute would otherwise set the rating, and the soak itself is what shows whether the rate holds for
long. The lowest step, with a warning, when none held.
Then it sends requests open-loop at that rate (Poisson arrivals, fixed seed) for `--minutes`,
whatever the answers, with at most `--max-in-flight` outstanding (more are counted as `skipped`,
so a stuck server cannot grow the client without bound). Requests: `/v1/completions`,
`--max-tokens` tokens, adapters a0..a{N-1} with Zipf(1.1) popularity plus the base model, one in
four streamed, sent with aiohttp (`--client httpx` for httpx): on a machine whose cores the client
shares with the server, httpx's CPU per request grows with the requests in flight (2.6 ms at 8,
16.2 ms at 256; aiohttp 0.9-1.0 ms at any depth: docs/soak.md), so under httpx a backlog costs the
server the client's CPU and the load generator, not the server, sets where it drains.

Every `--interval-s` it prints one row: answers by status, latency p50/p99 of that interval, the RSS
and open fds summed over the Ray processes on this machine (by role: replicas, ingress, other Ray
processes), so that leaks show as drift, and the machine's CPU steal (the share of CPU time its
hypervisor gave to other guests, `CpuSteal`; the calibration and every knee step say it too): on a
shared VM a slow interval with a high steal is the host's, not the server's. After the last send
it waits for every answer and prints a last row for them (the last interval's, and those that came
after the end), then the whole run: requests sent and skipped, answers by status, the p99 over
every 200 and the worst interval's p99.
It must run on the server's machine to see the processes; `--ray-root-pid` restricts them to one
server's process tree.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import psutil

from lora_cluster.sim.popularity import ZipfSampler

PROMPT = "the river runs through the old town and"
Client = httpx.AsyncClient | aiohttp.ClientSession  # the load's HTTP client (`http_client`)


@dataclass
class Interval:
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


class CpuSteal:
    """The share of this machine's CPU time its hypervisor gave to other guests (`steal` of
    `psutil.cpu_times()`, over the sum of user, nice, system, idle, iowait, irq, softirq and steal)
    since the last call: on a shared VM the server gets less of its cores while it is high, so a slow
    interval is read together with it. None where there is no steal time (not Linux) or no reading."""

    FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

    def __init__(self, cpu_times: Callable[[], Any] = psutil.cpu_times) -> None:
        self.cpu_times = cpu_times
        self._last = self._read()

    def _read(self) -> tuple[float, float] | None:
        try:
            times = self.cpu_times()
        except OSError:  # psutil reads /proc/stat
            return None
        if not hasattr(times, "steal"):
            return None
        return times.steal, sum(getattr(times, name, 0.0) for name in self.FIELDS)

    def share_since_last(self) -> float | None:
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return (now[0] - last[0]) / (now[1] - last[1])


def steal_text(share: float | None) -> str:
    """A steal share as a whole percentage, "-" where there is none."""
    return "-" if share is None else f"{100 * share:.0f}"


def ray_processes(root_pid: int | None) -> dict[str, list[psutil.Process]]:
    """Ray processes by role (from their process titles, `ray::<actor class>`): the descendants of
    `root_pid` (the `serve run` process, which started Ray), else every Ray process on this machine."""
    roles: dict[str, list[psutil.Process]] = {"replicas": [], "ingress": [], "ray": []}
    procs = psutil.Process(root_pid).children(recursive=True) if root_pid else list(psutil.process_iter())
    for proc in procs:
        try:
            title = " ".join(proc.cmdline()) or proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "LoraReplica" in title:
            roles["replicas"].append(proc)
        elif "LoraIngress" in title:
            roles["ingress"].append(proc)
        elif title.startswith("ray::") or any(k in title for k in ("raylet", "gcs_server", "ray/_private",
                                                                     "dashboard", "ray.serve")):
            roles["ray"].append(proc)
    return roles


def resources(root_pid: int | None) -> dict[str, tuple[float, int, int]]:
    """role -> (RSS MiB, open fds, processes)."""
    out = {}
    for role, procs in ray_processes(root_pid).items():
        rss, fds, n = 0, 0, 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                n += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        out[role] = (rss / (1 << 20), fds, n)
    return out


def zipf_models(n: int, base: str, rng: random.Random) -> list[str]:
    """Model names of successive requests: adapters a0..a{n-1} by Zipf(1.1), and the base model as
    often as the most popular adapter (an extra weight of rank 0's 1.0, drawn as index n)."""
    names = [*(f"a{k}" for k in range(n)), base]
    return [names[i] for i in ZipfSampler(n, 1.1, extra_weights=[1.0]).draws(rng, 100_000)]


async def one(client: Client, model: str, stream: bool,
              max_tokens: int) -> tuple[str, float]:
    """One completion of `model` (streamed or not): (status or the client exception's name, seconds)."""
    body: dict = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                  "stream": stream}
    start = time.monotonic()
    if isinstance(client, aiohttp.ClientSession):
        try:
            async with client.post("/v1/completions", json=body) as r:
                async for _ in r.content:
                    pass
                return str(r.status), time.monotonic() - start
        except (TimeoutError, aiohttp.ClientError) as exc:
            return type(exc).__name__, time.monotonic() - start
    try:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
                status = r.status_code
        else:
            status = (await client.post("/v1/completions", json=body)).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.monotonic() - start
    return str(status), time.monotonic() - start


def http_client(library: str, url: str, connections: int,
                timeout_s: float) -> Client:
    """The load's HTTP client: `library` ("httpx" or "aiohttp") with at most `connections` open to
    `url` and `timeout_s` per request."""
    if library == "aiohttp":
        return aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=connections))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)


async def closed_loop(client: Client, models: list, clients: int,
                      seconds: float, max_tokens: int) -> tuple[Counter, list[float]]:
    """`clients` closed-loop clients (each sends its next request, not streamed, when its last one is
    answered) for `seconds`: the answers by status and the latencies of the 200s, both of the
    requests that ended within the `seconds`."""
    statuses: Counter = Counter()
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def worker(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            status, latency = await one(client, models[i % len(models)], False, max_tokens)
            if time.monotonic() < stop:
                statuses[status] += 1
                if status == "200":
                    latencies.append(latency)
            i += clients
    await asyncio.gather(*(worker(k) for k in range(clients)))
    return statuses, latencies


async def calibrate(client: Client, models: list,
                    args: argparse.Namespace) -> tuple[float, Counter]:
    """The closed-loop saturation rate (200s per second) and the answers by status."""
    statuses, _ = await closed_loop(client, models, args.concurrency, args.calibrate_s, args.max_tokens)
    return statuses["200"] / args.calibrate_s, statuses


async def rated_load(client: Client, models: list,
                     args: argparse.Namespace) -> tuple[float, list[str]]:
    """The rated QPS (`--qps`, else measured: saturation, then the knee) and the lines that say how.
    Exits with a clear message when the calibration gets no 200 (a server not ready, or refusing)."""
    if args.qps:
        return args.qps, []
    steal = CpuSteal()
    saturation, statuses = await calibrate(client, models, args)
    if saturation <= 0:
        raise SystemExit(f"calibration: no request was answered 200 in {args.calibrate_s:g} s "
                         f"(answers: {dict(statuses)}); is the server at {args.url} ready?")
    steps = [f"saturation ({args.concurrency} closed-loop clients): {saturation:.2f} req/s, "
             f"CPU steal {steal_text(steal.share_since_last())}%"]
    print(steps[-1], flush=True)
    qps, knee_lines = await knee(client, models, saturation, args)
    print("", flush=True)
    return qps, [*steps, *knee_lines, ""]


async def knee_step(client: Client, models: list, qps: float, first: int, rng: random.Random,
                    args: argparse.Namespace) -> tuple[int, Counter, list[float]]:
    """Poisson arrivals at `qps` for `--knee-step-s`, from request `first` on; (requests sent,
    answers by status, latencies of the 200s in send order). Beyond `--max-in-flight` outstanding a
    request is counted as `skipped` instead of sent."""
    statuses: Counter = Counter()
    outstanding = 0

    async def run(model: str, stream: bool) -> float | None:
        nonlocal outstanding
        status, latency = await one(client, model, stream, args.max_tokens)
        outstanding -= 1
        statuses[status] += 1
        return latency if status == "200" else None

    tasks, i, next_send = [], first, time.monotonic()
    end = next_send + args.knee_step_s
    while next_send < end:
        await asyncio.sleep(max(0.0, next_send - time.monotonic()))
        if outstanding >= args.max_in_flight:
            statuses["skipped"] += 1
        else:
            outstanding += 1
            tasks.append(asyncio.create_task(run(models[i % len(models)], i % 4 == 0)))
        i += 1
        next_send += rng.expovariate(qps)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return i - first, statuses, [r for r in results if isinstance(r, float)]


def step_verdict(sent: int, statuses: Counter, latencies: list[float], p99_bound_s: float,
                 growth: float) -> tuple[bool, str]:
    """Whether a knee step held, and why not. It holds when every request sent was answered 200,
    the p99 latency is within `p99_bound_s`, and latency did not trend up over the step: the median
    of the last third of the answers (in send order) is at most `growth` times the first third's
    (plus 50 ms of jitter). A backlog that grows by a few requests a second stays under any p99 bound
    for a short step, but it shows as that trend, and at a sustained rate it grows without bound."""
    if statuses["200"] != sent:
        return False, "not every request was answered 200"
    p99 = percentile(latencies, 99)
    if not p99 <= p99_bound_s:
        return False, f"p99 {1000 * p99:.0f} ms above {1000 * p99_bound_s:.0f} ms"
    third = len(latencies) // 3
    if third:
        head = statistics.median(latencies[:third])
        tail = statistics.median(latencies[-third:])
        if tail > growth * head + 0.05:
            return False, (f"latency grew over the step (median {1000 * head:.0f} -> {1000 * tail:.0f} ms): "
                           "a backlog builds")
    return True, ""


async def knee(client: Client, models: list, saturation: float,
               args: argparse.Namespace) -> tuple[float, list[str]]:
    """The highest step of `--knee-fractions` x `saturation` that held (`step_verdict`, see the
    module docstring), and one line per step tried."""
    rng = random.Random(args.seed + 1)
    fractions = sorted(float(f) for f in args.knee_fractions.split(","))
    rated, lines, first = None, [], 0
    for fraction in fractions:
        qps = fraction * saturation
        for attempt in range(1 + args.knee_retries):
            steal = CpuSteal()
            sent, statuses, latencies = await knee_step(client, models, qps, first, rng, args)
            first += sent
            ok, why = step_verdict(sent, statuses, latencies, args.knee_p99_s, args.knee_growth)
            lines.append(f"knee step: {qps:.2f} req/s ({fraction:.0%} of saturation"
                         f"{f', try {attempt + 1}' if attempt else ''}), {sent} sent, "
                         f"{dict(statuses)}, p99 {1000 * percentile(latencies, 99):.0f} ms, "
                         f"CPU steal {steal_text(steal.share_since_last())}%: "
                         f"{'within the knee' if ok else 'beyond the knee: ' + why}")
            print(lines[-1], flush=True)
            if ok:
                break
        if not ok:
            break
        rated = qps
    if rated is None:
        rated = fractions[0] * saturation
        lines.append(f"warning: no step held; soaking at the lowest, {rated:.2f} req/s")
        print(lines[-1], flush=True)
    return rated, lines


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def soak(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    models = zipf_models(args.adapters, args.base_model, rng)
    async with http_client(args.client, args.url, args.max_in_flight, args.timeout_s) as client:
        qps, steps = await rated_load(client, models, args)
        lines = [*steps, f"rated load: {qps:.2f} req/s ({'given' if args.qps else 'measured: the knee'}), "
                 f"{args.minutes:g} min, max_tokens {args.max_tokens}, {args.adapters} adapters (Zipf 1.1)",
                 "",
                 "| t (s) | sent | 200 | 429 | 503 | other | skipped | p50 ms | p99 ms | RSS replicas MiB | "
                 "RSS ingress MiB | RSS other Ray MiB | open fds (all Ray) | CPU steal % |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for line in lines[len(steps):]:  # the calibration's lines were printed as they came
            print(line, flush=True)
        current, in_flight, tasks, others = Interval(), 0, set(), Counter()
        total, everything, worst = Counter(), [], 0.0  # the whole soak, for its summary
        start, steal = time.monotonic(), CpuSteal()
        end = start + args.minutes * 60
        next_report, next_send, i, sent, skipped = start + args.interval_s, start, 0, 0, 0

        async def run(model: str, stream: bool) -> None:
            nonlocal in_flight
            status, latency = await one(client, model, stream, args.max_tokens)
            in_flight -= 1
            current.statuses[status] += 1
            if status == "200":
                current.latencies.append(latency)

        async def report(now: float) -> None:
            """One row for the answers since the last one; the counts start again."""
            nonlocal current, sent, skipped, worst
            res = await asyncio.to_thread(resources, args.ray_root_pid)
            s, p99 = current.statuses, percentile(current.latencies, 99)
            other = sum(v for k, v in s.items() if k not in ("200", "429", "503"))
            row = (f"| {now - start:.0f} | {sent} | {s['200']} | {s['429']} | {s['503']} | {other} "
                   f"| {skipped} "
                   f"| {1000 * percentile(current.latencies, 50):.0f} "
                   f"| {1000 * p99:.0f} "
                   f"| {res['replicas'][0]:.0f} | {res['ingress'][0]:.0f} | {res['ray'][0]:.0f} "
                   f"| {sum(r[1] for r in res.values())} | {steal_text(steal.share_since_last())} |")
            print(row, flush=True)
            lines.append(row)
            others.update({k: v for k, v in s.items() if k not in ("200", "429", "503")})
            total.update(s)
            total["sent"] += sent
            total["skipped"] += skipped
            everything.extend(current.latencies)
            if current.latencies:
                worst = max(worst, p99)
            current, sent, skipped = Interval(), 0, 0

        while time.monotonic() < end:
            now = time.monotonic()
            while next_send <= now:
                if in_flight >= args.max_in_flight:
                    skipped += 1
                else:
                    in_flight += 1
                    sent += 1
                    task = asyncio.create_task(run(models[i % len(models)], i % 4 == 0))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                i += 1
                next_send += rng.expovariate(qps)
            if now >= next_report:
                await report(now)
                next_report += args.interval_s
            await asyncio.sleep(max(0.0, min(next_send, next_report, end) - time.monotonic()))
        await asyncio.gather(*tasks, return_exceptions=True)
        await report(time.monotonic())  # the last interval and the answers that came after the end
    tail = ["", f"whole run: {total['sent']} sent, {total['skipped']} skipped, "
                f"{dict((k, v) for k, v in total.items() if k not in ('sent', 'skipped'))}; "
                f"p99 {1000 * percentile(everything, 99):.0f} ms over every 200, "
                f"{1000 * worst:.0f} ms in the worst interval"]
    tail += [f"other answers (status or client exception: count): {dict(others) or 'none'}"]
    print("\n".join(tail), flush=True)
    return lines + tail


def non_negative(value: str) -> int:
    """An argparse type: a whole number >= 0."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value!r}")
    return int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--qps", type=float, default=None, help="rated load; default: measured first")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients of the calibration")
    p.add_argument("--calibrate-s", type=float, default=30.0)
    p.add_argument("--knee-fractions", default="0.5,0.6,0.7,0.8,0.9",
                   help="open-loop steps, as fractions of the closed-loop saturation rate (1.0, "
                        "utilisation 1, is past the knee by definition)")
    p.add_argument("--knee-step-s", type=float, default=60.0, help="seconds per knee step")
    p.add_argument("--knee-p99-s", type=float, default=2.0, help="p99 latency bound of the knee")
    p.add_argument("--knee-growth", type=float, default=1.5,
                   help="a step whose last third's median latency exceeds this times its first "
                        "third's (+50 ms) is past the knee: a backlog builds")
    p.add_argument("--knee-retries", type=non_negative, default=1,
                   help="times a failed knee step is run again before the search stops")
    p.add_argument("--interval-s", type=float, default=30.0)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--base-model", default="demo", help="the base model's name in the API")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client", choices=("httpx", "aiohttp"), default="aiohttp",
                   help="the HTTP client library of the load")
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--ray-root-pid", type=int, default=None,
                   help="count only the descendants of this process (e.g. `serve run`'s pid)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    lines = asyncio.run(soak(args))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

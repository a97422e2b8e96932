"""bench_sla's latency paths: the slow path (every slot full, one more request waits for a slot to
free: parked in the cluster queue with the controller, in Serve's queue without), the fast path (one
1-token request at a time, on and off alternating), the CPU time of each app's processes, and the
in-process cost of `ClusterAdmission`'s fast path."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from sla_client import HTTP_TIMEOUT_S, Outcome, get_json, post_json, stream_one, wait_idle
from sla_setup import MAX_NUM_SEQS, NUM_REPLICAS, SLOTS, uses_controller
from sla_workload import WORDS, Req, body


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

    from lora_cluster.cluster.routing_stats import RoutingStats
    from lora_cluster.serve.routing.admission import ClusterAdmission

    lock = threading.Lock()
    published = {f"r{k}": RoutingStats(max_num_seqs=MAX_NUM_SEQS, num_running=1, num_waiting=0)
                 for k in range(NUM_REPLICAS)}

    def stats() -> dict[str, RoutingStats]:  # as replica_tables.replica_stats: a copy under a lock
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

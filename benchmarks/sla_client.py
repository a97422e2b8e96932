"""bench_sla's HTTP client: one request streamed with its timings recorded as they come (`Outcome`,
filled in place, so that a cancelled request keeps what it got), the JSON calls to the admin API,
and waiting until an app is idle. No connection limit: a client-side pool would be a hidden queue
inside the measured TTFT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from sla_setup import SLOTS
from sla_workload import ADAPTERS, Req, body

IDLE_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 60.0


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


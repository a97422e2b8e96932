"""Usage metering's exactness under chaos, on a real Ray Serve app (issue 48's acceptance): two LoRA
replicas of two batch slots each (up to 8 requests each, so requests wait in the engines), no
cluster controller, `preempt_patience` 0 (a waiting `interactive` request preempts running `batch`
work at once), a routing-error breaker that trips only when every request fails, its own usage store
and spool in tmp folders, flushed every 5 s (the default: the killed replica still holds the records
of the requests it finished before the kill).

A seeded, bounded mix of requests runs 6 at a time: long `batch` streams first, then streams read to
the end, streams the client drops after a few chunks, unary requests, and unary requests the client
gives up on (a short read timeout), in both classes; one second in (or once one has ended a request,
within `ENDED_WAIT_S` more), one LoRA replica that has ended a request is killed with `ray.kill` (no
graceful stop). At the end every request sent is exactly one record in the store,
and each record's output tokens are what its client received: the final usage of a whole stream or
of a unary answer, the tokens of the chunks received before an error event (the ingress's `lost`
record of a stream whose replica died), none for a unary request its client gave up on, and for a
client that dropped its stream the tokens the ingress handed on before it learned of the close (the
ingress's `delivered` part; or, when the stream's last item went out before the close reached the
ingress, the replica's `completed` record of the whole stream): at least the chunks the client read,
at most `DROP_GAP_TOKENS` more (the chunks in flight to the client when it closed; docs/metering.md).
Some requests were preempted and resumed; the killed replica's finished requests are there (from its
spool, sent by another process on the node, unless it flushed them itself before the kill). The whole
test takes well under a minute once the app is up."""

from __future__ import annotations

import concurrent.futures
import json
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import poll

pytestmark = [pytest.mark.e2e]

PROMPT = "the quick brown fox"
REQUESTS = 24  # after the 4 long batch streams that fill the engines first
BOUND_S = 60.0  # every request and wait is bounded
KILL_AFTER_S = 1.0
ENDED_WAIT_S = 4.0  # past KILL_AFTER_S, for a replica to have ended a request (the victim is one)
# a dropped stream's record may hold this many tokens more than its client received: those in flight
# to it while its close travelled back (docs/metering.md); measured 0 to 7 over 8 runs (32 dropped
# streams) on a quiet machine, 17 once in CI's e2e tier on a loaded one (the close slower to travel)
DROP_GAP_TOKENS = 40


@pytest.fixture(scope="module")
def usage_paths(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("usage-chaos")
    return {"usage_db_path": str(folder / "usage.db"), "usage_spool_dir": str(folder / "spool")}


@pytest.fixture(scope="module")
def base_url(ray_app, demo_zoo, usage_paths):
    config = {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
        "num_replicas": 2, "num_cpus": 1, "controller": False, "max_loras": 4, "max_lora_rank": 32,
        "max_num_seqs": 2, "max_num_batched_tokens": 64, "max_ongoing_requests": 8,
        "routing_stats_period_s": 0.2, "preempt_patience": 0.0,
        # the routing-error breaker would shed the rest of the run once the kill's broken streams pass
        # 3% of the requests (its own behaviour: tests/engine/test_breaker.py); metering is under test
        "breaker_routing_trip": 1.0,
        "sla_classes": [{"name": "interactive", "priority": 0, "ttft_s": 2.0},
                        {"name": "batch", "priority": 2}],
        "default_priority_class": "batch", **usage_paths,
    }
    with ray_app(config, name="usage-chaos") as url:
        yield url


def lora_replica_actors() -> dict[str, Any]:
    """The live LoRA replica actors by replica id (what their usage records name)."""
    import ray

    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        parts = actor["name"].split("#")
        if len(parts) == 3 and "Replica" in parts[1] and "Ingress" not in parts[1]:
            found[parts[2]] = ray.get_actor(actor["name"], namespace=actor["namespace"])
    return found


def ended_some(usage_paths: dict[str, str], replicas: list[str]) -> list[str]:
    """The replicas that have ended a request (its record is in their spool or in the store), waiting
    up to `ENDED_WAIT_S` for one; all of them if none has (the kill's precondition then fails)."""
    deadline = time.monotonic() + ENDED_WAIT_S
    while True:
        found = [r for r in replicas if r in stored_replicas(usage_paths["usage_db_path"])
                 or spooled(Path(usage_paths["usage_spool_dir"]), r)]
        if found or time.monotonic() > deadline:
            return found or replicas
        time.sleep(0.05)


def stored_replicas(db: str) -> set[str]:
    try:
        return {r[3] for r in records(db).values()} if Path(db).exists() else set()
    except sqlite3.OperationalError:  # the store is creating its tables
        return set()


def spooled(spool: Path, replica: str) -> bool:
    """Whether the replica's spool holds a record (a file that moves meanwhile counts as none)."""
    for kind in ("open", "batch"):
        for path in spool.glob(f"{replica}-*/*.{kind}"):
            try:
                if path.stat().st_size:
                    return True
            except FileNotFoundError:
                continue
    return False


def stream(url: str, body: dict[str, Any], headers: dict[str, str], drop_after: int | None) -> dict[str, Any]:
    """A streamed completion: its id, the tokens its chunks carried (one logprob each), the final
    usage's count, and how it ended (`whole`, `dropped` by the client, `error` event). A client that
    drops the stream closes it once `drop_after` chunks came, after it counted every event of the
    bytes it had received by then (what reached it, read or not)."""
    got: dict[str, Any] = {"id": None, "received": 0, "usage": None, "end": "whole",
                           "asked": body["max_tokens"]}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "logprobs": 1,
                      "stream_options": {"include_usage": True}}, headers=headers, timeout=BOUND_S) as reply:
        if reply.status_code != 200:
            return {**got, "end": f"status {reply.status_code}"}
        chunks, pending = 0, ""
        for text in reply.iter_text():
            *events, pending = (pending + text).split("\n\n")
            for data in (e.removeprefix("data: ") for e in events if e.startswith("data: {")):
                chunks += read_event(json.loads(data), got)
            if drop_after is not None and chunks >= drop_after:
                got["end"] = "dropped"
                break
    return got


def read_event(chunk: dict[str, Any], got: dict[str, Any]) -> int:
    """Fold one SSE event into `got`; returns how many choice chunks it held."""
    if "error" in chunk:
        got["end"] = "error"
        return 0
    got["id"] = chunk["id"]
    if chunk.get("usage"):
        got["usage"] = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices") or []:
        got["received"] += len((choice.get("logprobs") or {}).get("tokens") or [])
    return len(chunk.get("choices") or [])


def unary(url: str, body: dict[str, Any], headers: dict[str, str], give_up_s: float | None) -> dict[str, Any]:
    try:
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                           timeout=httpx.Timeout(BOUND_S, read=give_up_s or BOUND_S))
    except httpx.ReadTimeout:
        return {"id": None, "received": 0, "usage": None, "end": "gave up"}
    if reply.status_code != 200:
        return {"id": None, "received": 0, "usage": None, "end": f"status {reply.status_code}: {reply.text}"}
    tokens = reply.json()["usage"]["completion_tokens"]
    return {"id": reply.json()["id"], "received": tokens, "usage": tokens, "end": "whole"}


def one_request(url: str, rng: random.Random, first: bool) -> Any:
    """A callable for the pool: the long batch streams first, then a random kind of request."""
    body = {"model": f"a{rng.randrange(4)}", "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
            "max_tokens": 160 if first else rng.choice([12, 48, 120])}
    headers = {"x-lora-priority": "batch" if first else rng.choice(["interactive", "batch"])}
    if first:
        return lambda: stream(url, body, headers, None)
    kind = rng.choice(["stream", "stream", "drop", "unary", "give up"])
    if kind == "stream":
        return lambda: stream(url, body, headers, None)
    if kind == "drop":
        return lambda: stream(url, body, headers, rng.randint(1, 3))
    if kind == "unary":
        return lambda: unary(url, body, headers, None)
    body["max_tokens"] = 400  # long enough that the client's 0.3 s read timeout always comes first
    return lambda: unary(url, body, headers, 0.3)


def records(db: str) -> dict[str, tuple[int, str, int, str, int]]:
    """request id -> (output tokens, outcome, preempted, replica, delivered) of every record in the store."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT request_id, output_tokens, outcome, preempted, replica, delivered "
                            "FROM usage_requests")
        return {row[0]: row[1:] for row in rows}


def test_chaos_ends_with_one_record_per_request_and_the_tokens_the_clients_received(base_url, usage_paths):
    import ray

    rng = random.Random(48)
    calls = [one_request(base_url, rng, first=i < 4) for i in range(4 + REQUESTS)]
    assert len(lora_replica_actors()) == 2, "precondition: two LoRA replicas run"
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call) for call in calls]
        time.sleep(KILL_AFTER_S)
        victim = rng.choice(ended_some(usage_paths, sorted(lora_replica_actors())))
        ray.kill(lora_replica_actors()[victim], no_restart=True)
        results = [f.result(timeout=BOUND_S) for f in futures]
    took = time.monotonic() - started
    ends = [r["end"] for r in results]
    assert all(end in ("whole", "dropped", "error", "gave up") for end in ends), \
        f"every request is served, dropped by its client, or ended by the replica's loss: {ends}"
    assert "dropped" in ends and "gave up" in ends, f"precondition: clients went away: {ends}"

    db = usage_paths["usage_db_path"]
    poll(lambda: len(records(db)) >= len(calls), BOUND_S, interval_s=0.2)
    time.sleep(1.0)  # a second record of a request would land within a few flushes
    stored = records(db)
    unrecorded = [(r["end"], r["id"]) for r in results if r["id"] and f"{r['id']}-0" not in stored]
    assert len(stored) == len(calls), \
        f"exactly one record per request sent ({len(calls)}), whatever happened to it: {len(stored)}; " \
        f"ends {sorted(ends)}; outcomes {sorted(r[1] for r in stored.values())}; clients' ids without " \
        f"a record {unrecorded}"
    gaps = []  # a dropped stream's tokens sent past those its client read before it closed
    ended_before_close = 0  # dropped streams whose last item went out before the ingress learned of the close
    for result in results:
        if result["id"] is None:
            continue  # a unary request its client gave up on: counted in the total above and below
        record = stored.get(f"{result['id']}-0")  # the request's one choice (job `<id>-0`)
        assert record is not None, f"{result['id']}: its record ({result['end']})"
        tokens, outcome, _, _, delivered = record
        rid, end, received = result["id"], result["end"], result["received"]
        if end == "dropped":
            gaps.append(tokens - received)
            assert received <= tokens <= received + DROP_GAP_TOKENS, \
                f"{rid}: what its client received ({received}), but for the tokens in flight: {record}"
            # its final item may have gone out before the close reached the ingress: then the stream ended
            # (every token asked, ignore_eos) and the replica's record is its account, with no delivered part
            ended_first = (outcome, delivered, tokens) == ("completed", 0, result["asked"])
            ended_before_close += ended_first
            assert (outcome, delivered) == ("cancelled", 1) or ended_first, \
                f"{rid}: the ingress's delivered part, or the whole stream sent before the close: {record}"
        else:
            assert tokens == received, f"{rid} ({end}): the tokens its client received, {received}: {record}"
        if end == "error":
            assert outcome == "lost", f"{rid}: the ingress's record of a lost replica's stream: {record}"
    gave_up = ends.count("gave up")
    nothing = [r for r in stored.values() if r[1] == "cancelled" and r[4] and r[0] == 0]
    assert len(nothing) >= gave_up, \
        f"each unary request given up before its answer is a delivered record of no tokens: {gave_up} " \
        f"given up, {len(nothing)} such records"
    assert any(r[2] for r in stored.values()), "some requests were preempted and resumed"
    assert any(r[3] == victim and r[1] != "lost" for r in stored.values()), \
        f"the killed replica's own records are there (those of the requests it ended before the kill): " \
        f"victim {victim}, (replica, outcome, tokens, delivered) " \
        f"{sorted((r[3], r[1], r[0], r[4]) for r in stored.values())}"
    with sqlite3.connect(db) as conn:
        summed = conn.execute("SELECT SUM(requests), SUM(output_tokens) FROM usage_minutes").fetchone()
    assert summed == (len(stored), sum(r[0] for r in stored.values())), \
        f"the per-minute sums equal the records: {summed}"
    print(f"\nUSAGE CHAOS: {len(calls)} requests in {took:.1f} s, ends {sorted(set(ends))}, "
          f"{ends.count('error')} streams lost with the replica, "
          f"{sum(1 for r in stored.values() if r[1] == 'lost')} lost records, "
          f"{sum(1 for r in stored.values() if r[2])} preempted, "
          f"{sum(1 for r in stored.values() if r[3] == victim and r[1] != 'lost')} of the killed replica, "
          f"{gave_up} given up, dropped streams' tokens past what their clients read {sorted(gaps)} "
          f"({ended_before_close} sent whole before the close reached the ingress)")

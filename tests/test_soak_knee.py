"""load_tests/soak.py's knee search: a step holds only when every answer is a 200, the p99 is within
its bound, and latency did not trend up over the step. A short step at a rate just past the
server's sustained rate stays under the p99 bound while its backlog grows (docs/soak.md, seventh
run: a 30 s step at 44 req/s held, the same rate sustained reached a 21 s p99)."""

from __future__ import annotations

import http.server
import threading
from collections import Counter

import httpx
import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def soak():
    yield from script_module("load_tests/soak.py", "soak_script")


def test_a_flat_step_within_the_bound_holds(soak) -> None:
    latencies = [0.10 + 0.02 * (k % 5) for k in range(300)]
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert ok, f"flat latencies, all 200, p99 140 ms: the step holds ({why})"


def test_a_growing_backlog_under_the_p99_bound_is_past_the_knee(soak) -> None:
    latencies = [0.10 + 0.004 * k for k in range(300)]  # 0.1 s -> 1.3 s: a backlog builds
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert not ok, "latency that climbs steadily over the step is a backlog, though p99 < 2 s"
    assert "grew" in why, f"the verdict says the latency grew: {why!r}"


def test_a_p99_above_the_bound_is_past_the_knee(soak) -> None:
    latencies = [0.1] * 290 + [3.0] * 10
    ok, why = soak.step_verdict(300, Counter({"200": 300}), latencies, 2.0, 1.5)
    assert not ok and "p99" in why, f"a 3 s tail is above the 2 s bound: {why!r}"


def test_a_step_with_an_answer_other_than_200_is_past_the_knee(soak) -> None:
    ok, why = soak.step_verdict(300, Counter({"200": 299, "skipped": 1}), [0.1] * 299, 2.0, 1.5)
    assert not ok and "200" in why, f"a skipped request fails the step: {why!r}"


class NotReady(http.server.BaseHTTPRequestHandler):
    """A server that answers every completion 503, as the ingress does before its replicas are up."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


async def test_a_calibration_without_a_200_stops_with_the_answers_it_got(soak) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotReady)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = soak.parser().parse_args(["--url", url, "--calibrate-s", "0.3", "--concurrency", "2"])
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            with pytest.raises(SystemExit) as stopped:
                await soak.rated_load(client, ["a0", "demo"], args)
    finally:
        server.shutdown()
        server.server_close()
    message = str(stopped.value)
    assert "no request was answered 200" in message and "'503'" in message, \
        f"the calibration says it got no 200 and what it got instead: {message!r}"


def scripted_steps(soak, monkeypatch, p99s: list[float]) -> list[float]:
    """Replace the knee's open-loop step by one whose k-th run answers every request 200 with a flat
    latency of `p99s[k]` seconds; returns the rates the search asked for, in order."""
    asked: list[float] = []

    async def step(_client, _models, qps, _first, _rng, _args):
        latency = p99s[len(asked)]
        asked.append(qps)
        return 100, Counter({"200": 100}), [latency] * 100

    monkeypatch.setattr(soak, "knee_step", step)
    return asked


async def test_a_step_that_fails_once_and_then_holds_counts_as_held(soak, monkeypatch) -> None:
    asked = scripted_steps(soak, monkeypatch, [0.2, 3.0, 0.2, 0.2, 0.2, 0.2])
    args = soak.parser().parse_args(["--knee-fractions", "0.5,0.6,0.7"])
    rated, lines = await soak.knee(None, ["a0"], 10.0, args)
    assert asked == [5.0, 6.0, 6.0, 7.0], f"the 60% step is run again after one slow try: {asked}"
    assert rated == 7.0, f"the highest step held on some try is the rating: {rated} ({lines})"
    assert "try 2" in lines[2], f"the second try is labelled: {lines[2]!r}"


async def test_a_step_that_fails_on_every_try_stops_the_search(soak, monkeypatch) -> None:
    asked = scripted_steps(soak, monkeypatch, [0.2, 3.0, 3.0, 0.2])
    args = soak.parser().parse_args(["--knee-fractions", "0.5,0.6,0.7"])
    rated, _lines = await soak.knee(None, ["a0"], 10.0, args)
    assert asked == [5.0, 6.0, 6.0], f"two failed tries of 60% end the search: {asked}"
    assert rated == 5.0, f"the rating is the last step that held: {rated}"


async def test_no_retry_when_retries_are_zero(soak, monkeypatch) -> None:
    asked = scripted_steps(soak, monkeypatch, [3.0, 0.2])
    args = soak.parser().parse_args(["--knee-fractions", "0.5,0.6", "--knee-retries", "0"])
    rated, lines = await soak.knee(None, ["a0"], 10.0, args)
    assert asked == [5.0], f"with --knee-retries 0 one failed try ends the search: {asked}"
    assert rated == 5.0 and "warning" in lines[-1], f"no step held: the lowest, with a warning: {lines}"

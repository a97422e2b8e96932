"""load_tests/soak.py's verdict (issue 42): the soak at 0.7x of the run's own saturation passes only
when every soak request is answered 200, the p99 over the intervals with CPU steal <= 10% is within
max(2 s, 3x the run's p99 at 0.2x saturation), RSS and open fds are flat (the least-squares line over
the rows grows by at most 5% of the start, 10 fds at least), and the overload phase answered only
200 or 429 with Retry-After. Pure functions on made-up figures: no Ray, no server (but the last two
tests, which use a tiny local HTTP server)."""

from __future__ import annotations

import http.server
import math
import socket
import threading

import aiohttp
import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def soak():
    yield from script_module("load_tests/soak.py", "soak_script")


def tally(soak, latencies: list[float], **others: int):
    """A tally whose every sent request was answered: 200s with `latencies`, plus `others` by status."""
    t = soak.Tally(sent=len(latencies) + sum(others.values()))
    for latency in latencies:
        t.record("200", latency, False)
    for status, count in others.items():
        for _ in range(count):
            t.record(status.removeprefix("s"), 0.01, True)
    return t


def rows(soak, n: int = 20, latency: float = 0.3, rss: float = 450.0, rss_per_row: float = 0.0,
         fds: int = 1000, fds_per_row: int = 0, steal: float | None = 0.0) -> list:
    """`n` 30 s soak rows, 100 answers 200 each at `latency`, every role's RSS at `rss` MiB growing by
    `rss_per_row` a row, and `fds` growing by `fds_per_row`."""
    return [soak.Row(30.0 * (k + 1), tally(soak, [latency] * 100),
                     dict.fromkeys(soak.ROLES, rss + k * rss_per_row), fds + k * fds_per_row, steal)
            for k in range(n)]


def judge(soak, soak_rows: list, p99_low: float = 0.2, overload=None):
    overload = overload if overload is not None else tally(soak, [1.0] * 50, s429=10)
    return soak.verdict(soak_rows, p99_low, overload, soak.Policy())


def test_a_steady_soak_passes(soak) -> None:
    result = judge(soak, rows(soak))
    assert result.passed, f"all 200, p99 300 ms under a 2 s bound, flat, a clean overload: {result.lines}"


def test_the_verdict_block_says_pass_first(soak) -> None:
    result = judge(soak, rows(soak))
    assert result.lines[0] == "verdict: PASS", f"the block opens with the verdict: {result.lines[0]!r}"


def test_the_p99_bound_is_the_floor_when_the_low_phase_is_fast(soak) -> None:
    bound = soak.p99_bound(0.3, soak.Policy())
    assert bound == 2.0, f"3 x 300 ms is under 2 s: the bound is 2 s, got {bound}"


def test_the_p99_bound_is_three_times_a_slow_low_phase(soak) -> None:
    bound = soak.p99_bound(1.0, soak.Policy())
    assert bound == 3.0, f"3 x 1 s is over 2 s: the bound is 3 s, got {bound}"


def test_the_p99_bound_is_the_floor_without_a_low_p99(soak) -> None:
    bound = soak.p99_bound(math.nan, soak.Policy())
    assert bound == 2.0, f"a low phase without a 200 leaves the floor: {bound}"


def test_a_p99_above_the_bound_fails(soak) -> None:
    result = judge(soak, rows(soak, latency=2.5))
    assert not result.passed, f"a 2.5 s p99 against a 2 s bound fails: {result.lines}"


def test_a_p99_within_three_times_a_slow_low_phase_passes(soak) -> None:
    result = judge(soak, rows(soak, latency=2.5), p99_low=1.0)
    assert result.passed, f"2.5 s is within 3 x a 1 s p99_low: {result.lines}"


def test_a_skipped_request_fails(soak) -> None:
    soak_rows = rows(soak)
    soak_rows[3].tally.skipped = 1
    result = judge(soak, soak_rows)
    assert not result.passed, \
        f"a request the client could not send (in-flight bound) is a failure: {result.lines}"


def test_an_answer_other_than_200_fails(soak) -> None:
    soak_rows = rows(soak)
    soak_rows[5].tally = tally(soak, [0.3] * 99, s503=1)
    result = judge(soak, soak_rows)
    assert not result.passed, f"one 503 in the soak fails it: {result.lines}"


def test_a_slow_interval_with_high_steal_is_left_out_of_the_p99(soak) -> None:
    soak_rows = rows(soak)
    soak_rows[7] = rows(soak, n=1, latency=9.0, steal=0.25)[0]
    result = judge(soak, soak_rows)
    assert result.passed, f"9 s answers in an interval with 25% steal are the host's: {result.lines}"


def test_the_excluded_intervals_are_listed_and_counted(soak) -> None:
    soak_rows = rows(soak)
    soak_rows[7] = soak.Row(240.0, tally(soak, [9.0] * 100), soak_rows[7].rss, 1000, 0.25)
    p99_line = judge(soak, soak_rows).lines[2]
    assert "19 of 20 intervals" in p99_line and ": 1: t=240 s (25%)" in p99_line, \
        f"the p99 line says how many intervals it used and which one it left out: {p99_line!r}"


def test_a_slow_interval_with_steal_at_the_limit_counts(soak) -> None:
    soak_rows = rows(soak)
    soak_rows[7] = rows(soak, n=1, latency=9.0, steal=0.10)[0]
    result = judge(soak, soak_rows)
    assert not result.passed, f"steal of exactly 10% is not over 10%: the 9 s interval counts: {result.lines}"


def test_an_interval_without_a_steal_reading_counts(soak) -> None:
    kept, excluded = soak.steal_split(rows(soak, n=3, steal=None), 0.10)
    assert (len(kept), len(excluded)) == (3, 0), "no steal reading (not Linux): nothing is left out"


def test_the_slope_is_per_minute(soak) -> None:
    slope = soak.slope_per_minute([30.0, 60.0, 90.0, 120.0], [100.0, 101.0, 102.0, 103.0])
    assert slope == pytest.approx(2.0), f"1 MiB every 30 s is 2 MiB per minute: {slope}"


def test_the_slope_of_one_row_is_nan(soak) -> None:
    slope = soak.slope_per_minute([30.0], [100.0])
    assert math.isnan(slope), f"one point has no slope: {slope}"


def test_a_growing_rss_fails(soak) -> None:
    result = judge(soak, rows(soak, rss_per_row=2.0))  # +38 MiB of 450 over the soak: 8.4%
    assert not result.passed, f"RSS growing 8% over the soak is not flat: {result.lines}"


def test_rss_growth_under_five_percent_is_flat(soak) -> None:
    result = judge(soak, rows(soak, rss_per_row=1.0))  # +19 MiB of 450: 4.2%
    assert result.passed, f"RSS growing 4% over the soak is flat: {result.lines}"


def test_rss_is_judged_per_role(soak) -> None:
    soak_rows = rows(soak)
    for k, row in enumerate(soak_rows):
        row.rss = {"replicas": 450.0, "ingress": 450.0 + 2.0 * k, "ray": 1900.0}
    result = judge(soak, soak_rows)
    assert not result.passed, f"an ingress growing 8% fails though the sum grows 1.3%: {result.lines}"


def test_a_falling_rss_is_flat(soak) -> None:
    result = judge(soak, rows(soak, rss_per_row=-3.0))
    assert result.passed, f"memory given back is no leak: {result.lines}"


def test_a_few_fds_more_are_flat(soak) -> None:
    result = judge(soak, rows(soak, fds=100, fds_per_row=0.5))  # +9.5 fds of 100
    assert result.passed, f"under 10 fds more is flat even above 5% of a small start: {result.lines}"


def test_growing_fds_fail(soak) -> None:
    result = judge(soak, rows(soak, fds_per_row=3))  # +57 fds of 1,000
    assert not result.passed, f"fds growing 5.7% over the soak are not flat: {result.lines}"


def test_a_soak_of_one_row_is_not_flat(soak) -> None:
    result = judge(soak, rows(soak, n=1))
    assert not result.passed, f"one row gives no slope: the soak is too short to judge: {result.lines}"


def test_a_429_without_retry_after_in_the_overload_fails(soak) -> None:
    overload = tally(soak, [1.0] * 50)
    overload.record("429", 0.01, False)
    result = judge(soak, rows(soak), overload=overload)
    assert not result.passed, f"a 429 without Retry-After in the overload fails: {result.lines}"


def test_a_503_in_the_overload_fails(soak) -> None:
    result = judge(soak, rows(soak), overload=tally(soak, [1.0] * 50, s503=1))
    assert not result.passed, f"the overload may answer only 200 or 429: {result.lines}"


def test_skipped_requests_in_the_overload_are_no_answer(soak) -> None:
    overload = tally(soak, [1.0] * 50, s429=10)
    overload.skipped = 40
    assert soak.overload_ok(overload), "requests the client never sent are not the server's answers"


class Answers(http.server.BaseHTTPRequestHandler):
    """A server answering completions with the class's `status`, with Retry-After when `retry_after`."""

    status, retry_after = 503, False

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(self.status)
        if self.retry_after:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


class Server:
    """`handler` on 127.0.0.1 in a thread, for a `with` block; `url` is its address."""

    def __init__(self, handler: type) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Server:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_a_calibration_without_a_200_stops_with_the_answers_it_got(soak) -> None:
    with Server(Answers) as server:
        argv = ["--url", server.url, "--calibrate-s", "0.3", "--concurrency", "2"]
        with pytest.raises(SystemExit) as stopped:
            await soak.phases(soak.parser().parse_args(argv), soak.Log())
    message = str(stopped.value)
    assert "no request was answered 200" in message and "'503'" in message, \
        f"the calibration says it got no 200 and what it got instead: {message!r}"


class Refusing429(Answers):
    status, retry_after = 429, True


class Bare429(Answers):
    status, retry_after = 429, False


@pytest.mark.parametrize(("handler", "with_header"), [(Refusing429, True), (Bare429, False)])
async def test_an_open_phase_counts_the_429s_without_retry_after(soak, handler, with_header) -> None:
    args = soak.parser().parse_args([])
    with Server(handler) as server:
        async with aiohttp.ClientSession(base_url=server.url) as client:
            loop = soak.OpenLoop(client, ["a0"], 200.0, soak.random.Random(0), iter(range(1000)), args)
            await loop.run_until(soak.time.monotonic() + 0.1)
            await loop.drain()
    refused = loop.tally.statuses["429"]
    expected = 0 if with_header else refused
    assert refused > 0 and loop.tally.bare_429 == expected, \
        f"{handler.__name__}: {expected} of {refused} 429s counted without Retry-After: {loop.tally.bare_429}"


def test_fds_that_follow_the_loads_connections_are_flat(soak) -> None:
    soak_rows = rows(soak, fds_per_row=10)  # +190 fds over the soak, 19% of the start
    for k, row in enumerate(soak_rows):
        row.conns = 100 + 10 * k  # the client's connections grew by as many
    result = judge(soak, soak_rows)
    assert result.passed, f"fds held by the load's own connections are not the server's leak: {result.lines}"


def test_fds_beyond_the_loads_connections_fail(soak) -> None:
    soak_rows = rows(soak, fds_per_row=10)
    for row in soak_rows:
        row.conns = 100  # the client's connections stayed as they were
    result = judge(soak, soak_rows)
    assert not result.passed, f"fds growing while the connections do not are not flat: {result.lines}"


def test_the_fds_cell_gives_the_loads_connections(soak) -> None:
    row = rows(soak, n=1)[0]
    row.conns = 42
    assert "| 1000 (42) |" in row.text(), f"the fds cell shows the load's connections: {row.text()!r}"


def test_the_load_counts_its_connections_to_the_server(soak) -> None:
    with Server(Answers) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port)):
            counted = soak.client_connections(port)
    assert counted == 2, f"two connections open to the server, counted: {counted}"

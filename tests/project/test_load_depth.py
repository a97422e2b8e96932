"""load_tests/depth.py against a real HTTP server on 127.0.0.1 (a stand-in that answers every
completion 200 after a short pause): each depth's row counts the 200s a second and the CPU each role
spent per request, this client's included."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import free_tcp_port, script_module


@pytest.fixture(scope="module")
def soak():
    yield from script_module("load_tests/soak.py", "soak")  # depth.py imports it as `soak`


@pytest.fixture(scope="module")
def depth(soak):
    yield from script_module("load_tests/depth.py", "depth_script")


@pytest.fixture
def url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Completes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class Completes(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(0.01)
        body = json.dumps({"choices": [{"text": "ok"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
async def test_each_depth_gives_its_rate_and_the_cpu_per_request_of_every_role(depth, url,
                                                                               client: str) -> None:
    no_ray = str(os.getpid())  # no Ray process beneath it
    args = depth.parser().parse_args(["--url", url, "--depths", "1,4", "--seconds", "0.5",
                                      "--warmup-s", "0.1", "--client", client, "--ray-root-pid", no_ray])
    lines = await depth.depths(args)
    header, rows = lines[0], lines[2:]
    assert all(role in header for role in depth.ROLES), f"the header names every role: {header}"
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"], f"one row per depth, in order: {rows}"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0, f"the stand-in's 200s are counted: {row}"
        assert cells[3] == "none", f"no answer other than 200: {row}"
        assert float(cells[-1]) > 0, f"the client's own CPU per request is measured: {row}"


@pytest.mark.parametrize("library", ["httpx", "aiohttp"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_soak_sends_with_either_client_streamed_or_not(soak, url, library: str,
                                                                 stream: bool) -> None:
    async with soak.http_client(library, url, 4, 5.0) as client:
        status, seconds = await soak.one(client, "a0", stream, 4)
    assert status == "200", f"{library} (stream={stream}) gets the stand-in's 200: {status}"
    assert seconds > 0, "and times it"


async def test_a_refused_connection_is_an_answer_named_by_its_exception(soak) -> None:
    async with soak.http_client("aiohttp", f"http://127.0.0.1:{free_tcp_port()}", 1, 5.0) as client:
        status, _ = await soak.one(client, "a0", False, 4)
    assert status == "ClientConnectorError", f"no server there: the exception's name is the answer: {status}"


@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
async def test_the_soak_reports_every_answer_its_last_interval_included(soak, url, client: str) -> None:
    args = soak.parser().parse_args(["--url", url, "--qps", "40", "--minutes", "0.05", "--interval-s", "1",
                                     "--client", client, "--ray-root-pid", str(os.getpid())])
    lines = await soak.soak(args)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ") and line[2].isdigit()]
    sent, answered = sum(int(r[1]) for r in rows), sum(int(r[2]) for r in rows)
    assert len(rows) >= 3, f"a row a second, and one for the last interval: {rows}"
    assert float(rows[-1][0]) >= 3.0, f"the last row reaches the end of the 3 s run: {rows[-1]}"
    assert sent > 0 and answered == sent, f"every request sent is answered 200 in a row: {sent}, {answered}"
    summary = next(line for line in lines if line.startswith("whole run:"))
    assert f"{sent} sent" in summary and f"'200': {sent}" in summary, f"the summary counts them: {summary}"
    header = next(line for line in lines if line.startswith("| t (s)"))
    assert header.rstrip(" |").endswith("CPU steal %"), f"the last column is the CPU steal: {header}"
    assert all(len(r) == 14 for r in rows), f"every row has a value for each of the 14 columns: {rows}"


def _times(steal: float, others: float) -> SimpleNamespace:
    """What `psutil.cpu_times()` gives on Linux: seconds per kind of CPU time (here all but steal in user)."""
    return SimpleNamespace(user=others, nice=0.0, system=0.0, idle=0.0, iowait=0.0, irq=0.0, softirq=0.0,
                           steal=steal, guest=0.0, guest_nice=0.0)


def test_the_steal_share_is_the_hypervisors_ticks_over_all_since_the_last_reading(soak) -> None:
    # +300 stolen of +1000, then +0 of +1000, then no tick at all
    readings = iter([_times(steal=100, others=900), _times(steal=400, others=1600),
                     _times(steal=400, others=2600), _times(steal=400, others=2600)])
    steal = soak.CpuSteal(lambda: next(readings))
    assert steal.share_since_last() == pytest.approx(0.3), "300 of the 1,000 ticks since were stolen"
    assert steal.share_since_last() == 0.0, "each reading counts from the one before"
    assert steal.share_since_last() is None, "no tick since the last reading: no share"
    assert soak.steal_text(0.304) == "30" and soak.steal_text(None) == "-", "a percentage, or a dash"


def test_no_proc_stat_gives_no_steal_share(soak) -> None:
    def missing() -> None:
        raise FileNotFoundError("/proc/stat")
    assert soak.CpuSteal(missing).share_since_last() is None, "no /proc/stat: None"
    no_steal = SimpleNamespace(user=1.0, nice=2.0, system=3.0, idle=4.0)
    assert soak.CpuSteal(lambda: no_steal).share_since_last() is None, "no steal field: None"

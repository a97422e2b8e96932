"""load_tests/depth.py against a real HTTP server on 127.0.0.1 (a stand-in that answers every
completion 200 after a short pause): each depth's row counts the 200s a second and the CPU each role
spent per request, this client's included."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time

import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def depth():
    soak = script_module("load_tests/soak.py", "soak")  # depth.py imports it as `soak`
    next(soak)
    yield from script_module("load_tests/depth.py", "depth_script")
    next(soak, None)


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
async def test_each_depth_gives_its_rate_and_the_cpu_per_request_of_every_role(depth, client: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Completes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = depth.parser().parse_args(["--url", url, "--depths", "1,4", "--seconds", "0.5",
                                          "--warmup-s", "0.1", "--client", client,
                                          "--ray-root-pid", str(os.getpid())])  # no Ray beneath it
        lines = await depth.depths(args)
    finally:
        server.shutdown()
        server.server_close()
    header, rows = lines[0], lines[2:]
    assert all(role in header for role in depth.ROLES), f"the header names every role: {header}"
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"], f"one row per depth, in order: {rows}"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0, f"the stand-in's 200s are counted: {row}"
        assert cells[3] == "none", f"no answer other than 200: {row}"
        assert float(cells[-1]) > 0, f"the client's own CPU per request is measured: {row}"

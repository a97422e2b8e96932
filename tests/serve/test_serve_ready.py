"""The ready line and the "not reachable at its URL" warning (`lora_cluster.serve.ops.ready`): the policy
with a fake clock, the probe against real HTTP servers on free ports."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import FakeClock

from lora_cluster.serve.ops.ready import Probe, ReadyWatch, probe_address, probe_url

NOT_OURS = Probe(ready=False, ours=False, detail="server not reachable at http://127.0.0.1:8000: refused")
STARTING = Probe(ready=False, ours=True, detail="GET /health: HTTP 503: no LoRA replica is running")
READY = Probe(ready=True, ours=True, detail="ready")


def run_watch(probes: list[Probe], caplog: pytest.LogCaptureFixture, **kwargs: float) -> ReadyWatch:
    """Run a watch whose probe answers `probes` in turn (then the last one forever), 1 s apart."""
    clock, seen = FakeClock(0.0), iter(probes)
    last = [probes[-1]]

    def probe() -> Probe:
        last[0] = next(seen, last[0])
        return last[0]

    watch = ReadyWatch("http://127.0.0.1:8000", probe, lambda: "lora-cluster ready at http://127.0.0.1:8000",
                       period_s=1.0, clock=clock, sleep=clock.sleep, **kwargs)
    with caplog.at_level(logging.INFO, logger="lora_cluster.serve.ops.ready"):
        watch.run()
    return watch


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "lora_cluster.serve.ops.ready" and r.levelno == level]


def test_one_ready_line_once_health_is_green(caplog):
    watch = run_watch([STARTING, STARTING, READY], caplog, warn_after_s=1.0)
    assert watch.ready, "the watch saw the server ready"
    assert _messages(caplog, logging.INFO) == ["lora-cluster ready at http://127.0.0.1:8000"], (
        "exactly one ready line")
    assert _messages(caplog, logging.WARNING) == [], "no warning while it starts"


def test_a_url_where_lora_cluster_does_not_answer_gets_one_warning_naming_the_port_fix(caplog):
    watch = run_watch([NOT_OURS] * 50 + [READY], caplog, warn_after_s=30.0)
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1, f"one warning however long it lasts: {warnings}"
    assert "not reachable at http://127.0.0.1:8000 after 30 s" in warnings[0], f"it names the URL: {warnings}"
    assert "refused" in warnings[0], "and what the probe saw"
    assert "http_options" in warnings[0] and "serve_config.yaml" in warnings[0], (
        f"and how to change the port: {warnings}")
    assert watch.ready, "it keeps watching and sees the server once it comes up"
    assert len(_messages(caplog, logging.INFO)) == 1, "the ready line still comes"


def test_the_watch_gives_up_after_its_bound(caplog):
    watch = run_watch([NOT_OURS], caplog, warn_after_s=5.0, give_up_after_s=60.0)
    assert not watch.ready, "never ready"
    assert len(_messages(caplog, logging.WARNING)) == 1, "one warning, then it gives up silently"


def test_a_wildcard_host_is_probed_on_the_loopback():
    assert probe_address("http://0.0.0.0:8123") == "http://127.0.0.1:8123", "0.0.0.0 -> 127.0.0.1"
    assert probe_address("http://10.1.2.3:8000/x") == "http://10.1.2.3:8000/x", "a host is kept"


@contextlib.contextmanager
def _serving(status: int, body: bytes, content_type: str) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "body", "content_type", "ready", "ours"), [
    (200, b'{"status": "ok", "replicas": 1}', "application/json", True, True),
    (503, b'{"error": {"message": "no LoRA replica is running", "type": "service_unavailable", '
          b'"code": "no_replica"}}', "application/json", False, True),
    (404, b"<html>not found</html>", "text/html", False, False),
    (200, b"hello from another program", "text/plain", False, False),
])
def test_the_probe_tells_lora_cluster_from_another_program(status, body, content_type, ready, ours):
    with _serving(status, body, content_type) as url:
        seen = probe_url(url, timeout_s=5.0)
    assert (seen.ready, seen.ours) == (ready, ours), f"HTTP {status} {body[:30]!r}: {seen}"


def test_the_probe_of_a_closed_port_is_not_ours():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = probe_url(f"http://127.0.0.1:{port}", timeout_s=5.0)
    assert not seen.ready and not seen.ours, f"nothing listens: {seen}"
    assert "not reachable" in seen.detail, f"the detail says so: {seen.detail}"

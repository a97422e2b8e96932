"""Ray Serve's throughput-optimized mode without Ray (`serve/ops/serve_mode.py`): the environment it
sets, HAProxy's files kept private, and the environment restored after a private mode (the mode end
to end under `serve run`: test_serve_throughput_mode.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lora_cluster.serve.ops.serve_mode import private_throughput_mode, throughput_mode_env


def test_the_environment_of_the_mode_and_of_a_private_haproxy(tmp_path):
    want = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert throughput_mode_env() == want, "the mode is Serve's throughput switch plus HAProxy"
    private = Path("/tmp/hap-x")
    env = throughput_mode_env(private)
    paths = [env[k] for k in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                              "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE")]
    assert all(p.startswith(str(private)) for p in paths), f"HAProxy's files are private: {paths}"
    ports = {env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]}
    assert not ports & {"8404", "9101"}, f"HAProxy's side ports are not the machine-wide defaults: {ports}"
    with pytest.raises(ValueError, match="too long"):
        throughput_mode_env(tmp_path / "a-folder-whose-path-is-long")


def test_private_throughput_mode_restores_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    with private_throughput_mode() as folder:
        assert os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1", "the mode is on inside the block"
        socket_path = os.environ["RAY_SERVE_HAPROXY_SOCKET_PATH"]
        assert socket_path.startswith(str(folder)), "HAProxy's files are private"
        assert folder.is_dir(), "the private folder exists inside the block"
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ, "the environment is restored after it"
    assert not folder.exists(), "the private folder is removed after it"

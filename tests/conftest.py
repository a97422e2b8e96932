"""Shared test fixtures and fakes: the one place for them (add new ones here, keep each short)."""

from __future__ import annotations

import os
import shutil

# Triton kernels are tested on the CPU through Triton's interpreter when there is no GPU. The switch
# must be set before anything imports triton (transformers does, when the demo module imports it).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures
import contextlib
import hashlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lora_cluster.demo import DemoZoo, build_demo_zoo

# ----- the user's ~/.cache/lora-cluster is never written: default cache folders are temp folders -----

REAL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-cluster"
_CACHE_ENV = ("LORA_CLUSTER_DEMO_DIR", "LORA_CLUSTER_DISK_CACHE_DIR")  # would override the defaults


def cache_fingerprint(folder: Path, limit: int = 5000) -> tuple[tuple[str, int, int], ...]:
    """(path, mtime_ns, size) of `folder` and what lies below it (at most `limit` entries)."""
    entries = []
    for root, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            path = Path(root, name)
            with contextlib.suppress(OSError):
                st = path.lstat()
                entries.append((str(path), st.st_mtime_ns, st.st_size if name in files else 0))
            if len(entries) >= limit:
                return tuple(sorted(entries))
    return tuple(sorted(entries))


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_CACHE_HOME (from which the demo zoo's and the disk tier's default folders derive) is a temp
    folder for the whole session, Ray workers included (they inherit the environment)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    at_start = cache_fingerprint(REAL_CACHE)
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(cache))
    for name in _CACHE_ENV:
        patch.delenv(name, raising=False)
    yield cache
    patch.undo()
    if cache_fingerprint(REAL_CACHE) != at_start:  # e.g. a module fixture's teardown wrote there
        pytest.fail(f"the test session wrote into {REAL_CACHE}", pytrace=False)


@pytest.fixture(autouse=True)
def _real_cache_untouched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that wrote into the user's ~/.cache/lora-cluster."""
    before = cache_fingerprint(REAL_CACHE)
    yield
    after = cache_fingerprint(REAL_CACHE)
    if after != before:
        changed = sorted(set(after) ^ set(before))[:5]
        pytest.fail(f"{request.node.nodeid} wrote into {REAL_CACHE}: {changed}", pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function that returns a TCP port free on 127.0.0.1 now (for a Serve app or a test server)."""
    return _free_port


# ----- Ray Serve: one app per use, on a Ray of its own, the environment restored afterwards -----


@contextlib.contextmanager
def _ray_app(config: dict[str, Any], *, name: str = "lora", env: dict[str, str] | None = None,
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
            ray.init(address=cluster.address, configure_logging=False, log_to_driver=False, **workers)
        else:  # "local": a Ray of its own, even while another test's Ray runs on this machine
            ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False,
                     log_to_driver=False, **workers)
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(config), name=name, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()
        patch.undo()


@pytest.fixture(scope="session")
def ray_app() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with ray_app(config, name="lora", env=None, nodes=0) as url:` runs the application built from
    `config` on Ray Serve for the `with` block (see `_ray_app`). Use it in a module-scoped fixture so
    that a module's tests share one app:

        @pytest.fixture(scope="module")
        def base_url(ray_app, app_config):
            with ray_app(app_config) as url:
                yield url
    """
    return _ray_app


@pytest.fixture(scope="session")
def demo_zoo(tmp_path_factory: pytest.TempPathFactory) -> DemoZoo:
    """The tiny demo zoo (16 adapters a0..a15, seed 0), built once per test session. Treat as read-only."""
    return build_demo_zoo(tmp_path_factory.mktemp("demo") / "zoo", num_adapters=16, size="tiny", seed=0)


@pytest.fixture(scope="session")
def demo_model_dir(demo_zoo: DemoZoo) -> Path:
    """Folder of the tiny demo base model (config, safetensors, tokenizer)."""
    return demo_zoo.model_dir


@pytest.fixture(scope="session")
def demo_adapters_dir(demo_zoo: DemoZoo) -> Path:
    """Folder holding the demo adapters, one sub-folder per adapter id."""
    return demo_zoo.adapters_dir


# ----- engines and their PEFT reference -----


@pytest.fixture(scope="session")
def make_engine(demo_zoo: DemoZoo) -> Callable[..., Any]:
    """`make_engine(**overrides)`: an engine of the tiny demo base model that serves the demo adapters,
    built as callers build one (`build_engine`: wired to the adapter store of its config unless an
    `adapter_loader` is given); `overrides` are `build_engine`'s (any `EngineConfig` field,
    `adapter_loader`; `model` or `adapter_source` replace the demo's, `adapter_source=None` serves the
    base model alone). The one place that knows how a test builds an engine. The caller closes it."""
    from lora_cluster.engine import Engine, build_engine

    def make(**overrides: Any) -> Engine:
        demo = {"model": str(demo_zoo.model_dir), "adapter_source": str(demo_zoo.adapters_dir)}
        return build_engine(**{**demo, **overrides})

    return make


@pytest.fixture(scope="session")
def peft_model(demo_zoo: DemoZoo) -> Any:
    """Hugging Face PEFT's `PeftModel` over the demo base model (float32) with every demo adapter
    loaded under its id: the reference the engine is compared with (use `helpers.peft_logits`, which
    activates one adapter at a time)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = sorted((p.name for p in demo_zoo.adapters_dir.iterdir() if p.is_dir()), key=lambda a: int(a[1:]))
    base = AutoModelForCausalLM.from_pretrained(demo_zoo.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, demo_zoo.adapters_dir / ids[0], adapter_name=ids[0])
    for adapter_id in ids[1:]:
        model.load_adapter(demo_zoo.adapters_dir / adapter_id, adapter_name=adapter_id)
    return model.eval()


# ----- tenants -----


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    """A tenants file with `tenant_app.tenants_yaml()` (finance, hr and an admin key) in force."""
    from tenant_app import tenants_yaml

    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml())
    return path


# ----- adapter store: S3 (moto server), a failure-injecting TCP proxy, a pre-populated hub cache -----


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto's server mode) on 127.0.0.1, for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class TcpProxy:
    """A TCP proxy in front of a server that injects network failures: the next `cuts` connections whose
    response passes `cut_after` bytes are closed there, or, past `die_after` bytes of a response, the
    whole proxy goes away (listener closed: later connections are refused)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.cut_after, self.cuts, self.die_after = target, 64 << 10, 0, None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self.dead = False
        self.connections = 0  # connections accepted, over restarts
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.dead:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        sent = 0
        try:
            while data := src.recv(16 << 10):
                dst.sendall(data)
                sent += len(data)
                if response and self.die_after is not None and sent >= self.die_after:
                    return self.kill()
                if response and sent >= self.cut_after and self.cuts > 0:
                    self.cuts -= 1
                    break
        except OSError:
            pass
        self._close(src, dst)

    @staticmethod
    def _close(*sockets: socket.socket) -> None:
        for s in sockets:  # shutdown first: it wakes a thread blocked in recv and sends FIN at once
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def kill(self) -> None:
        """The server goes away: every connection is reset and new ones are refused."""
        self.dead = True
        self._close(self.listener, *self._sockets)

    def restart(self) -> None:
        """The server comes back on the same port (after `kill`), with no failure armed."""
        self.die_after, self.cuts = None, 0
        self._sockets = []
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.dead = False
        threading.Thread(target=self._accept, daemon=True).start()


@dataclass
class S3:
    """A fresh bucket on the moto server; the test environment points boto3 at `endpoint`."""

    endpoint: str
    bucket: str
    client: Any
    monkeypatch: pytest.MonkeyPatch

    def upload(self, folder: Path, prefix: str, metadata: dict[str, dict[str, str]] | None = None) -> None:
        """Upload every file of `folder` under `prefix/` (per-file user metadata optional)."""
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/{name}", Body=path.read_bytes(),
                                   Metadata=(metadata or {}).get(name, {}))

    def put(self, key: str, body: bytes, **metadata: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=metadata)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def point_at(self, endpoint: str) -> None:
        """Send boto3 clients created from now on to `endpoint` (e.g. a `TcpProxy`)."""
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A new empty bucket, dummy credentials and AWS_ENDPOINT_URL set for this test (botocore retries
    off: AWS_MAX_ATTEMPTS=1, so the store's own retries are what a test sees)."""
    import boto3

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint,
                        "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return S3(moto_endpoint, bucket, client, monkeypatch)


@pytest.fixture
def s3_proxy(moto_endpoint: str) -> Iterator[TcpProxy]:
    """A `TcpProxy` in front of the moto server (use `s3.point_at(proxy.endpoint)`)."""
    host, port = moto_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    yield proxy
    proxy.kill()


def populate_hf_cache(cache_dir: Path, repo_id: str, files: dict[str, bytes], revision: str = "main") -> Path:
    """Write a Hugging Face hub cache entry by hand (the hub is unreachable here), laid out as
    huggingface_hub writes it: blobs named by sha256, snapshot symlinks, refs/<revision>. Returns the
    snapshot folder."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repr(sorted(files)).encode() + revision.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


class FolderAsRemote:
    """A fake remote adapter source backed by a local folder (counts fetches): exercises the disk
    tier like S3 does, without a server."""

    remote = True

    def __init__(self, folder: Path, uri: str = "fake://zoo"):
        self.folder, self.uri, self.fetches = folder, uri, 0

    def locate(self, adapter_id: str, subpath: str) -> Any:
        from lora_cluster.store.sources.base import FileInfo, Located

        folder = self.folder / subpath
        if not folder.is_dir():
            return None
        return Located(subpath, {p.name: FileInfo(p.stat().st_size) for p in folder.iterdir()})

    def fetch(self, adapter_id: str, located: Any, dest: Path) -> dict[str, str]:
        from lora_cluster.store.checksum import sha256_file

        self.fetches += 1
        for name in located.files:
            (dest / name).write_bytes((self.folder / located.subpath / name).read_bytes())
        return {name: sha256_file(dest / name) for name in located.files}

    def adapters(self) -> list:
        return []

    def adapter_ids(self) -> list:
        return []



def adapter_hits(http: Any, adapters: list[str], prompt: str, rounds: int) -> list[str]:
    """Adapter affinity as a client sees it: one completion per adapter (each is placed once), a
    pause for the replicas' reports to reach the router, then `rounds` completions over `adapters`
    in a fixed interleaved order from 4 threads; returns each answer's `x-lora-adapter-hit` and
    `x-lora-replica` headers ("true r1"), in the order sent."""
    def complete(adapter: str) -> str:
        r = http.post("/v1/completions", json={"model": adapter, "prompt": prompt, "max_tokens": 4,
                                               "temperature": 0})
        assert r.status_code == 200, f"{adapter}: the completion succeeds: {r.text}"
        return r.headers["x-lora-adapter-hit"] + " " + r.headers["x-lora-replica"]

    for adapter in adapters:  # warm-up: every adapter is placed once
        complete(adapter)
    time.sleep(1.5)  # let the replicas' reports reach the router
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(complete, adapter_order(adapters, rounds)))


def adapter_order(adapters: list[str], rounds: int) -> list[str]:
    """The order in which `adapter_hits` sends its `rounds` completions."""
    n = len(adapters)
    return [adapters[(i * 5 + i // n) % n] for i in range(rounds)]

@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch intra-op thread for a module of tiny matmuls: more threads only add contention on a
    small shared machine. Use with `pytestmark = pytest.mark.usefixtures("torch_one_thread")`."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)

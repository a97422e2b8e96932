"""Shared test fixtures and fakes: the one place for them (add new ones here, keep each short)."""

from __future__ import annotations

import os
import shutil

# Triton kernels are tested on the CPU through Triton's interpreter when there is no GPU. The switch
# must be set before anything imports triton (transformers does, when the demo module imports it).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Releases are kept in memory unless a test gives release_state_uri: under the default (`auto`) the
# ingresses of the whole session would share one `.lora-cluster` document (in the session's demo zoo,
# or its disk tier folder), and one test's releases and loaded versions would come back in the next.
# Set before any test module builds a config at import. tests/releases/test_state_location.py tests `auto`.
os.environ["LORA_CLUSTER_RELEASE_STATE_URI"] = ""

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import shared_apps
from helpers import free_tcp_port
from ray_app import run_app, stop_kept_ray
from remote_sources import S3, TcpProxy

from lora_cluster.demo import DemoZoo, build_demo_zoo

pytest_plugins = ["tiers"]  # the unit, engine and e2e tiers (tests/tiers.py)

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
    folder for the whole session, Ray workers included (they inherit the environment), and every app's
    usage store (`usage_db_path`) a file in it. Torch's
    extension folder stays where it was (TORCH_EXTENSIONS_DIR pinned to it), so the C++ kernel built
    once is reused by later sessions. The user's ~/.cache/lora-cluster is compared once, at the end of
    the session (walking it per test took minutes on a machine that has used the product)."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    at_start = cache_fingerprint(REAL_CACHE)
    patch = pytest.MonkeyPatch()
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        real_xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        patch.setenv("TORCH_EXTENSIONS_DIR", str(real_xdg / "torch_extensions"))  # torch's own default
    patch.setenv("XDG_CACHE_HOME", str(cache))
    patch.setenv("LORA_CLUSTER_USAGE_DB_PATH", str(cache / "usage" / "usage.db"))  # every app's usage store
    patch.setenv("LORA_CLUSTER_USAGE_SPOOL_DIR", str(cache / "usage" / "spool"))  # and its records' spool
    for name in _CACHE_ENV:
        patch.delenv(name, raising=False)
    yield cache
    patch.undo()
    after = cache_fingerprint(REAL_CACHE)
    if after != at_start:  # a test, or a module fixture's teardown, wrote there
        changed = sorted(set(after) ^ set(at_start))[:5]
        pytest.fail(f"the test session wrote into {REAL_CACHE}: {changed}", pytrace=False)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function that returns a TCP port free on 127.0.0.1 now (for a Serve app or a test server)."""
    return free_tcp_port


# ----- Ray Serve: one app per use, on a Ray kept between apps, the environment restored after -----


SHARED_APP_FIXTURES = ("demo_app", "bases_app", "tenants_app")  # below: applications of several modules


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that start Ray Serve applications run last, those marked `own_ray` (not on the
    local Ray: `ray_app(..., env=...)` or `nodes=`) first among them, and the modules of one shared
    application (`SHARED_APP_FIXTURES`) one after the other; otherwise in the collected order. So the
    local Ray kept between applications (`ray_app.run_app`) starts once, each shared application is
    deployed once, and no other test runs beside them."""
    def module_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    rank: dict[str, int] = {}  # module -> 0: no application, 1: own_ray, 2: on the local Ray
    shared: dict[str, str] = {}  # module -> the shared application it uses
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "ray_app" in names:
            own = item.get_closest_marker("own_ray") is not None
            rank[module_of(item)] = max(rank.get(module_of(item), 0), 1 if own else 2)
        for name in SHARED_APP_FIXTURES:
            if name in names:
                shared.setdefault(module_of(item), name)
    position = {id(item): k for k, item in enumerate(items)}
    first: dict[str, int] = {}  # a shared application, or a module using none -> its first item's position
    for item in items:
        first.setdefault(shared.get(module_of(item), module_of(item)), position[id(item)])
    items.sort(key=lambda item: (rank.get(module_of(item), 0),
                                 first[shared.get(module_of(item), module_of(item))], position[id(item)]))


@pytest.fixture(scope="session")
def ray_app() -> Iterator[Callable[..., contextlib.AbstractContextManager[str]]]:
    """`with ray_app(config, name="lora", env=None, nodes=0) as url:` runs the application built from
    `config` on Ray Serve for the `with` block (see `ray_app.run_app`). Use it in a module-scoped fixture so
    that a module's tests share one app:

        @pytest.fixture(scope="module")
        def base_url(ray_app, app_config):
            with ray_app(app_config) as url:
                yield url
    """
    yield run_app
    stop_kept_ray()


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


# ----- the applications several end-to-end modules share (tests/shared_apps.py): one deploy each -----


@pytest.fixture(scope="module")
def demo_app(ray_app, demo_zoo: DemoZoo) -> Iterator[str]:
    """The URL of the demo app (`shared_apps.demo_config`, app name `lora`)."""
    with ray_app(shared_apps.demo_config(demo_zoo)) as url:
        yield url


@pytest.fixture(scope="session")
def bases_zoos(tmp_path_factory: pytest.TempPathFactory) -> shared_apps.Bases:
    """The several-bases app's checkpoints besides the demo zoo (`shared_apps.build_bases`), built once."""
    return shared_apps.build_bases(tmp_path_factory.mktemp("bases"))


@pytest.fixture(scope="module")
def bases_app(ray_app, demo_zoo: DemoZoo, bases_zoos: shared_apps.Bases) -> Iterator[str]:
    """The URL of the several-bases app (`shared_apps.bases_config`, app name `bases`)."""
    with ray_app(shared_apps.bases_config(demo_zoo, bases_zoos), name="bases") as url:
        yield url


@pytest.fixture(scope="session")
def shared_tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(shared_apps.tenants_yaml())
    return path


@pytest.fixture(scope="module")
def tenants_app(ray_app, demo_zoo: DemoZoo, shared_tenants_file: Path) -> Iterator[str]:
    """The URL of the app of several ingresses and a tenants file (`shared_apps.tenants_config`,
    app name `tenants`)."""
    with ray_app(shared_apps.tenants_config(demo_zoo, shared_tenants_file), name="tenants") as url:
        yield url


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


@pytest.fixture(scope="session")
def moto_serial_endpoint() -> Iterator[str]:
    """A moto server on 127.0.0.1 that answers one request at a time (HTTP/1.0: one connection per
    request), for tests of concurrent conditional writes. S3 checks a PUT's If-Match / If-None-Match
    and writes in one step; moto's threaded server checks, then writes, in each request's thread, so
    two writers over one ETag can both win there (and a concurrent PUT of one key can fail with a 500)."""
    import threading

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class OneRequestAtATime(MotoRequestHandler):
        protocol_version = "HTTP/1.0"

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), False,
                         request_handler=OneRequestAtATime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A new empty bucket, dummy credentials and AWS_ENDPOINT_URL set for this test (botocore retries
    off: AWS_MAX_ATTEMPTS=1, so the store's own retries are what a test sees)."""
    return _new_bucket(moto_endpoint, monkeypatch)


@pytest.fixture
def s3_serial(moto_serial_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """`s3` on `moto_serial_endpoint`: a conditional write is atomic, as on S3."""
    return _new_bucket(moto_serial_endpoint, monkeypatch)


def _new_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
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


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch intra-op thread for a module of tiny matmuls: more threads only add contention on a
    small shared machine. Use with `pytestmark = pytest.mark.usefixtures("torch_one_thread")`."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)

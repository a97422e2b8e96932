"""The package layering: every import points down, the pure layers load without torch or Ray, and the
ingress (request vocabulary, HTTP layer, request router, protocol) loads without torch.

`ALLOWED` is the architecture as a table: for each unit of `lora_cluster` (a top-level package or
module; inside `serve/` and `engine/`, each room and shared module), the units it may import. An
import of a unit not listed, at module level or inside a function, fails the test with the importing
file and line.
The table is acyclic, so the layers read bottom to top:

    compiled, errors, progress, s3_client | request, replica_policy |
    adapter_experts < adapter_format, breaker |
    config | cluster, tenancy, store, releases |
    engine: sample < schedule < adapters < model < engine's own modules (llm_engine, factory,
            async_engine) | sim | client, demo < demo_families |
    serve: http_errors, ops < protocol < routing < replica < http < app;
           batch_window, park_mailbox < controller_actor < app | cli
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lora_cluster"
SERVE_UNITS = ("http", "routing", "replica", "ops", "protocol", "http_errors", "app", "controller_actor",
               "batch_window", "park_mailbox")
ENGINE_ROOMS = ("sample", "schedule", "adapters", "model")  # bottom to top
ROOM_PACKAGES = {"serve": SERVE_UNITS, "engine": ENGINE_ROOMS}

BASE = {"errors", "progress", "s3_client"}
FORMAT = BASE | {"request", "replica_policy", "adapter_experts", "adapter_format", "breaker"}
CONFIG = FORMAT | {"config"}
POLICY = CONFIG | {"cluster", "tenancy", "store", "releases"}
ENGINE_BELOW = {room: CONFIG | {"store"} | {f"engine.{r}" for r in ENGINE_ROOMS[:i]}
                for i, room in enumerate(ENGINE_ROOMS)}
ENGINE = POLICY | {"engine", *(f"engine.{r}" for r in ENGINE_ROOMS)}
SERVE_BASE = ENGINE | {"client", "demo", "demo_families", "serve.http_errors", "serve.ops"}

ALLOWED: dict[str, set[str]] = {
    "lora_cluster": {"compiled"},  # __init__ installs the compiled-or-source switch, and imports nothing else
    "compiled": set(),
    "errors": set(),
    "progress": set(),
    "s3_client": set(),
    "request": {"errors"},
    "replica_policy": {"errors"},
    "adapter_experts": {"errors"},
    "adapter_format": {"errors", "adapter_experts", "request"},
    "breaker": {"errors"},
    "config": {"errors"},
    "cluster": {"errors", "config"},
    "tenancy": {"errors", "config", "s3_client"},
    "releases": {"errors", "config", "s3_client"},
    "store": CONFIG,
    **{f"engine.{room}": below for room, below in ENGINE_BELOW.items()},
    "engine": CONFIG | {"store"} | {f"engine.{r}" for r in ENGINE_ROOMS},
    "sim": POLICY | {"engine"},
    "client": BASE,
    "demo": BASE,
    "demo_families": BASE | {"demo"},
    "serve.http_errors": {"errors"},
    "serve.ops": ENGINE | {"client"},
    "serve.protocol": SERVE_BASE,
    "serve.routing": SERVE_BASE | {"serve.protocol"},
    "serve.replica": SERVE_BASE | {"serve.protocol", "serve.routing"},
    "serve.http": SERVE_BASE | {"serve.protocol", "serve.routing", "serve.replica"},
    "serve.batch_window": POLICY,
    "serve.park_mailbox": set(),
    "serve.controller_actor": POLICY | {"serve.batch_window", "serve.park_mailbox"},
    "serve.app": SERVE_BASE | {"serve.protocol", "serve.routing", "serve.replica", "serve.http",
                               "serve.controller_actor"},
    "serve": set(),  # serve/__init__.py imports nothing
    "cli": SERVE_BASE | {"lora_cluster"},
}


def unit(module: str) -> str:
    """The layering unit of a dotted module name under lora_cluster."""
    parts = module.split(".")[1:]
    if not parts:
        return "lora_cluster"
    if len(parts) > 1 and parts[1] in ROOM_PACKAGES.get(parts[0], ()):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'file:line') for every lora_cluster import under `root`."""
    found = []
    for path in sorted((root / "lora_cluster").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lora_cluster"):
                if node.module in ("lora_cluster", "lora_cluster.serve"):  # submodules, or its own names
                    folder = root.joinpath(*node.module.split("."))
                    targets = [f"{node.module}.{alias.name}"
                               if (folder / alias.name).is_dir() or (folder / f"{alias.name}.py").exists()
                               else node.module for alias in node.names]
                else:
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("lora_cluster")]
            for target in targets:
                src, dst = unit(module), unit(target)
                if src != dst:
                    found.append((src, dst, f"{path.relative_to(root)}:{node.lineno}"))
    return found


def test_every_unit_of_the_package_is_in_the_table() -> None:
    units = {unit(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
             for p in PACKAGE.rglob("*.py")}
    missing = sorted(units - ALLOWED.keys())
    assert not missing, f"units without a row in the layering table: {missing}"


def test_the_table_itself_has_no_cycle() -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        assert state.get(node) != 1, f"the layering table has a cycle: {' -> '.join([*path, node])}"
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(ALLOWED.get(node, set()) - {"lora_cluster"}):
            visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(ALLOWED):
        visit(node, [])


def upward(root: Path = ROOT) -> list[str]:
    return [f"{where}: {src} imports {dst}" for src, dst, where in imports(root) if dst not in ALLOWED[src]]


def test_no_import_points_up() -> None:
    found = upward()
    assert not found, "imports that point up (or sideways) in the layering table:\n" + "\n".join(found)


PURE = ["lora_cluster.request", "lora_cluster.replica_policy", "lora_cluster.config",
        "lora_cluster.replica_policy.prefill_plan", "lora_cluster.replica_policy.prefix_hash",
        "lora_cluster.replica_policy.slot_urgency", "lora_cluster.replica_policy.eviction",
        "lora_cluster.replica_policy.tier_stats"]


def modules_in(*folders: str) -> list[str]:
    """The dotted names of every module below `folders` (relative to the package)."""
    return [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for folder in folders for p in sorted((PACKAGE / folder).rglob("*.py"))]


def failing_imports(modules: list[str], blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import `modules` in one fresh process where the `blocked` packages cannot be imported; its
    output names each module that failed, with its error's last line."""
    code = ("import importlib, sys, traceback\n"
            f"for name in {blocked!r}:\n"
            "    sys.modules[name] = None  # any import of them raises ImportError\n"
            f"for module in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(module)\n"
            "    except Exception:\n"
            "        print(module, traceback.format_exc().splitlines()[-1])\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_pure_layers_import_without_torch_or_ray() -> None:
    """Every module of `cluster/` and `sim/`, and the packages and pure policies they import, in one
    process where `torch`, `ray`, `transformers` and `triton` cannot be imported."""
    modules = modules_in("cluster", "sim")
    result = failing_imports(modules + PURE, ("torch", "ray", "transformers", "triton"))
    assert len(modules) > 20, f"the cluster and sim modules are found: {modules}"
    assert result.returncode == 0 and not result.stdout, (
        f"modules that need torch, Ray, transformers or triton:\n{result.stdout}{result.stderr[-2000:]}")


INGRESS_FOLDERS = ("request", "serve/http", "serve/routing")
INGRESS_MODULES = ["lora_cluster.serve.protocol", "lora_cluster.serve.http_errors"]


def test_the_ingress_the_protocol_and_the_http_schemas_import_without_torch() -> None:
    """The request vocabulary, every module of the HTTP layer and the request router, the wire protocol
    and the error map, in one process where `torch` and `triton` cannot be imported: an ingress
    process (and every app deploy) never pays torch's import."""
    modules = modules_in(*INGRESS_FOLDERS)
    result = failing_imports(modules + INGRESS_MODULES, ("torch", "triton"))
    assert len(modules) > 30, f"the request, http and routing modules are found: {modules}"
    assert result.returncode == 0 and not result.stdout, (
        f"ingress modules that need torch:\n{result.stdout}{result.stderr[-2000:]}")


def test_an_upward_import_between_engine_rooms_is_caught(tmp_path: Path) -> None:
    rooms = tmp_path / "lora_cluster" / "engine"
    for room in ENGINE_ROOMS:
        (rooms / room).mkdir(parents=True)
    (rooms / "sample" / "stopping.py").write_text("from lora_cluster.engine.schedule.sequence import S\n")
    (rooms / "adapters" / "pool.py").write_text("def f():\n    from lora_cluster.engine.model.x import b\n")
    (rooms / "model" / "runner.py").write_text("from lora_cluster.engine.sample.sampling import sample\n")
    (rooms / "schedule" / "scheduler.py").write_text("from lora_cluster.engine.llm_engine import Engine\n")
    found = upward(tmp_path)
    assert found == ["lora_cluster/engine/adapters/pool.py:2: engine.adapters imports engine.model",
                     "lora_cluster/engine/sample/stopping.py:1: engine.sample imports engine.schedule",
                     "lora_cluster/engine/schedule/scheduler.py:1: engine.schedule imports engine"], (
        f"an import up from a room (to a room above, or to the engine's own modules) is reported, one "
        f"down is not: {found}")


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    cluster = tmp_path / "lora_cluster" / "cluster"
    cluster.mkdir(parents=True)
    (cluster / "policy.py").write_text("def f():\n    from lora_cluster.serve.http.ingress import x\n")
    (cluster / "fine.py").write_text("from lora_cluster.config import ServeConfig\n")
    found = upward(tmp_path)
    assert found == ["lora_cluster/cluster/policy.py:2: cluster imports serve.http"], (
        f"a lazy import from a policy up into the HTTP room is reported, a downward one is not: {found}")

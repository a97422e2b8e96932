"""The shipped build compiles the pure policy modules with mypyc (setup.py), and both builds decide the
same: the simulator, run once on the compiled modules and once on their Python sources
(`LORA_CLUSTER_PURE_PYTHON=1`), prints the same JSON but for CPU and wall-clock figures. Which build
loads is `lora_cluster.compiled`'s choice: the compiled modules by default, the sources under the
variable or when a source changed since the build (a stale compiled copy is never run).

The tests that need a compiled build skip, saying why, where none is installed (or it is stale: edited
sources, not rebuilt); `.ci/run` installs with `pip install -e`, which compiles, so they run there.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import lora_cluster
from lora_cluster import compiled
from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import Grant, Refusal
from lora_cluster.cluster.controller_settings import ControllerSettings
from lora_cluster.cluster.report_delta import ReportDelta
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import SlaClass

ROOT = Path(__file__).resolve().parents[2]
RECORD = Path(lora_cluster.__file__).with_name(compiled.RECORD_NAME)
SMALL_CELL = ["--nodes", "8", "--adapters", "200", "--duration", "20", "--warmup", "5", "--json"]
SETTINGS = {"default": [], "two controller shards": ["--controller-shards", "2"],
            "load 1.5": ["--load", "1.5"], "50 chats": ["--chats", "50"]}


def run_python(args: list[str], *, pure: bool) -> subprocess.CompletedProcess[str]:
    """`python args` in a fresh process, on the compiled build or (`pure`) on the Python sources."""
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_PYTHON_ENV}
    if pure:
        env[compiled.PURE_PYTHON_ENV] = "1"
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, f"python {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    return result


def why_no_compiled_build() -> str | None:
    """None when a current compiled build is installed, else why the tests that need one skip."""
    if not RECORD.exists():
        return f"no compiled build is installed ({RECORD} absent): pip install -e . compiles one"
    finder = compiled.SourceFinder("lora_cluster", str(RECORD.parent), str(RECORD), pure=False)
    finder.find_spec("lora_cluster.cluster")  # loads the record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if finder.use_sources():
            return (f"the compiled build is stale ({', '.join(finder.stale)} changed since it was built): "
                    "python setup.py build_ext --inplace rebuilds it")
    return None


needs_compiled = pytest.mark.skipif(why_no_compiled_build() is not None, reason=str(why_no_compiled_build()))


def loaded_from(pure: bool) -> dict[str, bool]:
    """Each recorded module -> whether it loaded compiled, in a fresh process."""
    modules = sorted(json.loads(RECORD.read_text()))
    code = ("import importlib, json\nfrom lora_cluster.compiled import is_compiled\n"
            f"print(json.dumps({{m: is_compiled(importlib.import_module(m)) for m in {modules!r}}}))")
    return json.loads(run_python(["-c", code], pure=pure).stdout)


@needs_compiled
def test_the_compiled_build_loads_every_compiled_policy_module() -> None:
    found = loaded_from(pure=False)
    assert "lora_cluster.cluster.controller" in found, f"the controller is compiled: {sorted(found)}"
    assert all(found.values()), f"modules loaded from source in the compiled build: {found}"


@needs_compiled
def test_the_variable_loads_every_policy_module_from_its_source() -> None:
    found = loaded_from(pure=True)
    assert not any(found.values()), f"modules loaded compiled under LORA_CLUSTER_PURE_PYTHON=1: {found}"


def decisions(output: str) -> dict[str, Any]:
    """The simulator's JSON output, flattened to dotted keys, without CPU and wall-clock figures."""
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif "cpu" not in key and "wall" not in key:
            flat[key] = value

    walk(json.loads(output), "")
    return flat


@needs_compiled
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_both_builds_decide_the_same_in_the_simulator(setting: str) -> None:
    args = ["-m", "lora_cluster.sim", *SMALL_CELL, *SETTINGS[setting]]
    compiled_run = decisions(run_python(args, pure=False).stdout)
    pure_run = decisions(run_python(args, pure=True).stdout)
    assert compiled_run["completed"] > 0, f"the cell completes requests: {compiled_run['completed']}"
    assert compiled_run.keys() == pure_run.keys(), (
        f"the same keys: {sorted(compiled_run.keys() ^ pure_run.keys())}")
    differ = {k: (compiled_run[k], pure_run[k]) for k in compiled_run if compiled_run[k] != pure_run[k]}
    assert not differ, f"{setting}: figures that differ (compiled, pure): {differ}"


def crossing_objects() -> list[object]:
    """One of each policy object that crosses processes pickled (Ray: ingress, controller, replicas)."""
    return [Ticket("t1", "ingress-0", "interactive", 0, "a1", 1.0), Grant("replica-0", preempt=True),
            Refusal("queue full", 2.0), ReportDelta("replica-0", 2, 1), RoutingStats(), ControllerSettings(),
            ReplicaReport("replica-0", "node-0", 4, 8, 2, 1, 0, 1), SlaClass("interactive", 0)]


@pytest.mark.parametrize("obj", crossing_objects(), ids=lambda o: type(o).__name__)
def test_the_objects_that_cross_processes_pickle_in_this_build(obj: object) -> None:
    """In the compiled build too: a frozen class stays a Python class there (`lora_cluster.compiled`)."""
    assert pickle.loads(pickle.dumps(obj)) == obj, f"{type(obj).__name__} comes back equal from pickle"


def package(tmp_path: Path, recorded_source: str) -> compiled.SourceFinder:
    """A package `pkg` with a module `mod` whose record says it was compiled from `recorded_source`."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "mod.py").write_text("VALUE = 1\n")
    record = folder / compiled.RECORD_NAME
    record.write_text(json.dumps({"pkg.mod": hashlib.sha256(recorded_source.encode()).hexdigest()}))
    return compiled.SourceFinder("pkg", str(folder), str(record), pure=False)


def test_a_current_build_leaves_the_import_to_the_compiled_module(tmp_path: Path) -> None:
    finder = package(tmp_path, "VALUE = 1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = finder.find_spec("pkg.mod")
    assert spec is None, "an unchanged source: the finder steps aside (the extension module loads)"


def test_a_changed_source_loads_from_source_and_warns_naming_it(tmp_path: Path) -> None:
    finder = package(tmp_path, "VALUE = 0\n")
    with pytest.warns(RuntimeWarning, match="pkg.mod changed since the build"):
        spec = finder.find_spec("pkg.mod")
    assert spec is not None and spec.origin == str(tmp_path / "pkg" / "mod.py"), (
        f"a changed source loads from the .py: {spec}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = finder.find_spec("pkg.mod")
    assert again is not None, "the decision holds for the next import, without a second warning"


def test_the_variable_loads_sources_without_a_warning(tmp_path: Path) -> None:
    finder = package(tmp_path, "VALUE = 1\n")
    finder.pure = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = finder.find_spec("pkg.mod")
    assert spec is not None and spec.origin == str(tmp_path / "pkg" / "mod.py"), f"the .py loads: {spec}"


def test_modules_outside_the_record_are_left_alone(tmp_path: Path) -> None:
    finder = package(tmp_path, "VALUE = 0\n")
    assert finder.find_spec("pkg.other") is None, "a module the build did not compile: not the finder's"
    assert finder.find_spec("elsewhere.mod") is None, "another package: not the finder's"


@pytest.mark.parametrize(("value", "pure"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_variable_values(value: str, pure: bool) -> None:
    assert compiled.pure_python_requested({compiled.PURE_PYTHON_ENV: value}) is pure, (
        f"LORA_CLUSTER_PURE_PYTHON={value!r}")


def test_without_a_record_the_package_imports_its_sources(tmp_path: Path) -> None:
    """A copy of the package without its compiled build (no record, no extension modules) imports."""
    copy = tmp_path / "lora_cluster"
    copy.mkdir()
    (copy / "compiled.py").write_text((ROOT / "lora_cluster" / "compiled.py").read_text())
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport compiled\n"
            "print(compiled.install() is None)")
    result = run_python(["-c", code, str(copy)], pure=False)
    assert result.stdout.strip() == "True", f"no record: no finder is installed ({result.stdout})"

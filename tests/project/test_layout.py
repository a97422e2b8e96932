"""The folder layout shows the architecture: the README's layout table matches the tree, and the
project's modules import each other without cycles (the team's `import_cycles.py`, vendored in
`tools/`, so that the check runs on every clone)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CYCLES_TOOL = ROOT / "tools" / "import_cycles.py"
LAYOUT_TOOL = ROOT / ".ci" / "layout.py"


def _layout_tool():
    spec = importlib.util.spec_from_file_location("layout_tool", LAYOUT_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layout_rows() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_every_path_in_the_layout_table_exists() -> None:
    rows = _layout_rows()
    assert rows, "the README has a layout table"
    for path in rows:
        assert (ROOT / path).exists(), f"the README's layout table names {path}, which is not in the tree"


def test_every_package_and_top_level_module_is_in_the_layout_table() -> None:
    rows = set(_layout_rows())
    package = ROOT / "lora_cluster"
    parts = [f"lora_cluster/{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
    parts += [f"lora_cluster/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"]
    for part in sorted(parts):
        assert part in rows, f"{part} is missing from the README's layout table"


def test_docs_layout_lists_every_module_with_its_docstring_and_no_name_is_stale() -> None:
    result = subprocess.run([sys.executable, str(LAYOUT_TOOL), "--check"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, (
        f"docs/layout.md is generated from the code, every module has a docstring, and the package "
        f"docstrings and the README's layout table name only modules that exist: {result.stderr}")


def test_a_stale_module_name_in_a_package_docstring_is_caught(tmp_path: Path) -> None:
    (tmp_path / "lora_cluster" / "cluster").mkdir(parents=True)
    (tmp_path / "lora_cluster" / "sim").mkdir()
    (tmp_path / "lora_cluster" / "__init__.py").write_text("")
    (tmp_path / "lora_cluster" / "cluster" / "__init__.py").write_text("")
    (tmp_path / "lora_cluster" / "cluster" / "scheduling.py").write_text("def choose_replica(): pass\n")
    (tmp_path / "lora_cluster" / "sim" / "__init__.py").write_text(
        '"""Runs `scheduling.choose_replica`, `cluster.scheduling`, `scheduling.preemption_target`."""')
    stale = _layout_tool().stale_references(tmp_path)
    assert stale == ["lora_cluster/sim/__init__.py: `scheduling.preemption_target`"], (
        f"only the name that no module defines is stale: {stale}")


def test_no_import_cycles() -> None:
    result = subprocess.run([sys.executable, str(CYCLES_TOOL), str(ROOT)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"import cycles among the modules:\n{result.stdout}{result.stderr}"


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import g\n")
    result = subprocess.run([sys.executable, str(CYCLES_TOOL), str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, f"a lazy import back is a cycle: {result.stdout}{result.stderr}"
    assert "pkg.a" in result.stdout and "pkg.b" in result.stdout, f"the cycle is named: {result.stdout}"

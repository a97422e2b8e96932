"""The folder layout shows the architecture: the README's layout table matches the tree, and the
project's modules import each other without cycles (the team's `import_cycles.py`, vendored in
`tools/`, so that the check runs on every clone)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CYCLES_TOOL = ROOT / "tools" / "import_cycles.py"


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

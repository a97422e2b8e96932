"""Modules and functions stay small (the project's guide): no module of `lora_cluster/` over 450 lines,
and no function over 60 in `lora_cluster/engine/` and `lora_cluster/serve/http/` (measured on the
AST: `end_lineno - lineno + 1`, decorators not counted, a nested function counted on its own and
within its parent)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def oversized(folder: Path, functions: bool = True) -> list[str]:
    """'path: N lines' for each module over the limit, 'path:line name: N lines' for each function
    (`functions` False: modules only). Paths are relative to the folder holding `lora_cluster/`."""
    found = []
    root = next(p for p in (folder, *folder.parents) if p.name == "lora_cluster").parent
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root).as_posix()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        if not functions:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno} {node.name}: {size} lines")
    return found


def test_no_engine_module_or_function_is_over_the_limits() -> None:
    found = oversized(ROOT / "lora_cluster" / "engine")
    assert not found, (f"engine modules over {MAX_MODULE_LINES} lines or functions over {MAX_FUNCTION_LINES} "
                       "(split them by concept):\n" + "\n".join(found))


def test_no_http_function_is_over_the_limit() -> None:
    found = oversized(ROOT / "lora_cluster" / "serve" / "http")
    assert not found, (f"serve/http modules over {MAX_MODULE_LINES} lines or functions over "
                       f"{MAX_FUNCTION_LINES} (split them by concept):\n" + "\n".join(found))


def test_no_module_of_the_package_is_over_the_limit() -> None:
    found = oversized(ROOT / "lora_cluster", functions=False)
    assert not found, f"modules over {MAX_MODULE_LINES} lines (split them by concept):\n" + "\n".join(found)


def test_an_oversized_function_or_module_is_caught(tmp_path: Path) -> None:
    engine = tmp_path / "lora_cluster" / "engine"
    engine.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (engine / "long.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    (engine / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(engine) == ["lora_cluster/engine/big.py: 451 lines",
                                 "lora_cluster/engine/long.py:5 long: 61 lines"], oversized(engine)

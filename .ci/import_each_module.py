"""Import every module of the project in a fresh interpreter of its own (two at a time).

A module that only imports when something else was imported first hides an import-order
dependency (often a cycle). Exit 1 and name the modules that fail. Run by `.ci/run`.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> list[str]:
    found = []
    for base, package in ((ROOT, "lora_cluster"), (ROOT / "kernels", "lora_kernels")):
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append(".".join(parts))
    return found


def try_import(module: str) -> tuple[str, str | None]:
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                            timeout=300)
    return module, None if result.returncode == 0 else result.stderr.strip().splitlines()[-1]


def main() -> int:
    names = modules()
    with ThreadPoolExecutor(2) as pool:
        failures = [(m, err) for m, err in pool.map(try_import, names) if err is not None]
    for module, error in failures:
        print(f"import {module} failed on its own: {error}")
    print(f"{len(names) - len(failures)} of {len(names)} modules import on their own")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The build of lora-cluster: setuptools, with the pure policy modules compiled by mypyc.

Every module of `lora_cluster/cluster/` (the controller's policies: plain Python, injected clocks, no
torch or Ray) is compiled to a C extension beside its source, in one shared library
(`lora_cluster/policies__mypyc`); everything else installs as Python, and the .py sources are shipped
too. The build also writes `lora_cluster/compiled_sources.json`, each compiled module's SHA-256 of the
source it was compiled from, which `lora_cluster.compiled` checks at import: a source edited since the
build loads the Python sources instead of a stale compiled copy. Metadata and dependencies stay in
pyproject.toml; `mypy` (which holds mypyc) is a build requirement there, and mypy's settings for the
compiled modules are its `[tool.mypy]` table. `LORA_CLUSTER_PURE_PYTHON=1` at build time skips the
compilation (a pure-Python install, e.g. where no C compiler is at hand).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
COMPILED_FOLDERS = ("lora_cluster/cluster",)
GROUP = "lora_cluster.policies"  # the shared library's module name (mypyc adds `__mypyc`)
RECORD = "lora_cluster/compiled_sources.json"  # read by lora_cluster.compiled
PURE = os.environ.get("LORA_CLUSTER_PURE_PYTHON", "").strip().lower() in ("1", "true", "yes", "on")


def compiled_sources() -> list[str]:
    """The modules to compile, as paths relative to the project root (package `__init__`s stay Python)."""
    return sorted(p.relative_to(ROOT).as_posix() for folder in COMPILED_FOLDERS
                  for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")


def record() -> str:
    """The JSON record of what was compiled: dotted module name -> SHA-256 of its source."""
    digests = {path.removesuffix(".py").replace("/", "."):
               hashlib.sha256((ROOT / path).read_bytes()).hexdigest() for path in compiled_sources()}
    return json.dumps(digests, indent=1, sort_keys=True) + "\n"


class BuildPolicies(build_ext):
    """build_ext that runs mypyc only when extensions are built (not for metadata or an sdist), and
    writes the record beside the built modules: in the build folder (a wheel) and, in place or for an
    editable install, in the source tree."""

    def finalize_options(self) -> None:
        extensions = self.distribution.ext_modules
        if extensions and not getattr(self, "_mypycified", False):
            from mypyc.build import mypycify

            os.chdir(ROOT)  # mypyc names the modules by their paths from here
            self._record = record()  # the sources as mypyc reads them now
            extensions[:] = mypycify(compiled_sources(), group_name=GROUP)
            self._mypycified = True
        super().finalize_options()

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        text = self._record
        targets = [Path(self.build_lib) / RECORD]
        if self.inplace or getattr(self, "editable_mode", False):
            targets.append(ROOT / RECORD)
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


# one extension so that setuptools runs build_ext; BuildPolicies.finalize_options puts mypyc's in its place
setup(ext_modules=[] if PURE else [Extension(f"{GROUP}__mypyc", sources=[])],
      cmdclass={"build_ext": BuildPolicies})

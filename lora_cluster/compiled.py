"""The switch between the compiled policy modules and their Python sources, installed at import.

The build (setup.py) compiles the pure policy modules with mypyc, beside their .py sources, and
records in `compiled_sources.json` (next to this module) the SHA-256 of the source each was compiled
from. Python's import system prefers an extension module to the .py beside it; `SourceFinder`, first
on `sys.meta_path`, loads the .py sources of the recorded modules instead when
`LORA_CLUSTER_PURE_PYTHON=1` is set, or when a recorded source differs from the one compiled (an edit
since the last build: the compiled copy is stale), and then warns once, naming the changed modules.
All or none: compiled modules call each other's native code directly, so a module from its source is
never mixed with compiled ones. Without the record (no compiled build: a copy of the sources, or a
build with `LORA_CLUSTER_PURE_PYTHON=1`) nothing is installed. Cost: one `stat` when `lora_cluster` is
imported; reading the record and hashing its sources (about 100 KB) once, at the first import of a
recorded module.

What the compiled modules keep as Python classes (`mypy_extensions.mypyc_attr(native_class=False)`):
every frozen dataclass but `Ticket`, since mypyc unpickles a compiled class by setting its fields one
by one, which a frozen class refuses, and grants, refusals, reports and settings cross processes
pickled (`Ticket`, read on every queue comparison, is compiled and pickles itself by `__reduce__`); and
a class that keeps values in its instances' `__dict__` (a compiled class has none).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from types import ModuleType

PURE_PYTHON_ENV = "LORA_CLUSTER_PURE_PYTHON"
RECORD_NAME = "compiled_sources.json"
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def pure_python_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `LORA_CLUSTER_PURE_PYTHON` asks for the Python sources (1, true, yes or on)."""
    return environ.get(PURE_PYTHON_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class SourceFinder:
    """A meta path finder for one package's recorded modules: their .py sources when `pure` or when a
    recorded source changed, else nothing (the next finders load the compiled modules)."""

    def __init__(self, package: str, package_dir: str, record_path: str, pure: bool) -> None:
        self.package, self.package_dir, self.record_path, self.pure = package, package_dir, record_path, pure
        self._digests: dict[str, str] | None = None
        self._use_sources: bool | None = None  # decided at the first recorded import
        self.stale: list[str] = []  # the recorded modules whose source changed since the build

    def source_path(self, module: str) -> str:
        """The .py source of a module of the package."""
        return os.path.join(self.package_dir, *module.split(".")[1:]) + ".py"

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if not fullname.startswith(self.package + "."):
            return None
        if self._digests is None:
            import json

            with open(self.record_path) as f:
                self._digests = json.load(f)
        if fullname not in self._digests or not self.use_sources():
            return None
        return spec_from_file_location(fullname, self.source_path(fullname))

    def use_sources(self) -> bool:
        """Whether the recorded modules load from their sources (decided once, then kept)."""
        if self._use_sources is None:
            self.stale = [] if self.pure else self._changed()
            self._use_sources = self.pure or bool(self.stale)
            if self.stale:
                import warnings

                warnings.warn(f"stale compiled modules: {', '.join(self.stale)} changed since the build, so "
                              "every compiled module loads from its Python source (rebuild: python setup.py "
                              "build_ext --inplace)", RuntimeWarning, stacklevel=2)
        return self._use_sources

    def _changed(self) -> list[str]:
        import hashlib

        changed = []
        for module, digest in sorted((self._digests or {}).items()):
            try:
                with open(self.source_path(module), "rb") as f:
                    if hashlib.sha256(f.read()).hexdigest() != digest:
                        changed.append(module)
            except FileNotFoundError:  # shipped without its source: only the compiled module exists
                continue
        return changed


def install() -> SourceFinder | None:
    """Put the finder first on `sys.meta_path` when this package has a compiled build (once)."""
    for finder in sys.meta_path:
        if isinstance(finder, SourceFinder) and finder.package == __package__:
            return finder
    record_path = os.path.join(PACKAGE_DIR, RECORD_NAME)
    if not os.path.exists(record_path):
        return None
    finder = SourceFinder(__package__ or "lora_cluster", PACKAGE_DIR, record_path, pure_python_requested())
    sys.meta_path.insert(0, finder)
    return finder


def is_compiled(module: ModuleType) -> bool:
    """Whether a module was loaded from a compiled extension rather than its .py source, by its file's
    suffix (the folder may be wrong: mypyc names the modules that another compiled module imports first
    under a doubled package folder; nothing reads a policy module's `__file__`)."""
    from importlib.machinery import EXTENSION_SUFFIXES

    return (module.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))

"""Re-read the tenants file when it changes, without a restart and off the event loop.

A daemon thread looks at the file's (mtime_ns, size, inode) every `period_s` and re-parses it when
they change (an editor's save, or a Kubernetes ConfigMap/Secret swap, which replaces the file) and
then stay the same for one more look: a file caught while it is being written (truncated, or cut
short but still valid YAML, which would lock out every tenant it has not reached yet) is never put
in force; what is read is the file as it settled. A
new file that cannot be read or parsed is logged as an error and the last good one stays in force;
the next change is tried again. Readers call `current()`, which returns the directory in force (one
reference read: a swap is atomic for them). At start the file must be valid: a broken or missing
tenants file stops the server from starting instead of leaving it open.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection

from lora_cluster.tenancy.tenants import Directory, TenantsFileError, parse_tenants

log = logging.getLogger(__name__)

Signature = tuple[int, int, int]
_GONE: Signature = (0, 0, 0)


def _signature(path: str) -> Signature:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def read_tenants(path: str, sla_classes: Collection[str] | None = None) -> Directory:
    """Parse the tenants file at `path`; TenantsFileError (never naming a key) otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"cannot read the tenants file {path}: {type(exc).__name__}") from None
    return parse_tenants(text, sla_classes)


class TenantsWatcher:
    """The tenants file in force, re-read on change (see the module docstring)."""

    def __init__(self, path: str, sla_classes: Collection[str] | None = None, period_s: float = 2.0,
                 start: bool = True):
        self.path, self.sla_classes, self.period_s = path, sla_classes, period_s
        try:
            self._signature = _signature(path)  # before reading: a change during the read is seen later
        except OSError as exc:
            raise TenantsFileError(f"cannot read the tenants file {path}: {type(exc).__name__}") from None
        self._directory = read_tenants(path, sla_classes)
        self._changed: Signature | None = None  # a new signature seen once, applied if seen again
        self.reloads = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="lora-tenants-watch", daemon=True)
            self._thread.start()

    def current(self) -> Directory:
        return self._directory

    def check(self) -> bool:
        """Re-read the file if it changed and has settled (the same new signature as at the last
        check); True when a new directory is in force."""
        try:
            signature = _signature(self.path)
        except OSError as exc:
            if self._signature != _GONE:  # logged once per disappearance, not at every poll
                self._signature = _GONE
                self._failed(f"cannot stat the tenants file {self.path}: {type(exc).__name__}; the "
                             "previous tenants file stays in force")
            return False
        if signature == self._signature:
            self._changed = None
            return False
        if signature != self._changed:  # changed since the last look: it may still be being written
            self._changed = signature
            return False
        self._signature, self._changed = signature, None
        try:
            directory = read_tenants(self.path, self.sla_classes)
        except TenantsFileError as exc:
            self._failed(f"{exc}; the previous tenants file stays in force")
            return False
        self._directory = directory
        self.reloads += 1
        log.info("tenants file %s reloaded: %d tenants", self.path, len(directory.tenants))
        return True

    def _failed(self, message: str) -> None:
        self.errors += 1
        log.error("%s", message)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # the watcher must outlive any surprise; the old file stays in force
                log.exception("tenants file watcher failed")

    def close(self) -> None:
        self._stop.set()

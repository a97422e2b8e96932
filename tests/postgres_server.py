"""A real PostgreSQL server for the tests: `initdb` and `pg_ctl` from the machine's PostgreSQL, on
127.0.0.1 and a free port, trust authentication, in a temporary folder removed at the end. Run as the
`postgres` user when the tests run as root (initdb refuses root). `start_postgres` returns None where
PostgreSQL's programs or psycopg are not installed; the caller skips."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from helpers import free_tcp_port


@contextlib.contextmanager
def start_postgres() -> Iterator[str | None]:
    """Yields the server's URL (`postgresql://lora@127.0.0.1:<port>/postgres`), or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        yield None
        return
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb is None or pg_ctl is None:
        yield None
        return
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="lora-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        os.chown(root, pwd.getpwnam("postgres").pw_uid, -1)
    data, port = root / "data", free_tcp_port()
    subprocess.run([*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "lora", "--no-sync",
                    "-E", "UTF8"], check=True, capture_output=True, timeout=120)
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-o", f"-h 127.0.0.1 -p {port} -k {root} -F",
                    "-w", "-t", "60", "-l", str(root / "log"), "start"], check=True, capture_output=True,
                   timeout=90)
    try:
        yield f"postgresql://lora@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True,
                       timeout=60)
        shutil.rmtree(root, ignore_errors=True)

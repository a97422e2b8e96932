"""Durations, TTLs and deadlines are measured on monotonic clocks; the wall clock only stamps what
people read (a response's `created`, a report's send time, a cache entry's creation) or ages what
outlives the process (a disk-cache entry's file time).

A wall clock steps (NTP, an operator, a VM resumed): a TTL kept with it never expires after a step
back, or expires at once after a step forward. The check reads the package's source (no import):
every wall-clock read must be one of the reviewed uses below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lora_cluster

PACKAGE = Path(lora_cluster.__file__).parent

# module (relative to the package) -> reviewed wall-clock reads there, and why each is one
REVIEWED = {
    "serve/http/openai_api.py": 2,  # OpenAI's `created` (responses, /v1/models): a timestamp for the user
    "serve/http/admin_api.py": 1,  # /debug/replicas' `time`: when the snapshot was taken, for people
    "serve/replica/deployment.py": 1,  # a report's `sent_at`: wall-clock time for display (cluster.reports)
    "store/disk_cache.py": 2,  # entry metadata's `created`; ages of files left by an earlier process
    "serve/ops/usage_sink.py": 2,  # pruning records by their Unix end times; which Unix minutes are closed
    # for the Parquet export (tenancy.usage_export): both compare with record times, which are Unix times
    "serve/replica/usage.py": 1,  # a usage record's `ended_at`: the Unix time its minute is summed in
}
WALL_CLOCK = {("time", "time"), ("time", "time_ns"), ("datetime", "now"), ("datetime", "utcnow"),
              ("datetime", "today")}


def wall_clock_reads(path: Path) -> list[int]:
    """Line numbers of `time.time()`, `time.time_ns()`, `datetime.now()`... calls in one module."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if (name, node.func.attr) in WALL_CLOCK:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_wall_clock_is_read_only_where_reviewed():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        reads = wall_clock_reads(path)
        if reads:
            found[path.relative_to(PACKAGE).as_posix()] = reads
    unexpected = {module: lines for module, lines in found.items() if len(lines) > REVIEWED.get(module, 0)}
    assert not unexpected, (
        f"wall-clock reads outside the reviewed timestamps (module: lines): {unexpected}; measure durations "
        "and TTLs with time.monotonic (or an injected clock), or review the use and list it in REVIEWED")


def test_the_check_sees_a_wall_clock_read(tmp_path):
    module = tmp_path / "ttl.py"
    module.write_text("import time\nimport datetime\n\n"
                      "def expired(t0, ttl):\n    return time.time() - t0 > ttl\n\n"
                      "def now():\n    return datetime.datetime.now()\n")
    assert wall_clock_reads(module) == [5, 8], "both a time.time() and a datetime.now() call are found"

"""A node-local spool of a process's usage records: they outlive the process killed without a graceful stop.

Invariant: a usage record a process has accepted (`UsageShipper.add`) is in its spool files from
that moment until the store has acknowledged the batch that carries it; the spool of a process that
died is shipped by exactly one other process on the same node, under the dead process's sender id
and the sequence numbers its files name, so the store takes each of its batches exactly once
(`usage_store.UsageStore.record_batch` keeps the highest seq per sender).

Layout, under the spool folder (`usage_spool_dir`, on a local disk of the node):

* `<sender>/lock`: created and locked (`flock`, exclusive) by the owner before the folder gets its
  name (it is made as `.new-<hex>` and renamed), held for the owner's whole life and released by the
  kernel when the process dies, however it dies. Its text is the sender id.
* `<sender>/<seq>.open`: the records added since the last batch was cut, one JSON line each, written
  (one `write` call, no fsync: the page cache survives the process, not the node) as each is added.
  They form batch `<seq>` when it is cut.
* `<sender>/<seq>.batch`: a batch cut and sent, not yet acknowledged (at most one: the shipper sends
  a new batch only once the previous one is acknowledged). Deleted on its acknowledgement.

Cutting a batch renames `<seq>.open` to `<seq>.batch` in the same synchronous step that takes the
buffer, so the file holds exactly the batch's records (parts of one request merged the same way as
the buffer merges them, `usage_buffer.UsageBuffer`).

Adoption (`adopt_one`): any process with a spool on the node tries the lock of each other sender's
folder without waiting; a lock it gets belongs to a dead process (a live owner holds its own). The
adopter sends the dead sender's `.batch` and `.open` files in seq order, each as the batch of that
seq under the dead sender's id (a batch that had landed writes nothing), deletes each file as it is
acknowledged, then the folder. Two adopters cannot both hold the lock; one that gets it after the
other finished finds no files; and a batch sent twice anyway is taken once by the store.

Bounds: the open file takes at most `max_segment_bytes` (a record past it is kept only in memory,
counted in `overflowed`), so one process's spool is at most two files of that size (the buffer of
`usage_buffer.DEFAULT_MAX_RECORDS` requests fits well within the default); at most `MAX_DEAD_SPOOLS`
dead senders' folders are kept on a node (past that the oldest are deleted, their records counted
as lost in a warning). The calls do blocking file I/O: `append`, `cut` and `acked` are one small
write, rename or unlink each (the replica makes them on its event loop, as a request ends); `adopt_one`
and `DeadSpool.batches` read folders and belong on a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

from lora_cluster.tenancy.usage_record import Outcome, UsageRecord, merge

log = logging.getLogger(__name__)

MAX_DEAD_SPOOLS = 256  # dead senders' folders kept on a node
DEFAULT_MAX_SEGMENT_BYTES = 64 * 1024 * 1024
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _segment(folder: Path, seq: int, kind: str) -> Path:
    return folder / f"{seq:012d}.{kind}"


def encode(record: UsageRecord) -> bytes:
    """One record as a JSON line."""
    values = {**asdict(record), "outcome": record.outcome.value}
    return (json.dumps(values, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> UsageRecord:
    """A record from its JSON line (`encode`)."""
    values = json.loads(line)
    return UsageRecord(**{**values, "outcome": Outcome(values["outcome"])})


def read_segment(path: Path) -> tuple[UsageRecord, ...]:
    """The records of one segment file, parts of a request merged, in first-seen order; a line cut
    short (the process died inside its write) is skipped."""
    records: dict[str, UsageRecord] = {}
    for line in path.read_bytes().splitlines():
        try:
            part = decode(line)
        except (ValueError, TypeError, KeyError):
            log.warning("usage spool: %s has a damaged line; skipped", path.name)
            continue
        before = records.get(part.request_id)
        records[part.request_id] = part if before is None else merge(before, part)
    return tuple(records.values())


def _try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock of `path`, or None (held by a live process, or gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class DeadSpool:
    """A dead sender's folder, locked by this process until `release` (see the module docstring)."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self._fd = folder, fd
        self.source = os.pread(fd, 4096, 0).decode(errors="replace") or folder.name

    def batches(self) -> list[tuple[int, tuple[UsageRecord, ...]]]:
        """(seq, records) of each `.batch` and `.open` file, in seq order (empty files left out)."""
        found = []
        for path in sorted(self.folder.glob("*.batch")) + sorted(self.folder.glob("*.open")):
            records = read_segment(path)
            found.append((int(path.name.split(".")[0]), records))
        return sorted((s, r) for s, r in found if r)

    def acked(self, seq: int) -> None:
        """The store took batch `seq`: its files go."""
        for kind in ("batch", "open"):
            with contextlib.suppress(FileNotFoundError):
                _segment(self.folder, seq, kind).unlink()

    def release(self, *, remove: bool) -> None:
        """Give the lock back; with `remove`, delete the folder first (everything was acknowledged)."""
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._fd)


class UsageSpool:
    """This process's spool folder (see the module docstring). `open` creates it."""

    def __init__(self, root: Path, folder: Path, fd: int, max_segment_bytes: int):
        self.root, self.folder, self._lock_fd = root, folder, fd
        self.max_segment_bytes = max_segment_bytes
        self.next_seq = 1  # the seq of the open file: the batch it will become
        self._open_fd: int | None = None
        self._open_bytes = 0
        self.overflowed = 0  # records kept only in memory: the open file was full, or a write failed

    @classmethod
    def open(cls, root: str | Path, source: str,
             max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES) -> UsageSpool:
        """The spool of sender `source` under `root`, locked before it is visible to adopters."""
        root = Path(root).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".new-{uuid.uuid4().hex}"
        staging.mkdir()
        fd = os.open(staging / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, source.encode())
        folder = root / _SAFE.sub("_", source)
        os.rename(staging, folder)
        return cls(root, folder, fd, max_segment_bytes)

    def append(self, record: UsageRecord) -> bool:
        """Write `record` into the open file; False if it is kept only in memory (see `overflowed`)."""
        line = encode(record)
        if self._open_bytes + len(line) > self.max_segment_bytes:
            self.overflowed += 1
            return False
        try:
            if self._open_fd is None:
                self._open_fd = os.open(_segment(self.folder, self.next_seq, "open"),
                                        os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.write(self._open_fd, line)
        except OSError as exc:
            self.overflowed += 1
            log.warning("usage spool: a record could not be written (%s); it is kept in memory only", exc)
            return False
        self._open_bytes += len(line)
        return True

    def cut(self, seq: int) -> None:
        """The open file becomes batch `seq` (the buffer was just taken as that batch)."""
        if seq != self.next_seq:
            raise ValueError(f"usage spool: batch {seq} cut while the open file is batch {self.next_seq}")
        if self._open_fd is not None:
            os.close(self._open_fd)
            self._open_fd = None
            with contextlib.suppress(FileNotFoundError):
                os.rename(_segment(self.folder, seq, "open"), _segment(self.folder, seq, "batch"))
        self.next_seq, self._open_bytes = seq + 1, 0

    def acked(self, seq: int) -> None:
        """The store took batch `seq`: its file goes."""
        with contextlib.suppress(FileNotFoundError):
            _segment(self.folder, seq, "batch").unlink()

    def adopt_one(self, max_dead: int = MAX_DEAD_SPOOLS) -> DeadSpool | None:
        """A dead sender's folder on this node, locked for this process, or None (see the module
        docstring); dead folders past `max_dead` (the oldest) are deleted."""
        dead: list[tuple[float, DeadSpool]] = []
        for folder in self.root.iterdir():
            if folder == self.folder or not folder.is_dir():
                continue
            fd = _try_lock(folder / "lock")
            if fd is None:
                continue
            if folder.name.startswith(".new-"):  # its creator died before naming it: it holds nothing
                DeadSpool(folder, fd).release(remove=True)
                continue
            with contextlib.suppress(FileNotFoundError):
                dead.append((folder.stat().st_mtime, DeadSpool(folder, fd)))
                continue
            os.close(fd)
        dead.sort(key=lambda pair: pair[0], reverse=True)  # newest first: the oldest go past the bound
        for _, spool in dead[max_dead:]:
            lost = sum(len(records) for _, records in spool.batches())
            log.warning("usage spool: more than %d dead senders on this node; %s deleted with %d records",
                        max_dead, spool.source, lost)
            spool.release(remove=True)
        kept = [spool for _, spool in dead[:max_dead]]
        for spool in kept[:-1]:
            spool.release(remove=False)
        return kept[-1] if kept else None  # the oldest first

    def close(self, *, remove: bool) -> None:
        """Give the lock back (the folder is then adoptable); with `remove`, delete it first (the
        owner has nothing unacknowledged left)."""
        if self._open_fd is not None:
            os.close(self._open_fd)
            self._open_fd = None
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._lock_fd)


__all__ = ["DEFAULT_MAX_SEGMENT_BYTES", "MAX_DEAD_SPOOLS", "DeadSpool", "UsageSpool", "decode", "encode",
           "read_segment"]

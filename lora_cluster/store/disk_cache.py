"""The local-disk tier: a size-bounded folder of downloaded adapters that survives restarts.

Layout under `disk_cache_dir`:

    entries/<key>/entry.json     what the entry holds: adapter id, source, {file: (size, sha256)}
    entries/<key>/<files>        the adapter's files exactly as the source stores them (encrypted
                                 adapters stay encrypted here)
    staging/<random>/            downloads in progress; wiped at start

`<key>` is a hash of (source URI, path of the adapter in the source).

Invariants and policy:
* Atomic: files are downloaded and fsynced into `staging/`, `entry.json` is written last, and the
  folder is renamed into `entries/` in one step. A crash leaves at worst a staging folder, removed at
  the next start; an `entries/` folder is trusted only if its `entry.json` parses and every file
  has the recorded size, and every read re-checks the recorded sha256 (see `admission`).
* `bytes <= budget`: a download that cannot fit (too large, or every byte held by protected or
  leased entries) is used once from staging and deleted ("rejected" in the stats).
* Victims are chosen by `tier.TierIndex` (value per byte; never pinned, in-use or leased entries);
  an entry is leased while a load reads it. Recency survives restarts through entry.json's mtime.
Thread-safe; the store's single flight ensures one download per key at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lora_cluster.replica_policy.tier_stats import StoreStats
from lora_cluster.store.tier import TierIndex

log = logging.getLogger(__name__)
ENTRY_FILE = "entry.json"


@dataclass(frozen=True)
class DiskEntry:
    key: str
    adapter_id: str
    path: Path
    digests: dict[str, str]  # file name -> sha256 computed when it was downloaded
    nbytes: int
    transient: bool = False  # not admitted: lives in staging and is deleted after use


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DiskCache:
    def __init__(
        self,
        root: Path | str,
        budget_bytes: int,
        *,
        protected: Callable[[str], bool] = lambda adapter_id: False,
        priority: Callable[[str], float] = lambda adapter_id: 0.0,
        on_evict: Callable[[str], None] = lambda adapter_id: None,
        stats: StoreStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = Path(root).expanduser()
        self.entries_dir, self.staging_dir = self.root / "entries", self.root / "staging"
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)  # leftovers of a crash: never trusted
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.index = TierIndex(budget_bytes, protected=protected, priority=priority, clock=clock)
        self._meta: dict[str, DiskEntry] = {}
        self._keys_of: dict[str, frozenset[str]] = {}  # adapter id -> its keys (replaced, never mutated)
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.stats = stats or StoreStats()
        self.stats.set("disk", budget_bytes=budget_bytes)
        self._scan()

    @staticmethod
    def key_for(source_uri: str, subpath: str) -> str:
        return hashlib.sha256(f"{source_uri}\0{subpath}".encode()).hexdigest()[:32]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._meta

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._meta)

    def adapter_keys(self, adapter_id: str) -> list[str]:
        """Keys of the adapter's entries. Lock-free and O(1) in the number of entries (an index
        whose values are replaced, never mutated), so the engine thread never waits behind a
        commit's file operations nor scans thousands of entries."""
        return list(self._keys_of.get(adapter_id, ()))

    def _put_meta(self, entry: DiskEntry) -> None:
        """`_meta[entry.key] = entry`, indexed by adapter (lock held)."""
        self._meta[entry.key] = entry
        self._keys_of[entry.adapter_id] = self._keys_of.get(entry.adapter_id, frozenset()) | {entry.key}

    def _pop_meta(self, key: str) -> DiskEntry | None:
        """`_meta.pop(key)`, unindexed (lock held)."""
        entry = self._meta.pop(key, None)
        if entry is not None:
            keys = self._keys_of.get(entry.adapter_id, frozenset()) - {key}
            if keys:
                self._keys_of[entry.adapter_id] = keys
            else:
                self._keys_of.pop(entry.adapter_id, None)
        return entry

    @property
    def bytes(self) -> int:
        return self.index.bytes

    # ----- start-up -------------------------------------------------------------------------

    def _read_entry(self, folder: Path) -> DiskEntry | None:
        try:
            meta = json.loads((folder / ENTRY_FILE).read_text())
            files = meta["files"]
            for name, info in files.items():
                if (folder / name).stat().st_size != info["size"]:
                    return None
            digests = {n: i["sha256"] for n, i in files.items()}
            return DiskEntry(folder.name, meta["adapter_id"], folder, digests,
                             sum(i["size"] for i in files.values()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _scan(self) -> None:
        now_wall, now = time.time(), self._clock()
        found = []
        for folder in self.entries_dir.iterdir():
            entry = self._read_entry(folder) if folder.is_dir() else None
            if entry is None:
                log.warning("disk cache: dropping incomplete or corrupt entry %s", folder)
                self._delete(folder)
                continue
            age = max(0.0, now_wall - (folder / ENTRY_FILE).stat().st_mtime)
            found.append((now - age, entry))
        for last_access, entry in sorted(found, key=lambda item: -item[0]):  # most recent first
            if self.index.admit(entry.key, entry.adapter_id, entry.nbytes, 0.0, last_access) is None:
                self._delete(entry.path)  # the budget shrank since the last run
            else:
                self._put_meta(entry)
        self._gauges(0)

    # ----- use ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def open(self, key: str) -> Iterator[DiskEntry | None]:
        """The cached entry of `key`, leased (never evicted) while the block runs; None on a miss."""
        with self._lock:
            entry = self._meta.get(key)
            if entry is not None:
                self.index.lease(key)
        if entry is None:
            yield None
            return
        with contextlib.suppress(OSError):
            os.utime(entry.path / ENTRY_FILE)  # recency that survives a restart
        try:
            yield entry
        finally:
            with self._lock:
                self.index.release(key)

    @contextlib.contextmanager
    def fill(self, key: str, adapter_id: str, fetch: Callable[[Path], dict[str, str]]) -> Iterator[DiskEntry]:
        """Run `fetch(staging_folder) -> {file: sha256}` and commit the folder atomically; the entry is
        leased while the block runs (or, when not admitted, deleted after it)."""
        staging = Path(tempfile.mkdtemp(dir=self.staging_dir))
        try:
            start = time.monotonic()
            digests = fetch(staging)
            seconds = time.monotonic() - start
            files = {n: {"size": (staging / n).stat().st_size, "sha256": d} for n, d in digests.items()}
            meta = {"adapter_id": adapter_id, "key": key, "files": files, "created": time.time()}
            with open(staging / ENTRY_FILE, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            nbytes = sum(i["size"] for i in files.values())
            committed = self._commit(key, adapter_id, staging, digests, nbytes, seconds)
        except BaseException:
            self._delete(staging)
            raise
        entry = committed or DiskEntry(key, adapter_id, staging, digests, nbytes, transient=True)
        try:
            yield entry
        finally:
            if committed is None:
                self._delete(staging)
            else:
                with self._lock:
                    self.index.release(key)

    def _commit(self, key: str, adapter_id: str, staging: Path, digests: dict[str, str], nbytes: int,
                seconds: float) -> DiskEntry | None:
        trash: list[DiskEntry] = []
        bins: list[Path | None] = []
        with self._lock:
            evicted = self.index.admit(key, adapter_id, nbytes, seconds)
            if evicted is None:
                self.stats.add("disk", "rejected")
                return None
            for victim in evicted:
                old = self._pop_meta(victim.key)
                if old is not None:
                    trash.append(old)
            final = self.entries_dir / key
            if key in self._meta:  # replaced
                trash.append(self._pop_meta(key))
            bins = [self._move_to_trash(old.path) for old in trash]
            if final.exists():
                bins.append(self._move_to_trash(final))
            os.rename(staging, final)
            entry = DiskEntry(key, adapter_id, final, digests, nbytes)
            self._put_meta(entry)
            self.index.lease(key)
            self._gauges(len(evicted))
        _fsync_dir(self.entries_dir)
        self._empty(bins)
        for old in trash:
            if old.key != key:
                self._on_evict(old.adapter_id)
        return entry

    def remove(self, key: str) -> bool:
        """Drop an entry (e.g. it failed its integrity check); True when it existed."""
        with self._lock:
            entry = self._pop_meta(key)
            self.index.remove(key)
            bin_ = self._move_to_trash(entry.path) if entry is not None else None
            self._gauges(0)
        self._empty([bin_])
        return entry is not None

    # ----- file helpers ---------------------------------------------------------------------

    def _move_to_trash(self, path: Path) -> Path | None:
        """Rename `path` out of `entries/` (instant, under the lock); delete it later with `_empty`."""
        bin_ = Path(tempfile.mkdtemp(dir=self.staging_dir, prefix="trash-"))
        try:
            os.rename(path, bin_ / "x")
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
        return bin_

    @staticmethod
    def _empty(bins: list[Path | None]) -> None:
        for bin_ in bins:
            if bin_ is not None:
                shutil.rmtree(bin_, ignore_errors=True)

    @staticmethod
    def _delete(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def _gauges(self, evictions: int) -> None:
        self.stats.set("disk", bytes=self.index.bytes, entries=len(self._meta))
        if evictions:
            self.stats.add("disk", "evictions", evictions)

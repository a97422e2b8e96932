"""The tiers below host memory: where the tiered store reads an adapter that host memory misses.

    host memory (the store's HostCache)  <-  local disk (DiskCache)  <-  source

`ColdTiers` owns the configured sources (in order; a URI is opened here, or an opened
`AdapterSource` is wired by the caller), a circuit breaker per remote source (`source_breaker`:
while it is open, cold loads from that source fail at once with a 503 naming it) and the disk
cache, created (and scanned) on first use by a remote source.

* `locate(adapter_id)`: the first source that offers the id; a disk-cached copy of a remote source
  is used without asking the network. Raises `AdapterNotFoundError` when none does.
* `read(adapter_id, source, located)`: read the adapter in place (a local folder, the hub cache), or
  from the disk cache, downloading it into the disk cache on a miss (each call to a remote source
  through its breaker); then run the admission checks (`admission`) on the calling thread's one
  intra-op thread (`cpu_policy`). A copy that fails admission is dropped from the disk cache (never
  keep what cannot be served); a refused disk-cached copy is fetched again.
* With a cluster tier wired (`cluster`, a `ports.ClusterTierPort`), a disk miss of a remote source
  first asks the tier for another node's copy (checksums verified there); a copy fetched from the
  source that passed admission is then offered to the tier, which publishes it once (never what
  cannot be served). Either way the copy lands in the disk cache and passes admission. The copy
  offered is this node's *stored form*: the source's files (encrypted when they are), or with
  `int8` the int8 host copy (`int8_form`, encrypted when the weights were or `require_encryption` is
  set), so a receiving node keeps and admits that form and never re-quantizes from full precision.
* `read` returns a `ColdCopy`: the float weights for the engine and, with `int8`, the int8 copy for
  the host tier (quantized once, on the publishing node; as received, on the others).
* `forget(adapter_id)` drops its disk copies and its in-place mark; `on_disk(adapter_id)` says
  whether a disk copy (or the in-place folder) holds it.
* `adapter_ids()` / `describe_adapters()`: what the sources offer, first source wins, from their
  listings alone (a source that cannot be listed is counted, logged and skipped).

The store's lifecycle is told when an adapter reaches the disk tier (`ON_DISK`), and the store's
`settle` when a disk copy is dropped. Thread-safe: the store's loader threads call it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lora_cluster.adapter_format import CONFIG_FILE, LoraWeights
from lora_cluster.config.engine import default_disk_cache_dir
from lora_cluster.errors import AdapterError, AdapterNotFoundError
from lora_cluster.replica_policy.tier_stats import StoreStats
from lora_cluster.store.admission import AdmissionPolicy, admit_folder
from lora_cluster.store.cpu_policy import single_threaded
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE
from lora_cluster.store.disk_cache import DiskCache
from lora_cluster.store.int8_form import admit_int8_folder, encode, holds_int8_form
from lora_cluster.store.lifecycle import AdapterState, Lifecycle
from lora_cluster.store.ports import ClusterTierPort
from lora_cluster.store.quant import Int8LoraWeights, dequantize, quantize
from lora_cluster.store.source_breaker import SourceBreaker
from lora_cluster.store.sources import AdapterInfo, AdapterSource, Located, open_source

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ColdCopy:
    """What `ColdTiers.read` returns: float weights, the int8 copy for an int8 host tier (else None),
    and the seconds reading them took."""

    weights: LoraWeights
    stored: Int8LoraWeights | None
    seconds: float


class ColdTiers:
    def __init__(
        self,
        sources: Iterable[str | AdapterSource],
        policy: AdmissionPolicy,
        *,
        stats: StoreStats,
        lifecycle: Lifecycle,
        settle: Callable[[str], None],
        protected: Callable[[str], bool],
        priority: Callable[[str], float],
        disk_cache_dir: str | Path | None,
        disk_cache_bytes: int,
        fetch_retries: int,
        fetch_backoff_s: float,
        fetch_timeout_s: float,
        breaker_failures: int | None,
        breaker_cooldown_s: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        cluster: ClusterTierPort | None = None,
        int8: bool = False,
    ):
        """`settle(adapter_id)`: the store re-settles the adapter's lifecycle state after a disk copy is
        dropped; `protected`/`priority`: the disk cache's victim policy (the store's usage); `cluster`:
        the cluster tier, if the caller wired one; `int8`: the host tier keeps int8 copies (the stored
        form this node publishes and asks the cluster tier for)."""
        self.cluster, self.int8 = cluster, int8
        self.form = "int8" if int8 else "files"
        self.policy, self.stats, self.lifecycle, self._settle = policy, stats, lifecycle, settle
        self._disk: DiskCache | None = None
        self._disk_args = (Path(disk_cache_dir).expanduser() if disk_cache_dir else default_disk_cache_dir(),
                           disk_cache_bytes, protected, priority, clock)
        self._remote = {"retries": fetch_retries, "backoff_s": fetch_backoff_s, "timeout_s": fetch_timeout_s,
                        "sleep": sleep, "on_retry": self._count_retry}
        self.sources: list[AdapterSource] = [
            self.open(s) if isinstance(s, str) else s for s in sources]
        self.source_uris = [s.uri for s in self.sources]
        self.breakers: dict[str, SourceBreaker] = {}  # remote source uri -> its breaker
        if breaker_failures is not None:
            self.breakers = {s.uri: SourceBreaker(s.uri, breaker_failures, breaker_cooldown_s, clock)
                             for s in self.sources if s.remote}
        self._lock = threading.Lock()
        self._in_place: set[str] = set()  # read in place from a local folder or the hub cache

    def open(self, location: str) -> AdapterSource:
        """The source of a URI (a folder, file://, s3:// or hf://), with the store's retry policy."""
        return open_source(location, **self._remote)

    def _count_retry(self, error: BaseException, attempt: int) -> None:
        self.stats.add("source", "retries")
        log.info("retrying a source request (attempt %d failed: %s)", attempt, error)

    @property
    def disk(self) -> DiskCache:
        """The disk cache, created (and scanned) on first use by a remote source."""
        with self._lock:
            if self._disk is None:
                folder, budget, protected, priority, clock = self._disk_args
                self._disk = DiskCache(folder, budget, protected=protected, priority=priority,
                                       on_evict=self._settle, stats=self.stats, clock=clock)
            return self._disk

    # ----- queries and commands of the store ------------------------------------------------

    def reads_in_place(self, adapter_id: str, source: AdapterSource) -> bool:
        """`source` is read in place (a local folder or the hub cache), or the adapter was so read."""
        with self._lock:
            return adapter_id in self._in_place or not source.remote

    def on_disk(self, adapter_id: str) -> bool:
        """A disk copy, or its in-place folder, holds the adapter (never creates the disk cache)."""
        with self._lock:
            in_place = adapter_id in self._in_place
        disk = self._disk
        return in_place or (disk is not None and bool(disk.adapter_keys(adapter_id)))

    def forget(self, adapter_id: str) -> None:
        """Drop the adapter's disk copies and its in-place mark (the store settles it afterwards)."""
        if self._disk is not None:
            for key in self._disk.adapter_keys(adapter_id):
                self._disk.remove(key)
        with self._lock:
            self._in_place.discard(adapter_id)

    def adapter_ids(self) -> Iterator[str]:
        """Ids the sources offer, in source order (duplicates possible; the caller keeps the first)."""
        for found in self._listings(lambda source: source.adapter_ids()):
            yield from found

    def describe_adapters(self) -> list[AdapterInfo]:
        """What the sources offer (rank, target modules, size, checksum), first source wins, without
        reading weights. A source that cannot be listed is logged and skipped."""
        infos: dict[str, AdapterInfo] = {}
        for found in self._listings(lambda source: source.adapters()):
            for info in found:
                infos.setdefault(info.adapter_id, info)
        return list(infos.values())

    def _listings(self, list_one: Callable[[AdapterSource], Iterable[T]]) -> Iterator[Iterable[T]]:
        """`list_one(source)` for each source in order; a source that cannot be listed is counted,
        logged and skipped."""
        for source in self.sources:
            try:
                found = list_one(source)
            except Exception as e:
                self.stats.add("source", "failures")
                log.warning("cannot list adapters of %s: %s", source.uri, e)
                continue
            yield found

    # ----- reading --------------------------------------------------------------------------

    def locate(self, adapter_id: str) -> tuple[AdapterSource, Located]:
        """The first configured source that offers `adapter_id` (see the module docstring)."""
        for source in self.sources:
            if hasattr(source, "fetch") and self._disk_key(source, adapter_id) in self.disk:
                return source, Located(adapter_id)  # cached: no network round trip
            located = self._guarded(source, adapter_id, lambda s=source: s.locate(adapter_id, adapter_id))
            if located is not None:
                return source, located
        where = "the configured adapter sources" if self.source_uris else "any source (none is configured)"
        raise AdapterNotFoundError(adapter_id, f"not found in {where}")

    def read(self, adapter_id: str, source: AdapterSource, located: Located) -> ColdCopy:
        """The admitted weights of `adapter_id` from `source` (see `ColdCopy`)."""
        if not hasattr(source, "fetch"):  # local folder or hub cache: read in place
            folder, digests = source.local_folder(adapter_id, located)  # type: ignore[attr-defined]
            with self._lock:
                self._in_place.add(adapter_id)
            self.lifecycle.ensure(adapter_id, AdapterState.ON_DISK)
            self.lifecycle.promote(adapter_id, AdapterState.ON_DISK)
            return self._admit(adapter_id, folder, {}, digests, cached=False)
        disk, key = self.disk, self._disk_key(source, located.subpath)
        with disk.open(key) as entry:
            if entry is not None:
                self.stats.add("disk", "hits")
                self.lifecycle.promote(adapter_id, AdapterState.ON_DISK)
                try:
                    return self._admit(adapter_id, entry.path, entry.digests)
                except AdapterError as e:
                    log.warning("disk cache copy of %r refused (%s); fetching it again", adapter_id, e.reason)
                    disk.remove(key)
                    self._settle(adapter_id)
        self.stats.add("disk", "misses")
        if not located.files:
            subpath = located.subpath
            located = (self._guarded(source, adapter_id, lambda: source.locate(adapter_id, subpath))
                       or _not_found(adapter_id, source))
        if self.cluster is not None:
            try:
                copied = self._download(adapter_id, source, located, key, self.cluster)
            except AdapterError as e:
                if not isinstance(e, _RefusedPeerCopy):
                    raise
                log.warning("cluster tier copy of %r refused (%s); fetching it from the source", adapter_id,
                            e.reason)
            else:
                return copied
        return self._download(adapter_id, source, located, key, None)

    def _download(self, adapter_id: str, source: AdapterSource, located: Located, key: str,
                  cluster: ClusterTierPort | None) -> ColdCopy:
        """Fill the disk entry `key` from `cluster` (another node's copy; None: skipped) or else the
        source, admit it, and publish a source copy. A peer's copy that fails admission is dropped and
        raised as `_RefusedPeerCopy` (the caller then asks the source); anything else is raised."""
        disk, start, via_cluster = self.disk, time.monotonic(), False

        def fetch(dest: Path) -> dict[str, str]:
            nonlocal via_cluster
            copied = None if cluster is None else cluster.fetch_into(adapter_id, dest, self.form)
            if copied is not None:
                via_cluster = True
                return copied
            return self._guarded(source, adapter_id, lambda: source.fetch(adapter_id, located, dest))

        try:
            with disk.fill(key, adapter_id, fetch) as entry:
                seconds = time.monotonic() - start
                self.stats.record_load("cluster" if via_cluster else "source", seconds, entry.nbytes)
                if not entry.transient:
                    self.stats.record_load("disk", seconds, entry.nbytes)
                self.lifecycle.promote(adapter_id, AdapterState.ON_DISK)
                try:
                    admitted = self._admit(adapter_id, entry.path, entry.digests)
                except AdapterError as e:
                    disk.remove(key)  # never keep what cannot be served
                    self._settle(adapter_id)
                    if via_cluster:
                        raise _RefusedPeerCopy(adapter_id, e.reason) from e
                    raise
                if self.cluster is not None and not via_cluster:  # admitted: offered to the others, once
                    self._publish(self.cluster, adapter_id, entry.path, entry.digests, admitted)
                return admitted
        except AdapterError as e:
            self.stats.add("cluster" if isinstance(e, _RefusedPeerCopy) else "source", "failures")
            raise

    def _guarded(self, source: AdapterSource, adapter_id: str, call: Callable[[], T]) -> T:
        """`call()` (a network call to `source`) through the source's breaker, if it has one."""
        breaker = self.breakers.get(source.uri)
        return call() if breaker is None else breaker.call(adapter_id, call)

    @staticmethod
    def _disk_key(source: AdapterSource, subpath: str) -> str:
        return DiskCache.key_for(source.uri, subpath)

    def _admit(self, adapter_id: str, folder: Path, known: dict[str, str],
               declared: dict[str, str] | None = None, *, cached: bool = True) -> ColdCopy:
        """Admit `folder` (the source's files, or in a disk-cache entry, `cached`, the int8 form a peer
        published); with `int8`, the int8 copy is quantized here once (or taken as received), never
        again by the host tier."""
        start = time.monotonic()
        with single_threaded():
            if cached and holds_int8_form(folder):
                stored: Int8LoraWeights | None = admit_int8_folder(adapter_id, folder, self.policy, known)
                weights = dequantize(stored)
            else:
                weights = admit_folder(adapter_id, folder, self.policy, known, declared)
                stored = quantize(weights) if self.int8 else None
        return ColdCopy(weights, stored if self.int8 else None, time.monotonic() - start)

    def _publish(self, cluster: ClusterTierPort, adapter_id: str, folder: Path, digests: dict[str, str],
                 admitted: ColdCopy) -> None:
        """Offer this node's stored form of an admitted source copy to the cluster tier (see the module
        docstring); the files are read now, while the disk entry is leased."""
        try:
            if admitted.stored is None:
                files = {name: (folder / name).read_bytes() for name in digests}
            else:
                encrypted = (folder / ENC_WEIGHTS_FILE).is_file() or self.policy.require_encryption
                files = encode(admitted.stored, (folder / CONFIG_FILE).read_bytes(),
                               self.policy.key if encrypted else None)
        except OSError as e:
            log.warning("cannot read %r to publish it: %s", adapter_id, e)
            return
        cluster.publish(adapter_id, files, self.form)


class _RefusedPeerCopy(AdapterError):
    """A copy from the cluster tier passed its checksums but not admission (the source serves)."""


def _not_found(adapter_id: str, source: AdapterSource) -> Located:
    raise AdapterNotFoundError(adapter_id, "not found in its source any more")

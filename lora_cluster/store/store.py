"""The tiered adapter store: the default `AdapterStore` (`store.ports`).

    device slots (engine AdapterPool)  <-  host memory (HostCache)  <-  local disk (DiskCache)  <-  source

`load(adapter_id)` (blocking, thread-safe, called from the engine's loader threads, never from the
step loop) returns validated host weights, from the fastest tier that has them:
1. host hit: the cached copy, no I/O;
2. otherwise one *single flight* per adapter (32 concurrent callers: one download, one parse):
   resolve the adapter (registered location first, then `adapter_source` in order), read it through
   the tiers below host memory (`cold_tiers`: the disk cache, the sources, the admission checks),
   keep a host copy, and return it.
A failed load raises an `AdapterError` naming the adapter and the reason and leaves nothing cached
(a download that fails admission is dropped from the disk cache); the next call retries. An id
that no source offers is remembered as missing for `negative_cache_ttl_s` in a bounded LRU
(`NegativeCache`), answered at once meanwhile, and leaves no other record (access history,
lifecycle): every structure keyed by adapter id holds only adapters that exist, or is bounded.

Merged adapters (`define_merge`, see `merge` and `merged`): a merge's id `merged/<hash>` loads by
merging its adapters' weights, each fetched through the tiers as above; the result is kept in the
host tier under the merged id (its version follows its adapters' versions) and never on disk.

Versions (`version(adapter_id)`, see `versions.Versions`): `register`, `unregister` and
`invalidate` bump the id's version; weights carry the version current when their load began, so
the engine never serves a changed adapter from an older copy in a device slot.

The device pool consults `slot_policy()` (the store's `AdapterUsage`) to choose victims; the engine
reports request starts/finishes (`request_started`/`request_finished`), so no tier evicts an
adapter a queued or running request uses, or a pinned one; and `load_abandoned` when weights it
fetched will not be placed, so they count as an ordinary host-tier entry again. `preload` and
`pinned` adapters are loaded into host memory in the background at start, and a hot adapter (>=
`prefetch_min_requests` requests in `prefetch_window_s`) that sits on the device without a host
copy is copied back to host memory in the background, so that losing its device slot costs a
host-to-device copy rather than a disk read. Adapters are treated as immutable per version: to
change one, register it again (or call `invalidate`), which drops its cached copies and bumps its
version. Each remote source has a circuit breaker (`cold_tiers`): while it is open, cold loads from
that source fail at once, and cached adapters keep serving. Its torch work runs on one intra-op
thread per calling thread (`cpu_policy`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.errors import AdapterError, AdapterLoadError, AdapterNotFoundError
from lora_cluster.progress import track_futures
from lora_cluster.replica_policy.eviction import AccessTracker
from lora_cluster.replica_policy.tier_stats import StoreStats
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.cold_tiers import ColdTiers
from lora_cluster.store.cpu_policy import single_threaded
from lora_cluster.store.crypto import load_key
from lora_cluster.store.disk_cache import DiskCache
from lora_cluster.store.host_cache import HostCache
from lora_cluster.store.lifecycle import AdapterState, Lifecycle, LifecycleError
from lora_cluster.store.merged import MergedAdapters
from lora_cluster.store.negative_cache import NegativeCache
from lora_cluster.store.single_flight import SingleFlight
from lora_cluster.store.sources import AdapterInfo, AdapterSource, Located
from lora_cluster.store.usage import AdapterUsage
from lora_cluster.store.versions import Versions

if TYPE_CHECKING:
    from lora_cluster.config import EngineConfig
    from lora_cluster.store.ports import ClusterTierPort, SlotPolicy

log = logging.getLogger(__name__)
GiB = 1 << 30


class TieredAdapterStore:
    """The tiered `AdapterStore` (see the module docstring)."""

    def __init__(
        self,
        sources: Iterable[str | AdapterSource],
        policy: AdmissionPolicy,
        *,
        host_cache_bytes: int = 4 * GiB,
        host_int8: bool = False,
        pin_memory: bool = False,
        disk_cache_dir: str | Path | None = None,
        disk_cache_bytes: int = 20 * GiB,
        pinned: Iterable[str] = (),
        preload: Iterable[str] = (),
        prefetch_window_s: float = 60.0,
        prefetch_min_requests: int = 4,
        fetch_retries: int = 3,
        fetch_backoff_s: float = 0.5,
        fetch_timeout_s: float = 60.0,
        negative_cache_ttl_s: float = 5.0,
        source_breaker_failures: int | None = 3,
        source_breaker_cooldown_s: float = 10.0,
        max_merged_adapters: int = 256,
        merge_seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        cluster_tier: ClusterTierPort | None = None,  # another node's copies (`cold_tiers`), if wired
    ):
        self.stats = StoreStats()
        self.lifecycle = Lifecycle()
        self.versions = Versions()
        self.missing = NegativeCache(negative_cache_ttl_s, clock=clock)
        tracker = AccessTracker(prefetch_window_s, prefetch_min_requests, clock)
        self.usage = AdapterUsage(tracker, pinned, stats=self.stats, on_request=self._on_request,
                                  on_residency=self._on_residency)
        self.host = HostCache(host_cache_bytes, int8=host_int8, pin=pin_memory,
                              protected=self.usage.protected, priority=self.usage.priority,
                              on_evict=self._settle, stats=self.stats, clock=clock)
        self.cold = ColdTiers(  # a source is a URI (opened there) or an opened `AdapterSource`
            sources, policy, stats=self.stats, lifecycle=self.lifecycle, settle=self._settle,
            protected=self.usage.protected, priority=self.usage.priority, disk_cache_dir=disk_cache_dir,
            disk_cache_bytes=disk_cache_bytes, fetch_retries=fetch_retries, fetch_backoff_s=fetch_backoff_s,
            fetch_timeout_s=fetch_timeout_s, breaker_failures=source_breaker_failures,
            breaker_cooldown_s=source_breaker_cooldown_s, clock=clock, sleep=sleep, cluster=cluster_tier,
            int8=host_int8)
        self._registered: dict[str, tuple[AdapterSource, Located]] = {}
        self._flight: SingleFlight[LoraWeights] = SingleFlight()
        self._lock = threading.Lock()
        self._unplaced: set[str] = set()  # host weights returned by `load`, not yet placed on the device
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="adapter-prefetch")
        self._prefetches: dict[str, Future[None]] = {}
        self.merged = MergedAdapters(
            max_entries=max_merged_adapters, load=self._fetch, version=self.versions.get,
            versions=self.versions, in_use=self.usage.protected, module_order=list(policy.shapes.modules),
            max_rank=policy.max_rank, seed=merge_seed)
        warming = [self.prefetch(adapter_id) for adapter_id in dict.fromkeys([*pinned, *preload])]
        track_futures(warming, desc="preloading adapters", unit="adapter")  # a bar on a terminal only

    @classmethod
    def from_config(cls, config: EngineConfig, shapes: ModelShapes, device: torch.device,
                    cluster_tier: ClusterTierPort | None = None) -> TieredAdapterStore:
        policy = AdmissionPolicy(
            shapes=shapes, max_rank=config.max_lora_rank, base_model=config.model,
            base_model_check=config.base_model_check,
            key=load_key(config.encryption_key_env, config.encryption_key_file),
            require_encryption=config.require_encryption, require_checksum=config.require_checksum,
        )
        return cls(
            config.adapter_source, policy,
            host_cache_bytes=config.host_cache_bytes, host_int8=config.host_int8,
            pin_memory=config.host_pin_memory and device.type == "cuda",
            disk_cache_dir=config.disk_cache_dir, disk_cache_bytes=config.disk_cache_bytes,
            pinned=config.pinned, preload=config.preload,
            prefetch_window_s=config.prefetch_window_s, prefetch_min_requests=config.prefetch_min_requests,
            fetch_retries=config.fetch_retries, fetch_backoff_s=config.fetch_backoff_s,
            fetch_timeout_s=config.fetch_timeout_s, negative_cache_ttl_s=config.negative_cache_ttl_s,
            source_breaker_failures=config.breaker_source_failures if config.breakers else None,
            source_breaker_cooldown_s=config.breaker_source_cooldown_s,
            max_merged_adapters=config.max_merged_adapters, merge_seed=config.merge_seed,
            cluster_tier=cluster_tier,
        )

    @property
    def disk(self) -> DiskCache:
        """The disk cache, created (and scanned) on first use by a remote source."""
        return self.cold.disk

    @property
    def sources(self) -> list[AdapterSource]:
        """The configured sources, in order."""
        return self.cold.sources

    # ----- WeightSource -------------------------------------------------------------------

    def load(self, adapter_id: str) -> LoraWeights:
        """Validated host weights of `adapter_id` (see the module docstring); raises AdapterError."""
        check_adapter_id(adapter_id)
        merged = self.merged.spec(adapter_id) is not None
        if not merged:
            self.missing.check(adapter_id)
        with self._lock:  # before the flight lands, so no eviction in between reads as "gone from host"
            self._unplaced.add(adapter_id)
        try:
            return self._load_merged(adapter_id) if merged else self._fetch(adapter_id)
        except BaseException:
            with self._lock:
                self._unplaced.discard(adapter_id)
            raise

    def version(self, adapter_id: str) -> int:
        if self.merged.spec(adapter_id) is not None:
            return self.merged.version(adapter_id)
        return self.versions.get(adapter_id)

    # ----- ResidencyHooks -----------------------------------------------------------------

    def slot_policy(self) -> SlotPolicy:
        return self.usage

    def request_started(self, adapter_id: str) -> None:
        self.usage.request_started(adapter_id)

    def request_finished(self, adapter_id: str) -> None:
        self.usage.request_finished(adapter_id)

    def load_abandoned(self, adapter_id: str) -> None:
        """Weights `load` returned will not be placed: they are an ordinary host-tier entry again."""
        with self._lock:
            self._unplaced.discard(adapter_id)
        self._settle(adapter_id)

    # ----- AdapterCatalog -----------------------------------------------------------------

    def list_adapters(self) -> list[str]:
        """Registered ids, then what the sources offer (first source wins), from listings alone: no
        config is read, so listing thousands of adapters on S3 costs its paginated key listing."""
        ids: dict[str, None] = dict.fromkeys(self._registered)
        for adapter_id in self.cold.adapter_ids():
            ids.setdefault(adapter_id, None)
        return list(ids)

    def register(self, adapter_id: str, location: str) -> None:
        """Serve `adapter_id` from `location` (a folder, file://, s3:// or hf:// URI of the adapter
        itself); loads and validates it before returning (which also warms the caches)."""
        check_adapter_id(adapter_id)
        source = self.cold.open(location)
        located = source.locate(adapter_id, "")
        if located is None:
            raise AdapterNotFoundError(adapter_id, f"no adapter at {location}")
        with self._lock:
            old = self._registered.get(adapter_id)
            self._registered[adapter_id] = (source, located)
        self.missing.discard(adapter_id)
        self.invalidate(adapter_id)
        try:
            self._fetch(adapter_id)
        except BaseException:
            with self._lock:
                if old is None:
                    self._registered.pop(adapter_id, None)
                else:
                    self._registered[adapter_id] = old
            self.invalidate(adapter_id)
            raise

    def unregister(self, adapter_id: str) -> bool:
        check_adapter_id(adapter_id)
        with self._lock:
            found = self._registered.pop(adapter_id, None) is not None
        if found:
            self.invalidate(adapter_id)
        return found

    def define_merge(self, spec: MergeSpec) -> str:
        """Remember a merge (see `merged.MergedAdapters`); returns its adapter id. No I/O."""
        return self.merged.define(spec)

    # ----- counters (StoreCounters), close ------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Counters per tier, the number of adapters in each lifecycle state, and the sizes of the
        structures keyed by adapter id (all bounded; for metrics)."""
        states: dict[str, int] = {s.name: 0 for s in AdapterState}
        for state in self.lifecycle.states().values():
            states[state.name] += 1
        with self._lock:
            unplaced = len(self._unplaced)
        tracked = {"access_history": len(self.usage.tracker), "lifecycle": len(self.lifecycle),
                   "unplaced": unplaced, "missing": len(self.missing), "versions": len(self.versions),
                   "in_use": self.usage.num_in_use()}
        breakers = {b.name: b.snapshot() for b in self.cold.breakers.values()}
        return {"tiers": self.stats.snapshot(), "states": states, "tracked": tracked, "breakers": breakers}

    def close(self) -> None:
        self._prefetcher.shutdown(wait=False, cancel_futures=True)

    # ----- extras -------------------------------------------------------------------------

    def describe_adapters(self) -> list[AdapterInfo]:
        """What the sources offer, without reading weights (`ColdTiers.describe_adapters`)."""
        return self.cold.describe_adapters()

    def prefetch(self, adapter_id: str) -> Future[None]:
        """Load `adapter_id` into host memory in the background (errors are logged, not raised)."""
        with self._lock:
            future = self._prefetches.get(adapter_id)
            if future is None or future.done():
                if len(self._prefetches) >= 1024:  # bounded: ended prefetches go first
                    self._prefetches = {a: f for a, f in self._prefetches.items() if not f.done()}
                future = self._prefetcher.submit(self._prefetch_one, adapter_id)
                self._prefetches[adapter_id] = future
            return future

    def invalidate(self, adapter_id: str) -> None:
        """Drop every cached copy of `adapter_id` and bump its version (the engine then drops its
        device copy before the next request uses it)."""
        self.versions.bump(adapter_id)
        self.host.remove(adapter_id)
        self.cold.forget(adapter_id)
        self._settle(adapter_id)

    def state(self, adapter_id: str) -> AdapterState | None:
        return self.lifecycle.state(adapter_id)

    def wait_prefetches(self, timeout: float | None = None) -> None:
        with self._lock:
            futures = list(self._prefetches.values())
        for future in futures:
            future.result(timeout)

    # ----- loading --------------------------------------------------------------------------

    def _fetch(self, adapter_id: str) -> LoraWeights:
        check_adapter_id(adapter_id)
        weights = self._host_get(adapter_id)
        if weights is not None:
            self.stats.add("host", "hits")
            return weights
        weights, joined = self._flight.do(adapter_id, lambda: self._load_cold(adapter_id))
        if joined:
            self.stats.add("host", "coalesced")
        return weights

    def _load_merged(self, merged_id: str) -> LoraWeights:
        """A merged adapter: its host copy if current, else built from its adapters' copies (one flight
        per merge) and kept in the host tier. Merged adapters have no lifecycle entry (no source tier)."""
        weights = self._host_get(merged_id)
        if weights is not None and weights.version == self.version(merged_id):
            self.stats.add("host", "hits")
            return weights
        if weights is not None:
            self.host.remove(merged_id)

        def build() -> LoraWeights:
            start = time.monotonic()
            with single_threaded():
                built = self.merged.build(merged_id)
                self.host.put(built, time.monotonic() - start)
            return built

        self.stats.add("host", "misses")
        weights, joined = self._flight.do(merged_id, build)
        if joined:
            self.stats.add("host", "coalesced")
        return weights

    def _host_get(self, adapter_id: str) -> LoraWeights | None:
        if not self.host.int8:
            return self.host.get(adapter_id)
        with single_threaded():  # dequantization
            return self.host.get(adapter_id)

    def _load_cold(self, adapter_id: str) -> LoraWeights:
        weights = self._host_get(adapter_id)  # a flight that landed just before this one began
        if weights is not None:
            self.stats.add("host", "hits")
            return weights
        self.stats.add("host", "misses")
        tracked = False
        version = self.versions.get(adapter_id)
        try:
            source, located = self._resolve(adapter_id)
            in_place = self.cold.reads_in_place(adapter_id, source)
            self.lifecycle.ensure(adapter_id, AdapterState.ON_DISK if in_place else AdapterState.REMOTE)
            tracked = True
            copy = self.cold.read(adapter_id, source, located)
        except AdapterNotFoundError:
            self.stats.add("host", "failures")
            self._forget_missing(adapter_id)
            raise
        except Exception as e:
            self.stats.add("host", "failures")
            if tracked:
                self.lifecycle.fail(adapter_id)
            if isinstance(e, AdapterError):
                raise
            log.error("loading adapter %r failed", adapter_id, exc_info=e)
            reason = f"loading failed ({type(e).__name__}; see the server log)"
            raise AdapterLoadError(adapter_id, reason) from e
        weights, seconds = copy.weights, copy.seconds
        weights.version = version
        self.stats.record_load("host", seconds, weights.nbytes)
        self.lifecycle.promote(adapter_id, AdapterState.IN_HOST)
        with single_threaded():
            self.host.put(weights, seconds, stored=copy.stored)
        return weights

    def _forget_missing(self, adapter_id: str) -> None:
        """No source offers `adapter_id`: remember that briefly, keep no other record of it."""
        with self._lock:
            registered = adapter_id in self._registered
        if registered:
            return
        self.missing.add(adapter_id)
        self.lifecycle.forget(adapter_id)
        self.usage.tracker.forget(adapter_id)

    def _resolve(self, adapter_id: str) -> tuple[AdapterSource, Located]:
        """Its registered location, else the first configured source that offers it."""
        with self._lock:
            registered = self._registered.get(adapter_id)
        return registered if registered is not None else self.cold.locate(adapter_id)

    def _prefetch_one(self, adapter_id: str) -> None:
        try:
            self._fetch(adapter_id)
        except Exception as e:
            log.warning("prefetch of adapter %r failed: %s", adapter_id, e)
        else:
            self._settle(adapter_id)  # the host tier may have refused the copy

    # ----- lifecycle bookkeeping ------------------------------------------------------------

    def _best_tier(self, adapter_id: str) -> AdapterState:
        if self.usage.on_device_now(adapter_id):
            return AdapterState.ON_DEVICE
        with self._lock:
            unplaced = adapter_id in self._unplaced
        if unplaced or adapter_id in self.host:
            return AdapterState.IN_HOST
        if self.cold.on_disk(adapter_id):
            return AdapterState.ON_DISK
        return AdapterState.REMOTE

    def _settle(self, adapter_id: str) -> None:
        self.lifecycle.settle(adapter_id, self._best_tier(adapter_id))

    def _on_residency(self, adapter_id: str, resident: bool) -> None:
        if not resident:
            self._settle(adapter_id)
            return
        with self._lock:
            self._unplaced.discard(adapter_id)
        try:
            self.lifecycle.promote(adapter_id, AdapterState.ON_DEVICE)
        except LifecycleError as e:  # weights placed that did not come through this store
            log.debug("lifecycle: %s", e)

    def _on_request(self, adapter_id: str) -> None:
        """Promotion: a hot adapter on the device without a host copy gets one in the background."""
        if (self.usage.tracker.is_hot(adapter_id) and self.usage.on_device_now(adapter_id)
                and adapter_id not in self.host and not self._flight.in_flight(adapter_id)):
            self.prefetch(adapter_id)

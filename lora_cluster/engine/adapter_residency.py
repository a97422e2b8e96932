"""Getting a request's adapter onto the device without ever blocking the step loop.

The engine's scheduler asks `acquire(seq, may_claim_slot)` for each waiting sequence:

- base-model sequences and adapters whose current version is in a device slot are READY (a
  reference is taken);
- otherwise the adapter's host weights are fetched by the loader on a small thread pool (one
  fetch per adapter however many sequences wait for it) and the sequence is PENDING meanwhile;
- once fetched, the weights go into a free or evictable slot (READY), or the sequence is BLOCKED
  while every slot is held by running sequences (or while an earlier sequence is blocked);
- a failed fetch fails every sequence waiting for that adapter in the same step (FAILED, with
  the adapter's error); the next request for it tries again.

Versions: the loader's `version(adapter_id)` changes when what the id names changes (re-registered,
unregistered). A slot or a finished fetch of an older version is never used for a new request: an
idle stale slot is evicted, a busy one retired (its running sequences finish on the old weights),
and the fetch is started again.

Bounds: this object holds host weights outside the loader's byte budgets only while a request
waits for them. A fetch is kept while an unfinished request of its adapter exists or an explicit
`start_load` awaits it; when the last request of an adapter goes away, a queued fetch is cancelled
and a finished one dropped (the loader is told with `load_abandoned`, so its host tier accounts for
the copy again). Every structure here is keyed by adapters of unfinished requests or of fetches in
flight, never by every id a client ever asked for.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.engine.adapter_pool import AdapterPool
from lora_cluster.engine.loader import AdapterLoader
from lora_cluster.engine.scheduler import Gate
from lora_cluster.engine.sequence import Sequence
from lora_cluster.errors import AdapterError

log = logging.getLogger(__name__)


class AdapterResidency:
    def __init__(self, loader: AdapterLoader, pool: AdapterPool, workers: int):
        self.loader, self.pool = loader, pool
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="adapter-load")
        self._loads: dict[str, Future[LoraWeights]] = {}  # host fetches in flight or done, not yet on device
        self._requests: dict[str, int] = {}  # unfinished requests per adapter
        self._explicit: set[str] = set()  # fetches started by `start_load` (an admin call awaits them)
        self._failed: dict[str, AdapterError] = {}  # failures seen during the current step

    # ----- fetches --------------------------------------------------------------------------

    def fetch(self, adapter_id: str) -> Future[LoraWeights]:
        """The adapter's host fetch of its current version, started now unless one is in flight or done."""
        future = self._loads.get(adapter_id)
        if future is not None and self._is_stale(adapter_id, future):
            future = None
        if future is None:
            future = self._executor.submit(self.loader.load, adapter_id)
            self._loads[adapter_id] = future
        return future

    def start_load(self, adapter_id: str) -> Future[LoraWeights]:
        """`fetch` for a caller that awaits the result without a request (kept until the next step)."""
        self._explicit.add(adapter_id)
        return self.fetch(adapter_id)

    def _is_stale(self, adapter_id: str, future: Future[LoraWeights]) -> bool:
        if not future.done() or future.exception() is not None:
            return False
        return future.result().version != self.loader.version(adapter_id)

    def forget_failed(self, adapter_id: str) -> None:
        """Drop a failed fetch so that the next request retries it."""
        future = self._loads.get(adapter_id)
        if future is not None and future.done() and future.exception() is not None:
            del self._loads[adapter_id]

    # ----- scheduler callbacks --------------------------------------------------------------

    def acquire(self, seq: Sequence, may_claim_slot: bool) -> Gate:
        aid = seq.adapter_id
        if aid is None:
            seq.lora_slot = -1
            return Gate.READY
        if self.pool.slot_of(aid) is not None:
            if self.pool.version_of(aid) == self.loader.version(aid):
                seq.lora_slot = self.pool.acquire(aid)
                return Gate.READY
            self._drop_stale_slot(aid)
        if aid in self._failed:
            seq.error = self._failed[aid]
            return Gate.FAILED
        future = self.fetch(aid)
        if not future.done():
            return Gate.PENDING
        try:
            weights = future.result()
        except AdapterError as e:
            del self._loads[aid]
            self._failed[aid] = seq.error = e
            return Gate.FAILED
        except Exception as e:  # a loader bug must fail this adapter, not the engine
            del self._loads[aid]
            log.error("the loader failed on adapter %r", aid, exc_info=e)
            self._failed[aid] = seq.error = AdapterError(aid, f"loading failed ({type(e).__name__})")
            return Gate.FAILED
        if not may_claim_slot or not self.pool.can_allocate():
            return Gate.BLOCKED
        self.pool.allocate(weights)
        del self._loads[aid]
        self._explicit.discard(aid)
        seq.lora_slot = self.pool.acquire(aid)
        return Gate.READY

    def release(self, seq: Sequence) -> None:
        if seq.adapter_id is not None and seq.lora_slot >= 0:
            self.pool.release(seq.lora_slot)
            seq.lora_slot = -1

    def _drop_stale_slot(self, adapter_id: str) -> None:
        if not self.pool.evict(adapter_id):
            self.pool.retire(adapter_id)

    # ----- request bookkeeping --------------------------------------------------------------

    def request_started(self, adapter_id: str | None) -> None:
        """A request for `adapter_id` was queued: start its fetch unless its current version is resident."""
        if adapter_id is None:
            return
        self._requests[adapter_id] = self._requests.get(adapter_id, 0) + 1
        self.loader.request_started(adapter_id)
        if self.pool.version_of(adapter_id) != self.loader.version(adapter_id):
            self.fetch(adapter_id)

    def request_finished(self, adapter_id: str | None) -> None:
        """Once per `request_started`; the adapter's last request gone, its fetch is let go."""
        if adapter_id is None:
            return
        n = self._requests.get(adapter_id, 0) - 1
        if n > 0:
            self._requests[adapter_id] = n
        else:
            self._requests.pop(adapter_id, None)
            self._let_go(adapter_id)
        self.loader.request_finished(adapter_id)

    def _let_go(self, adapter_id: str) -> None:
        """Drop a fetch nobody waits for: cancel it if still queued, hand finished weights back."""
        if adapter_id in self._requests or adapter_id in self._explicit:
            return
        future = self._loads.get(adapter_id)
        if future is None:
            return
        if not future.done() and not future.cancel():
            return  # running now: dropped by `end_step` once it finishes
        del self._loads[adapter_id]
        if not future.cancelled() and future.exception() is None:
            self.loader.load_abandoned(adapter_id)

    def end_step(self) -> None:
        """Forget this step's failures and let go of finished fetches that nobody waits for."""
        self._failed.clear()
        self._explicit = {a for a in self._explicit if a in self._loads and not self._loads[a].done()}
        for adapter_id in [a for a, f in self._loads.items() if f.done()]:
            self._let_go(adapter_id)

    # ----- queries and commands -------------------------------------------------------------

    def unload(self, adapter_id: str) -> bool:
        """Drop an adapter's pending host copy and device slot; False when a sequence uses it."""
        if adapter_id not in self._requests:
            future = self._loads.pop(adapter_id, None)
            if future is not None:
                future.cancel()
        if self.pool.refs(adapter_id):
            return False
        self.pool.evict(adapter_id)
        return True

    def pending(self) -> list[Future[LoraWeights]]:
        return [f for f in self._loads.values() if not f.done()]

    def has_fetches(self) -> bool:
        """Fetches in flight or finished and not yet placed or let go."""
        return bool(self._loads)

    def loading(self) -> tuple[str, ...]:
        return tuple(a for a, f in self._loads.items() if not f.done())

    def held(self) -> int:
        """Fetches this object holds (in flight or finished, not yet on the device or let go)."""
        return len(self._loads)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

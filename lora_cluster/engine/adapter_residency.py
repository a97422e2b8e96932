"""Getting a request's adapter onto the device without ever blocking the step loop.

The engine's scheduler asks `acquire(seq, may_claim_slot)` for each waiting sequence:

- base-model sequences and adapters already in a device slot are READY (a reference is taken);
- otherwise the adapter's host weights are fetched by the loader on a small thread pool (one
  fetch per adapter however many sequences wait for it) and the sequence is PENDING meanwhile;
- once fetched, the weights go into a free or evictable slot (READY), or the sequence is BLOCKED
  while every slot is held by running sequences (or while an earlier sequence is blocked);
- a failed fetch fails every sequence waiting for that adapter in the same step (FAILED, with
  the adapter's error); the next request for it tries again.

It also tells the loader's usage tracker (the adapter store's, when it has one) when requests
start and stop using an adapter, so no tier evicts what a queued or running request needs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.engine.adapter_pool import AdapterPool
from lora_cluster.engine.loader import AdapterLoader
from lora_cluster.engine.scheduler import Gate
from lora_cluster.engine.sequence import Sequence
from lora_cluster.errors import AdapterError


class AdapterResidency:
    def __init__(self, loader: AdapterLoader, pool: AdapterPool, workers: int):
        self.loader, self.pool = loader, pool
        self.usage = getattr(loader, "usage", None)  # the adapter store's tracker, if any
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="adapter-load")
        self._loads: dict[str, Future[LoraWeights]] = {}  # host fetches in flight or done, not yet on device
        self._failed: dict[str, AdapterError] = {}  # failures seen during the current step

    def fetch(self, adapter_id: str) -> Future[LoraWeights]:
        """The adapter's host fetch, started now unless one is already in flight or done."""
        future = self._loads.get(adapter_id)
        if future is None:
            future = self._executor.submit(self.loader.load, adapter_id)
            self._loads[adapter_id] = future
        return future

    def acquire(self, seq: Sequence, may_claim_slot: bool) -> Gate:
        aid = seq.adapter_id
        if aid is None:
            seq.lora_slot = -1
            return Gate.READY
        if self.pool.slot_of(aid) is not None:
            seq.lora_slot = self.pool.acquire(aid)
            return Gate.READY
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
            self._failed[aid] = seq.error = AdapterError(aid, f"loading failed: {e!r}")
            return Gate.FAILED
        if not may_claim_slot or not self.pool.can_allocate():
            return Gate.BLOCKED
        self.pool.allocate(weights)
        del self._loads[aid]
        seq.lora_slot = self.pool.acquire(aid)
        return Gate.READY

    def release(self, seq: Sequence) -> None:
        if seq.adapter_id is not None and seq.lora_slot >= 0:
            self.pool.release(seq.adapter_id)
            seq.lora_slot = -1

    def end_step(self) -> None:
        self._failed.clear()

    def forget_failed(self, adapter_id: str) -> None:
        """Drop a failed fetch so that the next request retries it."""
        future = self._loads.get(adapter_id)
        if future is not None and future.done() and future.exception() is not None:
            del self._loads[adapter_id]

    def unload(self, adapter_id: str) -> bool:
        """Drop an adapter's pending host copy and device slot; False when a sequence uses it."""
        self._loads.pop(adapter_id, None)
        if self.pool.refs(adapter_id):
            return False
        self.pool.evict(adapter_id)
        return True

    def pending(self) -> list[Future[LoraWeights]]:
        return [f for f in self._loads.values() if not f.done()]

    def loading(self) -> tuple[str, ...]:
        return tuple(a for a, f in self._loads.items() if not f.done())

    def request_started(self, adapter_id: str | None) -> None:
        if adapter_id is not None and self.usage is not None:
            self.usage.request_started(adapter_id)

    def request_finished(self, adapter_id: str | None) -> None:
        if adapter_id is not None and self.usage is not None:
            self.usage.request_finished(adapter_id)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Host-to-device adapter copies that overlap the engine's compute.

`AdapterCopier.place(weights)` reserves a device slot for an adapter (`AdapterPool.reserve`) and
copies the weights into it: inline when they are smaller than `async_bytes`, otherwise on one copy
thread, tracked until `settle` (called on the step thread) commits the slot. The copy thread:

- on CUDA the copy runs on a side stream that first waits for everything the submitting thread's
  current stream had queued (a reused slot may still be read by the last forward of its previous
  adapter), and the copy thread synchronizes the side stream before completing the future; the
  step loop's stream keeps running forward passes meanwhile;
- on CPU the copy thread simply runs the copy while the step thread computes (torch releases the
  GIL in its kernels).

Correctness rests on the slot reservation (`AdapterPool.reserve`): nothing reads a reserved slot
until the future completes and the step thread commits it, and the copy writes no other slot.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.engine.adapters.pool import AdapterPool


class AdapterCopier:
    def __init__(self, pool: AdapterPool, device: torch.device, async_bytes: int):
        self.pool, self.device, self.async_bytes = pool, device, async_bytes
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="adapter-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies: dict[str, tuple[int, LoraWeights, Future[None]]] = {}  # bounded by device slots

    @classmethod
    def inline(cls, pool: AdapterPool) -> AdapterCopier:
        """A copier that copies every adapter inline on the step thread (no overlap)."""
        return cls(pool, torch.device("cpu"), async_bytes=sys.maxsize)

    def place(self, weights: LoraWeights) -> bool:
        """Reserve a slot and copy `weights` into it; True when it is live now (copied inline),
        False while the copy runs off the step thread (`settle` commits it)."""
        slot = self.pool.reserve(weights)
        if weights.nbytes < self.async_bytes:
            try:
                self.pool.write(slot, weights)
            except BaseException:
                self.pool.abandon(slot)
                raise
            self.pool.commit(slot, weights)
            return True
        future = self.submit(lambda: self.pool.write(slot, weights))
        self._copies[weights.adapter_id] = (slot, weights, future)
        return False

    def copying(self, adapter_id: str) -> bool:
        return adapter_id in self._copies

    def settle(self) -> dict[str, BaseException]:
        """Commit every finished copy (step thread only); the failed ones are freed and returned."""
        failed: dict[str, BaseException] = {}
        for adapter_id in [a for a, (_, _, f) in self._copies.items() if f.done()]:
            slot, weights, future = self._copies.pop(adapter_id)
            error = None if future.cancelled() else future.exception()
            if error is None and not future.cancelled():
                self.pool.commit(slot, weights)
            else:
                self.pool.abandon(slot)
                failed[adapter_id] = error or RuntimeError("copy cancelled")
        return failed

    def pending(self) -> list[Future[None]]:
        return [f for _, _, f in self._copies.values() if not f.done()]

    def in_flight(self) -> tuple[str, ...]:
        return tuple(self._copies)

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run `fn` off the step thread (see the module docstring)."""
        if self._stream is None:
            return self._executor.submit(fn)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream = self._stream

        def run() -> None:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                fn()
            stream.synchronize()

        return self._executor.submit(run)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

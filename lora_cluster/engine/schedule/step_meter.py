"""The engine's meter: each step's measured time charged to its sequences, adapter slot residency.

`charge` splits a step's wall time over the sequences it ran by `replica_policy.step_cost`'s rule
and adds each share to the sequence's `device_s`, which its `RequestOutput` reports (cumulative:
a preempted and recomputed request keeps its `Sequence`, so its recompute is added to the same
total, never a second one). `busy_s` is the sum of the measured step times; every second of it is
charged to some sequence (conservation: the shares of a step sum to its time).

`charge` also ends each sequence's wait: a sequence that waited (from its arrival, or from a
preemption: `Sequence.waiting_since`, on the scheduler's clock) adds the time until the step began to
its `queue_s`, which its `RequestOutput` reports (cumulative, like `device_s`); the chunks of one
prefill after the first are not waits. `wait_clock` is the scheduler's clock (time.monotonic).

`resided` adds slot-seconds of residency per adapter (the time its weights held a device slot,
whether or not a request ran on it); `loaded` adds an adapter's load time (its host fetch and its
copy into the slot) to the adapter that needed it. `take_residency` and `take_loads` hand them over
and clear them, so each map holds at most the adapters seen since the last take (bounded by
`MAX_TRACKED_ADAPTERS`: past it, the rest are counted under `""`). Written and read on the step
loop's thread only (adapter placement runs there too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.replica_policy.step_cost import SeqWork, split_step

MAX_TRACKED_ADAPTERS = 4096
OVERFLOW = ""  # the key residency past MAX_TRACKED_ADAPTERS is counted under


class StepMeter:
    """Charges step time to sequences and slot time to adapters (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 wait_clock: Callable[[], float] = time.monotonic):
        self.clock, self.wait_clock = clock, wait_clock
        self.busy_s = 0.0  # measured time of the steps that ran a batch, since start
        self._residency: dict[str, float] = {}
        self._loads: dict[str, float] = {}
        self._last_resided: float | None = None

    def charge(self, elapsed_s: float, decodes: Iterable[Sequence],
               prefills: Iterable[tuple[Sequence, int]], rank_of: Callable[[int], int]) -> dict[str, float]:
        """Charge a step of `elapsed_s` to its sequences; returns each one's cumulative `device_s`."""
        seqs: dict[str, Sequence] = {}
        works = []
        for seq in decodes:
            seqs[seq.request_id] = seq
            works.append(SeqWork(seq.request_id, decode_tokens=1, rank=rank_of(seq.lora_slot)))
        for seq, n in prefills:
            seqs[seq.request_id] = seq
            works.append(SeqWork(seq.request_id, prefill_tokens=n, rank=rank_of(seq.lora_slot)))
        self.busy_s += elapsed_s
        began = self.wait_clock() - elapsed_s  # the step's start, on the sequences' clock
        for rid, share in split_step(elapsed_s, works).items():
            seq = seqs[rid]
            seq.device_s += share
            if seq.waiting_since is not None:
                seq.queue_s += max(0.0, began - seq.waiting_since)
                seq.waiting_since = None
        return {rid: seq.device_s for rid, seq in seqs.items()}

    def resided(self, resident: Iterable[str]) -> None:
        """The adapters in `resident` held a slot since the previous call: add that time to each."""
        now = self.clock()
        last, self._last_resided = self._last_resided, now
        if last is None:
            return
        for adapter_id in resident:
            _add(self._residency, adapter_id, now - last)

    def loaded(self, adapter_id: str, seconds: float) -> None:
        """An adapter's fetch and copy into its slot took `seconds`: charge them to it."""
        _add(self._loads, adapter_id, seconds)

    def take_residency(self) -> dict[str, float]:
        """Slot-seconds per adapter since the last take; clears them."""
        taken, self._residency = self._residency, {}
        return taken

    def take_loads(self) -> dict[str, float]:
        """Load seconds per adapter since the last take; clears them."""
        taken, self._loads = self._loads, {}
        return taken


def _add(seconds: dict[str, float], adapter_id: str, dt: float) -> None:
    """Add `dt` to the adapter's entry; past `MAX_TRACKED_ADAPTERS` entries, to `OVERFLOW`'s."""
    key = adapter_id if adapter_id in seconds or len(seconds) < MAX_TRACKED_ADAPTERS else OVERFLOW
    seconds[key] = seconds.get(key, 0.0) + dt


__all__ = ["MAX_TRACKED_ADAPTERS", "OVERFLOW", "StepMeter"]

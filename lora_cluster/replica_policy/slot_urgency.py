"""Which adapter slot a strictly more urgent request may take (pure policy, as `sim.adapters`).

A waiting request of priority p whose adapter is fetched but finds every device slot referenced by
running sequences or kept for queued requests gets one this way:

1. `idle_victim`: a slot without running sequences whose adapter only strictly less urgent (waiting)
   requests want is evicted for it, the least urgent such adapter first; those requests fetch and
   place their adapter again later (`AdapterResidency` queues the fetch at once, so they are not
   stuck);
2. else `busy_victim`: a slot whose adapter only strictly less urgent requests want (running and
   waiting), with the fewest running sequences (then by id): the scheduler preempts those sequences
   (recompute: prompt and output kept, output unchanged) and step 1 then takes the idle slot.

Candidates are the adapters in device slots that may be taken at all: wanted by some request, not
pinned, not being copied. Equal priorities never take each other's slot (adapter rotation shares
slots among them, by draining). O(device slots) per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotHolder:
    """An adapter in a device slot, as this policy sees it."""

    adapter_id: str
    running: int  # sequences using the slot now
    most_urgent: int  # priority of the most urgent unfinished request that wants the adapter


def idle_victim(holders: Iterable[SlotHolder], priority: int) -> str | None:
    """The idle adapter to evict for a request of `priority` (rule 1), or None."""
    idle = [h for h in holders if not h.running and h.most_urgent > priority]
    return max(idle, key=lambda h: (h.most_urgent, h.adapter_id)).adapter_id if idle else None


def busy_victim(holders: Iterable[SlotHolder], priority: int) -> str | None:
    """The adapter whose running sequences to preempt for a request of `priority` (rule 2), or None."""
    busy = [h for h in holders if h.running and h.most_urgent > priority]
    return min(busy, key=lambda h: (h.running, h.adapter_id)).adapter_id if busy else None


__all__ = ["SlotHolder", "busy_victim", "idle_victim"]

"""The pinned-slot bound (PSB): the best hit rate a work-conserving policy without foresight could
reach on a run's completed traffic, when concurrent requests of one adapter share its slot. Pure.

Inputs: C adapter slots in the cluster, B = `max_num_seqs` (requests one slot's replica runs at
once), n_a completed requests of adapter a in the measured window of T seconds, W the mean time a
request holds its adapter's slot (first admission into a running batch to its end), and
x_a = n_a W / T, the adapter's mean number of requests in flight.

Adapters are taken most requested first. Pinning the first k costs S(k) slots and earns H(k) hits:
    S(k) = sum_{i<=k} max(1, ceil(x_i / B)) + sum_{i>k} (1 - exp(-x_i))
    H(k) = sum_{i<=k} n_i               + sum_{i>k} n_i (1 - exp(-x_i))
(a pinned adapter needs a slot on every replica its concurrent requests fill; an unpinned one holds
a slot while any of its requests runs, and its requests that arrive then are hits). k* is the largest
k with S(k) <= C, and the next adapter counts by the share of its slots that still fit. PSB = H / N.
When even S(0) exceeds C (the tail alone needs more slots), H(0) is scaled by C / S(0).

The static ceiling (`static_ceiling`) is the same placement without the tail's slots: the share of the
completed requests whose adapters fit when each takes max(1, ceil(x_a / B)) slots, most requested first
(the next one by the share of its slots that fits). It is what a fixed placement with copies in
proportion to load could hold if the tail pinned no slot; PSB is lower (the tail's requests pin slots
while they run) unless the tail's hits make up for it. The grid's old ceiling, the share of the
offered traffic of the `C` most popular adapters (one slot each, `popularity.zipf_share`), ignores
both the copies and the tail, and counts refused requests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def _counts(completed: Mapping[str, int], slots: int, max_num_seqs: int, window_s: float) -> list[int]:
    """The adapters' completed requests, most first; ValueError for a window, slot count or batch size
    that is not positive."""
    if window_s <= 0 or slots <= 0 or max_num_seqs <= 0:
        raise ValueError(f"window_s={window_s}, slots={slots} and max_num_seqs={max_num_seqs} must be > 0")
    return sorted((n for n in completed.values() if n > 0), reverse=True)


def pinned_slot_bound(completed: Mapping[str, int], slots: int, max_num_seqs: int, hold_s: float,
                      window_s: float) -> float | None:
    """PSB of `completed` (adapter id -> completed requests in the window); None without requests.
    Raises ValueError for a window, slot count or batch size that is not positive."""
    counts = _counts(completed, slots, max_num_seqs, window_s)
    total = sum(counts)
    if not total:
        return None
    x = [n * max(0.0, hold_s) / window_s for n in counts]
    tail_slots = [1.0 - math.exp(-xi) for xi in x]
    pinned_slots = [max(1, math.ceil(xi / max_num_seqs)) for xi in x]
    tail_hits = [n * s for n, s in zip(counts, tail_slots, strict=True)]
    used, hits = sum(tail_slots), sum(tail_hits)  # S(0), H(0)
    if used > slots:
        return hits * slots / used / total
    for i, n in enumerate(counts):  # pin adapter i: S(i+1) = S(i) + pinned - tail, same for H
        more_slots = pinned_slots[i] - tail_slots[i]
        more_hits = n - tail_hits[i]
        if used + more_slots > slots:
            share = (slots - used) / more_slots
            return (hits + share * more_hits) / total
        used, hits = used + more_slots, hits + more_hits
    return hits / total


def static_ceiling(completed: Mapping[str, int], slots: int, max_num_seqs: int, hold_s: float,
                   window_s: float) -> float | None:
    """The static ceiling of `completed` (see the module docstring); None without requests. Raises
    ValueError as `pinned_slot_bound` does."""
    counts = _counts(completed, slots, max_num_seqs, window_s)
    total = sum(counts)
    if not total:
        return None
    used, held = 0, 0.0
    for n in counts:
        need = max(1, math.ceil(n * max(0.0, hold_s) / window_s / max_num_seqs))
        if used + need > slots:
            return (held + n * (slots - used) / need) / total
        used, held = used + need, held + n
    return held / total

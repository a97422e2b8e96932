"""Cumulative counters of one engine, for metrics: steps, batch sizes, tokens, adapter placements.

* `steps`: engine steps that ran a batch; `batched_seqs`: the sequences in those batches (mean
  batch size = batched_seqs / steps over any interval); `sampled_tokens`: tokens sampled (their rate
  is the replica's tokens/s).
* `placements`: adapters put into a device slot (a device-tier load); `switches`: those placements
  that replaced another adapter (an "adapter switch", as the switch-rate alert counts it);
  `placement_failures`: placements that raised; `placement_seconds`: the wall time of each placement
  as the step loop saw it (the copy into the slot, or handing it to the copy thread), a histogram.
* `slots_taken`: idle adapter slots evicted for a strictly more urgent request although less urgent
  waiting requests wanted their adapter (`adapters.residency`'s urgency rule; they fetch it again).

Written by the engine's step loop only; read a consistent copy with `snapshot()` on that thread
(`AsyncEngine.call`). Only grows; bounded (fixed-size histogram).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lora_cluster.replica_policy.tier_stats import LatencyHistogram


@dataclass
class EngineCounters:
    steps: int = 0
    batched_seqs: int = 0
    sampled_tokens: int = 0
    placements: int = 0
    switches: int = 0
    placement_failures: int = 0
    slots_taken: int = 0
    placement_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)

    def step(self, seqs: int, tokens: int) -> None:
        """A step ran `seqs` sequences and sampled `tokens` tokens."""
        self.steps += 1
        self.batched_seqs += seqs
        self.sampled_tokens += tokens

    def placed(self, seconds: float, *, evicted: bool) -> None:
        """An adapter went into a device slot in `seconds` (`evicted`: it replaced another adapter)."""
        self.placements += 1
        self.switches += int(evicted)
        self.placement_seconds.observe(seconds)

    def placement_failed(self) -> None:
        self.placement_failures += 1

    def slot_taken(self) -> None:
        """A wanted idle adapter slot was evicted for a more urgent request."""
        self.slots_taken += 1

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers: every counter, and the placement histogram as `placement_buckets` (per
        bucket of `replica_policy.tier_stats.LOAD_BUCKETS_S`, not cumulative) and
        `placement_seconds_total`."""
        return {
            "steps": self.steps, "batched_seqs": self.batched_seqs, "sampled_tokens": self.sampled_tokens,
            "placements": self.placements, "switches": self.switches,
            "placement_failures": self.placement_failures, "slots_taken": self.slots_taken,
            "placement_buckets": list(self.placement_seconds.counts),
            "placement_seconds_total": self.placement_seconds.sum,
        }

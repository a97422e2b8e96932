"""Continuous batching: which sequences run in the next step, and with how many tokens.

Pure policy, no tensors and no Ray. Every step:
1. each running sequence that has finished its prompt decodes one token;
2. running sequences still in their prompt continue with a chunk (chunked prefill);
3. waiting sequences are admitted in arrival order while a KV slot and token budget remain.
The step's token budget is `max_num_batched_tokens`, so long prompts are split across steps and
decodes are never starved by a prefill.

A waiting sequence is admitted only when its adapter is ready on the device. The engine answers
through the injected `acquire` callback (READY, PENDING while it loads, BLOCKED when every adapter
slot is held by running sequences, FAILED). Sequences whose adapter is pending do not hold up
the others; but once an earlier sequence is BLOCKED, later ones may not claim a new adapter slot
(they may still join with adapters already resident), so a rare adapter is not starved by a
stream of other newcomers.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_cluster.engine.sequence import SeqStatus, Sequence
from lora_cluster.errors import EngineOverloadedError


class Gate(enum.Enum):
    READY = "ready"
    PENDING = "pending"
    BLOCKED = "blocked"
    FAILED = "failed"


# acquire(seq, may_claim_slot) -> Gate; on READY the engine has set seq.lora_slot and holds a reference
AcquireFn = Callable[[Sequence, bool], Gate]
ReleaseFn = Callable[[Sequence], None]


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    failed: list[Sequence] = field(default_factory=list)  # adapter could not be loaded

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Owns the waiting queue, the running set and the KV slot free list."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        acquire: AcquireFn,
        release: ReleaseFn,
    ):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self._acquire, self._release = acquire, release
        self._free_slots = list(range(max_num_seqs))
        heapq.heapify(self._free_slots)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def can_add(self) -> bool:
        return len(self.waiting) < self.max_waiting

    def add(self, seq: Sequence) -> None:
        if not self.can_add():
            raise EngineOverloadedError(
                f"request {seq.request_id!r} refused: {len(self.waiting)} requests already wait "
                f"(max_waiting={self.max_waiting})"
            )
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if not seq.in_prefill:
                out.decodes.append(seq)
                budget -= 1
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                n = min(len(seq.prompt_ids) - seq.num_computed, budget)
                out.prefills.append((seq, n))
                budget -= n
        blocked = False
        still_waiting: list[Sequence] = []
        for seq in self.waiting:
            if not self._free_slots or budget <= 0:
                still_waiting.append(seq)
                continue
            gate = self._acquire(seq, not blocked)
            if gate is Gate.FAILED:
                seq.status = SeqStatus.FINISHED
                out.failed.append(seq)
                continue
            if gate is not Gate.READY:
                blocked = blocked or gate is Gate.BLOCKED
                still_waiting.append(seq)
                continue
            seq.kv_slot = heapq.heappop(self._free_slots)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq.prompt_ids), budget)
            out.prefills.append((seq, n))
            budget -= n
        self.waiting = still_waiting
        return out

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of the queues, returning its KV slot and adapter reference (idempotent)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            heapq.heappush(self._free_slots, seq.kv_slot)
            seq.kv_slot = None
            self._release(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

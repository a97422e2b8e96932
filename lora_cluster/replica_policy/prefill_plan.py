"""Which prefill chunks run in an engine step: the most urgent alone, and less urgent ones short.

Pure policy over the scheduler's sequences (no tensors), used by `engine.schedule.scheduler` once it has
planned the decodes (one token each, always):

1. Most urgent first: running sequences in their prefill get the step's token budget in urgency
   order (priority, then arrival), not in the order they were admitted; one less urgent than the
   most urgent waiting request gets what is left once the waiting requests more urgent than it
   were admitted (`ChunkShare.defer`), so that a request about to preempt it does not wait while
   it computes a prompt it would then lose.
2. Urgent prefills alone: a sequence is *urgent* when its priority is `urgent_priority` or lower
   (the engine's is `URGENT_PRIORITY`, 0: vLLM's default priority and the default `interactive`
   class; None, a bare scheduler's default: nothing is, and rules 2 and 3 are off). A step that
   carries an urgent prefill chunk carries no prefill chunk of a less urgent sequence
   (`drop_less_urgent`); those continue at the next step, and their decodes still run. So the
   step that gives an urgent request its first token computes its prompt plus the decodes, not
   every prompt in flight.
3. Short less urgent chunks: the prefill chunks of sequences that are not urgent take at most
   `less_urgent_chunk` tokens of one step in all (`ChunkShare`; None: only the step budget bounds
   them), in the order of rule 1, and a waiting one is admitted only with a share. A request
   joins the engine between steps, so an urgent request that arrives while a step runs waits for
   that step: a short one, not the prefill of a long prompt, nor the recompute of a preempted
   sequence's prompt and output (which can be several times longer).

Only which step computes a token changes: every sequence's tokens are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, MutableMapping
from typing import Protocol, TypeVar

URGENT_PRIORITY = 0  # this priority or lower is urgent (rules 2 and 3)


class Scheduled(Protocol):
    """What the policy reads of a sequence (the engine's `Sequence`, the simulator's requests)."""

    request_id: str
    priority: int
    arrival_order: int

    @property
    def in_prefill(self) -> bool: ...


Seq = TypeVar("Seq", bound=Scheduled)


def urgency(seq: Scheduled) -> tuple[int, int]:
    """Order key of sequences: smaller is more urgent (priority, then arrival order)."""
    return seq.priority, seq.arrival_order


class ChunkShare:
    """The tokens of one step that less urgent prefill chunks may still take (rule 3)."""

    def __init__(self, less_urgent_chunk: int | None, urgent_priority: int | None = URGENT_PRIORITY):
        self.left = math.inf if less_urgent_chunk is None or urgent_priority is None else less_urgent_chunk
        self.urgent_priority = -math.inf if urgent_priority is None else urgent_priority
        self.deferred: list[Scheduled] = []  # running prompts served after the admissions, in order

    def defer(self, seq: Scheduled, most_urgent_waiting: Scheduled | None) -> bool:
        """Whether running `seq`'s chunk waits until the waiting requests more urgent than it were
        admitted (then it is in `deferred`)."""
        if seq.priority <= self.urgent_priority or most_urgent_waiting is None:
            return False
        if urgency(most_urgent_waiting) > urgency(seq):
            return False
        self.deferred.append(seq)
        return True

    def allows(self, seq: Scheduled) -> bool:
        """Whether waiting `seq` may be admitted with a chunk this step: it is urgent, or the share
        has tokens left and no deferred running prompt more urgent than it is owed them first."""
        if seq.priority <= self.urgent_priority:
            return True
        return self.left > 0 and not any(urgency(d) < urgency(seq) for d in self.deferred)

    def take(self, seq: Scheduled, wanted: int) -> int:
        """Tokens of `seq`'s chunk this step (at most `wanted`; 0: none), counted against the share."""
        if seq.priority <= self.urgent_priority:
            return wanted
        n = int(min(wanted, self.left))
        self.left -= n
        return n


def prefills_in_order(running: Iterable[Seq]) -> list[Seq]:
    """The running sequences still in their prefill, most urgent first (rule 1)."""
    return sorted((s for s in running if s.in_prefill), key=urgency)


def drop_less_urgent(planned: MutableMapping[str, int], running: Iterable[Scheduled],
                     urgent_priority: int | None = URGENT_PRIORITY) -> None:
    """Take the prefill chunks of sequences that are not urgent out of `planned` (request id ->
    tokens this step) when it holds an urgent sequence's prefill chunk (rule 2)."""
    if urgent_priority is None:
        return
    prefilling = [s for s in running if s.in_prefill and planned.get(s.request_id)]
    if any(s.priority <= urgent_priority for s in prefilling):
        for seq in prefilling:
            if seq.priority > urgent_priority:
                del planned[seq.request_id]

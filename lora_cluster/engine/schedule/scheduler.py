"""Continuous batching: which sequences run in the next step, and with how many tokens.

Pure policy, no tensors and no Ray. Every step:
1. each running sequence that has finished its prefill decodes one token;
2. running sequences still in their prefill continue with a chunk (chunked prefill);
3. waiting sequences are admitted in urgency order while a KV slot and token budget remain,
   preempting less urgent running sequences when every KV slot is taken (see Preemption).
The step's token budget is `max_num_batched_tokens`, so long prefills are split across steps and
decodes are never starved by a prefill. Prefill chunks go most urgent first; with an
`urgent_priority` (the engine's: 0), a step with an urgent chunk carries no less urgent one, and less
urgent chunks share at most `less_urgent_chunk` tokens of a step: see `replica_policy.prefill_plan`.

Urgency: a sequence's `priority` is an int, lower is more urgent (vLLM's convention). Sequences are
ordered by (priority, arrival): the waiting queue is kept sorted by that key, and arrival is the
order of `add`, kept for life (a preempted sequence returns to its place among its peers).

Adapters: a waiting sequence is admitted only when its adapter is ready on the device. The engine
answers through the injected `acquire` callback (READY, PENDING while it loads, BLOCKED when every
adapter slot is held by running sequences, FAILED). Sequences whose adapter is pending do not hold
up the others; but once an earlier (more urgent) sequence is BLOCKED, later ones may not claim a
new adapter slot (they may still join with adapters already resident), so a rare adapter is not
starved by a stream of other newcomers.

KV blocks (optional `kv_blocks`, a `BlockAllocator`): a sequence holds the blocks of the tokens it
has computed or is about to compute this step, taken as it grows. Each step first gives the running
sequences, most urgent first, the blocks of their planned tokens: a prefill chunk shrinks to the
blocks there are, and a sequence that gets none preempts the least urgent running sequence (itself
if it is that one) until it does; so a running sequence is preempted, never failed, when blocks run
out. A waiting sequence is admitted only while a block beyond a small watermark (kept for the
running sequences' next tokens) is free, its first chunk cut to the free blocks; when none is free
it may preempt a less urgent sequence as for a slot (below).

Prefix caching (a `kv_blocks` with a `PrefixCacheIndex`, and `prefix_root`, the chain root of a
sequence's weights: `replica_policy.prefix_hash`): a sequence just admitted takes the cached blocks of the
longest prefix of its tokens (prompt, plus output when re-admitted after a preemption) and starts
computing after them (`num_computed`), so cached tokens cost neither step budget nor blocks. A
sequence that still needs prompt logprobs looks nothing up (they come from its prefill's logits). The
full blocks a sequence has computed are offered to the cache at every step and when it stops
(finished, aborted or preempted), so a preempted sequence finds its own blocks again unless memory
was needed meanwhile. Idle cached blocks count as free: they are evicted before anyone is preempted.

Adapter slots (optional `slot_to_preempt`, the engine's `AdapterResidency.slot_to_preempt`): when a
waiting sequence's adapter is fetched but BLOCKED (every adapter slot has running sequences) while a
KV slot is free, and the slot it names holds an adapter that only strictly less urgent sequences
want, that adapter's running sequences are preempted as below and `acquire` is asked again (it then
evicts the idle slot for the urgent sequence). Counted in `num_adapter_preemptions` (sequences).

Preemption (recompute): when a waiting sequence finds no free KV slot and the least urgent running
sequence (largest priority, then latest arrival) has a strictly larger priority value, that one is
preempted for it: it gives back its KV slot and its adapter reference, returns to the waiting queue
at its place with nothing computed (`num_computed = 0`), and keeps its prompt, its output and the
engine's per-request state (detokenizer, sampling generator). Re-admitted, it prefills prompt and
output again (chunked like any prefill); the step that completes that prefill samples its next
token, as its next decode would have. Invariants: a sequence is never preempted for one of equal or
larger priority value; a victim is preempted only once the waiting sequence's adapter is READY and
the step has budget for it, so a sequence that cannot run yet never evicts anyone; a sequence
preempted in a step is not re-admitted in that step.

Patience: a waiting sequence preempts (for a KV slot or an adapter slot) only from its `preempt_at`
(the engine sets it to its arrival plus the patience its caller gives: a share of its SLA class's
TTFT target, `EngineConfig.preempt_patience`; 0, the default for a bare engine, at once). Until then
it waits for a slot to free, which under load one usually does well within the patience: preempting
at once recomputes the victim's work for nothing. The clock is injected (`clock`, read once per step).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_cluster.engine.schedule.kv_cache import BlockAllocator
from lora_cluster.engine.schedule.sequence import SeqStatus, Sequence
from lora_cluster.errors import EngineOverloadedError, RequestError
from lora_cluster.replica_policy.prefill_plan import ChunkShare, drop_less_urgent, prefills_in_order, urgency


class Gate(enum.Enum):
    READY = "ready"
    PENDING = "pending"
    BLOCKED = "blocked"
    FAILED = "failed"


# acquire(seq, may_claim_slot) -> Gate; on READY the engine has set seq.lora_slot and holds a reference
AcquireFn = Callable[[Sequence, bool], Gate]
# slot_to_preempt(priority) -> adapter slot whose running sequences may be preempted for it, or None
SlotToPreemptFn = Callable[[int], "int | None"]
ReleaseFn = Callable[[Sequence], None]
# prefix_root(seq) -> chain root of the weights a sequence just admitted runs with
# (replica_policy.prefix_hash)
PrefixRootFn = Callable[[Sequence], bytes]


def grammar_first(acquire: AcquireFn) -> AcquireFn:
    """The admission gate of a sequence that may be constrained: one whose grammar is still compiling
    waits (PENDING, holding nothing), one whose compile failed fails with the compile's RequestError
    (FAILED), and then `acquire` (its adapter's gate) answers."""

    def gate(seq: Sequence, may_claim_slot: bool) -> Gate:
        guided = seq.guided
        if guided is not None and not guided.ready():
            if guided.error is None:
                return Gate.PENDING
            seq.error = guided.error
            return Gate.FAILED
        return acquire(seq, may_claim_slot)

    return gate


def check_priority(priority: object) -> int:
    """`priority` if it is an int (not a bool); otherwise a RequestError."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer (lower is more urgent), got {priority!r}")
    return priority


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    failed: list[Sequence] = field(default_factory=list)  # adapter could not be loaded
    preempted: list[Sequence] = field(default_factory=list)  # sent back to the waiting queue this step

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Owns the waiting queue (sorted by urgency), the running set and the KV slot free list."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        acquire: AcquireFn,
        release: ReleaseFn,
        kv_blocks: BlockAllocator | None = None,
        slot_to_preempt: SlotToPreemptFn | None = None,
        less_urgent_chunk: int | None = None,
        urgent_priority: int | None = None,
        prefix_root: PrefixRootFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_blocks = kv_blocks  # None: KV memory is not limited beyond the slots (see KV blocks)
        self.max_waiting = max_waiting
        self._acquire, self._release = acquire, release
        self._free_slots = list(range(max_num_seqs))
        heapq.heapify(self._free_slots)
        self._arrivals = itertools.count()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start
        self._slot_to_preempt = slot_to_preempt
        self.num_adapter_preemptions = 0  # since start: sequences preempted for an adapter slot
        self.less_urgent_chunk, self.urgent_priority = less_urgent_chunk, urgent_priority  # prefill_plan
        self._prefix_root = prefix_root  # None: no prefix caching
        self._clock = clock  # read once per step: which waiting sequences' patience has run out

    def can_add(self) -> bool:
        return len(self.waiting) < self.max_waiting

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones at least as urgent (stamps its arrival order)."""
        if not self.can_add():
            raise EngineOverloadedError(
                f"request {seq.request_id!r} refused: {len(self.waiting)} requests already wait "
                f"(max_waiting={self.max_waiting})"
            )
        seq.arrival_order = next(self._arrivals)
        bisect.insort(self.waiting, seq, key=urgency)

    def schedule(self) -> SchedulerOutput:
        """The next step's work (see the module docstring); preempted sequences are back in the
        waiting queue when it returns."""
        out = SchedulerOutput()
        self._commit_computed()
        share = ChunkShare(self.less_urgent_chunk, self.urgent_priority)
        planned = self._plan_running(share)
        self._reserve_blocks(planned, out)
        budget = self.max_num_batched_tokens - sum(planned.values())
        blocked, now = False, self._clock()
        still_waiting: list[Sequence] = []
        for i, seq in enumerate(self.waiting):
            room = self._has_room()
            victim = None if room or now < seq.preempt_at else self._victim_for(seq)
            refund = planned.get(victim.request_id, 0) if victim is not None else 0
            if (not room and victim is None) or budget + refund <= 0 or not share.allows(seq):
                still_waiting.extend(self.waiting[i:])  # the rest are no more urgent: no room for them either
                break
            gate = self._acquire(seq, not blocked)
            if gate is Gate.BLOCKED and not blocked and victim is None and self._may_free_slot(seq, now):
                budget += self._preempt_slot(self._slot_to_preempt(seq.priority), planned, out)
                gate = self._acquire(seq, True)
            if gate is Gate.FAILED:
                seq.status = SeqStatus.FINISHED
                out.failed.append(seq)
                continue
            if gate is not Gate.READY:
                blocked = blocked or gate is Gate.BLOCKED
                still_waiting.append(seq)
                continue
            if victim is not None:
                budget += planned.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted.append(victim)
            self._admit(seq)
            self._reuse_prefix(seq)
            wanted = min(seq.num_tokens - seq.num_computed, budget)
            n = self._take_blocks(seq, share.take(seq, wanted), watermark=victim is None)
            if n:
                planned[seq.request_id] = n
            budget -= n
        self.waiting = still_waiting
        for seq in share.deferred:  # less urgent prompts than the waiting ones: what the share has left
            if seq.status is SeqStatus.RUNNING and budget > 0:
                n = self._fit_blocks(seq, share.take(seq, min(seq.num_tokens - seq.num_computed, budget)))
                if n:
                    planned[seq.request_id] = n
                    budget -= n
        drop_less_urgent(planned, self.running, self.urgent_priority)
        for seq in out.preempted:
            bisect.insort(self.waiting, seq, key=urgency)
        for seq in self.running:
            n = planned.get(seq.request_id)
            if n is None:
                continue
            if seq.in_prefill:
                out.prefills.append((seq, n))
            else:
                out.decodes.append(seq)
        return out

    def _plan_running(self, share: ChunkShare) -> dict[str, int]:
        """Tokens of each running sequence this step: decodes first (one each), then prefill chunks,
        most urgent first, less urgent ones within `share` (see `replica_policy.prefill_plan`)."""
        planned: dict[str, int] = {}
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if not seq.in_prefill:
                planned[seq.request_id] = 1
                budget -= 1
        head = self.waiting[0] if self.waiting else None
        for seq in prefills_in_order(self.running):
            if share.defer(seq, head):
                continue
            n = share.take(seq, min(seq.num_tokens - seq.num_computed, budget)) if budget > 0 else 0
            if n:
                planned[seq.request_id] = n
                budget -= n
        return planned

    def _reserve_blocks(self, planned: dict[str, int], out: SchedulerOutput) -> None:
        """Give running sequences, most urgent first, the KV blocks of their planned tokens. A prefill
        chunk shrinks to the blocks there are; a sequence that gets none preempts the least urgent running
        sequence (itself, if it is that one) until it does."""
        blocks = self.kv_blocks
        if blocks is None:
            return
        for seq in sorted(self.running, key=urgency):
            n = planned.get(seq.request_id)
            while n is not None and not blocks.grow(seq.kv_slot, seq.num_computed + n):
                fit = blocks.tokens_fit(seq.kv_slot, seq.num_computed + n) - seq.num_computed
                if seq.in_prefill and fit > 0:
                    n = planned[seq.request_id] = fit
                    continue
                victim = max(self.running, key=urgency)
                planned.pop(victim.request_id, None)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    n = None

    def _fit_blocks(self, seq: Sequence, n: int) -> int:
        """Blocks for `n` more tokens of a running sequence, or for as many as fit, without preempting."""
        blocks = self.kv_blocks
        if blocks is None or n <= 0:
            return n
        n = min(n, blocks.tokens_fit(seq.kv_slot, seq.num_computed + n) - seq.num_computed)
        if n > 0:
            blocks.grow(seq.kv_slot, seq.num_computed + n)
        return max(0, n)

    def _has_room(self) -> bool:
        """A sequence slot and a KV block beyond the watermark are free."""
        blocks = self.kv_blocks
        return bool(self._free_slots) and (blocks is None or blocks.num_free_blocks > self._watermark())

    def _watermark(self, others: int | None = None) -> int:
        """KV blocks kept free for the `others` running sequences' next tokens (default: all running)
        when admitting a new one: 1% of the blocks, at least one; none when nothing else runs."""
        blocks = self.kv_blocks
        others = len(self.running) if others is None else others
        return 0 if blocks is None or not others else max(1, blocks.num_blocks // 100)

    def _take_blocks(self, seq: Sequence, n: int, *, watermark: bool) -> int:
        """Blocks for the next `n` tokens of a sequence just admitted (after those it found cached), or
        for as many as fit; the watermark is kept unless the sequence preempted another for room."""
        blocks = self.kv_blocks
        if blocks is None:
            return n
        keep = self._watermark(len(self.running) - 1) if watermark else 0  # others than `seq`
        room = blocks.capacity(seq.kv_slot) + (blocks.num_free_blocks - keep) * blocks.block_size
        n = max(0, min(n, room - seq.num_computed))
        blocks.grow(seq.kv_slot, seq.num_computed + n)
        return n

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Give a sequence just admitted the cached blocks of its longest cached prefix (see Prefix
        caching); its first admission records how many prompt tokens were cached."""
        blocks = self.kv_blocks
        if blocks is None or self._prefix_root is None or blocks.prefix_cache is None:
            return
        have = seq.prompt_logprobs
        lookup = have is None or len(have) >= len(seq.prompt_ids)  # no prompt logprobs left to compute
        root = self._prefix_root(seq)
        seq.num_computed = blocks.reuse(seq.kv_slot, root, seq.token_at, seq.num_tokens, lookup=lookup)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed

    def _commit_computed(self) -> None:
        """Offer the running sequences' computed full blocks to the prefix cache."""
        if self.kv_blocks is not None:
            for seq in self.running:
                self.kv_blocks.commit(seq.kv_slot, seq.token_at, seq.num_computed)

    def _preempt_slot(self, slot: int | None, planned: dict[str, int], out: SchedulerOutput) -> int:
        """Preempt the running sequences of adapter slot `slot` (named by `slot_to_preempt`: all less
        urgent than the sequence it is freed for); returns the step budget they gave back."""
        if slot is None:
            return 0
        refund = 0
        for victim in [s for s in self.running if s.adapter_id is not None and s.lora_slot == slot]:
            refund += planned.pop(victim.request_id, 0)
            self._preempt(victim)
            out.preempted.append(victim)
            self.num_adapter_preemptions += 1
        return refund

    def _may_free_slot(self, seq: Sequence, now: float) -> bool:
        """Whether `seq`, BLOCKED, may have an adapter slot's less urgent sequences preempted for it."""
        return self._slot_to_preempt is not None and now >= seq.preempt_at

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """The least urgent running sequence, if its priority is strictly less urgent than `seq`'s."""
        victim = max(self.running, key=urgency, default=None)
        if victim is None or victim.priority <= seq.priority:
            return None
        return victim

    def _admit(self, seq: Sequence) -> None:
        seq.kv_slot = heapq.heappop(self._free_slots)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _stop_running(self, seq: Sequence) -> None:
        """Return a running sequence's KV slot and adapter reference."""
        self.running.remove(seq)
        if self.kv_blocks is not None:
            self.kv_blocks.commit(seq.kv_slot, seq.token_at, seq.num_computed)
            self.kv_blocks.free(seq.kv_slot)
        heapq.heappush(self._free_slots, seq.kv_slot)
        seq.kv_slot = None
        self._release(seq)

    def _preempt(self, seq: Sequence) -> None:
        """RUNNING -> WAITING, to be recomputed but for the blocks it finds cached again (the caller
        re-queues it)."""
        self._stop_running(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.waiting_since = self._clock()  # it waits again (its queue time: engine.schedule.step_meter)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of the queues, returning its KV slot and adapter reference (idempotent)."""
        if seq.status is SeqStatus.RUNNING:
            self._stop_running(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

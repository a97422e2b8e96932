"""The multi-LoRA engine: continuous batching over one base model and a pool of adapter slots.

`Engine` is synchronous and single-threaded: `add_request`, `abort`, `step`, `start_load` and
`unload_adapter` are called from one thread (the offline `generate`, or `AsyncEngine`'s loop
thread). The adapter catalog (register, unregister, list, merge) is not the engine's: its caller
talks to the store it wired (`store.ports.AdapterCatalog`). Adapter I/O never runs on the step
thread: loads are submitted to a small thread pool and a request waits in the queue, while the
others keep decoding, until its adapter's host weights are ready and a device slot is free.

A step: the scheduler's decision (`engine.schedule.scheduler`) -> the model runner's forward pass
and the sampling pipeline (`engine.model.runner`, `engine.sample.pipeline`) -> each sampled token
taken by its sequence, which may end it (`engine.sample.stopping.append_token`). The engine is
given its parts (`engine.factory` builds them).

Priorities: a request's int `priority` (lower is more urgent) orders admission and its adapter's
fetch (`engine.adapters.fetch_queue`), and an urgent request preempts less urgent running ones when
every KV slot is taken, or takes the adapter slot of an adapter only less urgent requests want
(`engine.schedule.scheduler` and `engine.adapters.residency` have the policy).

Prefix caching (`enable_prefix_caching`): full KV blocks are keyed by the adapter, its version and
their tokens (`replica_policy.prefix_hash`), and a new request reuses the longest cached prefix of
its prompt (`engine.schedule.kv_cache`, `engine.schedule.prefix_cache`); `RequestOutput.num_cached_tokens`
says how many tokens.

Structured output (`SamplingParams.guided`, `engine.sample.grammar_compiler`,
`engine.sample.guided_state`, `engine.sample.token_mask`): a constrained request's grammar compiles
on the compiler's threads (once per spec, cached); the request waits in the queue holding nothing
until it is ready (the scheduler's gate answers PENDING), or ends at once with the compile's
`RequestError`. In a step, the constrained rows' masks are filled on a worker thread while an
accelerator runs the forward pass (on the CPU: on the step thread after it), then applied to the
model's logits before the logit controls and sampling (logprobs are those of the masked distribution); each
sampled token advances its row's matcher, and a grammar that allows nothing more ends the request
with `stop`. Unconstrained rows are untouched, and a step without constrained rows does no mask work.

Failures: a step that raises (forward pass, sampling, detokenization, scheduling) ends the requests
it was running with an `EngineStepError`; a request whose own detokenization fails ends alone. The
engine counts consecutive failed steps (`EngineStats.consecutive_step_failures`); the async front
reports itself unhealthy past `max_consecutive_step_failures`, so the replica is restarted instead
of looping on a broken device.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_cluster.adapter_format import LoraWeights
from lora_cluster.config import EngineConfig
from lora_cluster.engine.adapters.guard import AdapterGuard
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.adapters.residency import AdapterResidency
from lora_cluster.engine.model.base_model import BaseModel
from lora_cluster.engine.model.batch import StepBatch
from lora_cluster.engine.model.memory_plan import MemoryPlan
from lora_cluster.engine.model.runner import ModelRunner
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.sample.grammar_compiler import GrammarCompiler
from lora_cluster.engine.sample.guided_state import GuidedState
from lora_cluster.engine.sample.pipeline import SampledTokens
from lora_cluster.engine.sample.sampling import make_generator
from lora_cluster.engine.sample.stopping import append_token
from lora_cluster.engine.schedule.counters import EngineCounters
from lora_cluster.engine.schedule.kv_cache import PagedKVCache
from lora_cluster.engine.schedule.scheduler import Scheduler, SchedulerOutput, check_priority
from lora_cluster.engine.schedule.sequence import SeqStatus, Sequence, snapshot
from lora_cluster.engine.schedule.step_meter import StepMeter
from lora_cluster.errors import EngineStepError, PromptTooLongError, RequestError
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.request.output import FinishReason, RequestOutput
from lora_cluster.request.sampling_params import SamplingParams
from lora_cluster.store.ports import EnginePort

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.01  # an empty step with waiting requests and no load in flight sleeps this long


@dataclass(frozen=True)
class EngineStats:
    """What a router needs to know about this engine right now."""

    num_running: int
    num_waiting: int
    free_seq_slots: int
    free_adapter_slots: int
    resident_adapters: tuple[str, ...]
    loading_adapters: tuple[str, ...]
    held_fetches: int = 0  # adapter fetches held outside the loader's budgets (bounded by requests)
    consecutive_step_failures: int = 0
    failed_steps: int = 0  # since start
    num_preemptions: int = 0  # since start
    num_adapter_preemptions: int = 0  # since start: of those, preempted to free an adapter slot
    running_by_priority: dict[int, int] = field(default_factory=dict)  # priority -> running requests
    waiting_by_priority: dict[int, int] = field(default_factory=dict)  # priority -> waiting requests
    # 0..1, the router's soft score for a miss here (1: in adapter thrash, better sent elsewhere)
    miss_penalty: float = 0.0
    breakers: dict[str, dict[str, object]] = field(default_factory=dict)  # alert name -> state, level, trips
    adapter_thrash: dict[str, object] = field(default_factory=dict)  # `adapters.thrash.ThrashMeter.snapshot`


class Engine:
    """Serve many adapters of one base model in shared forward passes.

    The engine is given its parts and builds none of them: `engine.factory.build_engine` is where an
    engine is built (the base model, the paged KV cache, the adapter loader the caller wires in, the
    adapter pool and residency, the model runner with its sampler, the scheduler, the grammar
    compiler). The engine owns them from then on: `close` closes them.
    """

    def __init__(self, *, config: EngineConfig, model: BaseModel, device: torch.device, max_model_len: int,
                 memory: MemoryPlan, kv: PagedKVCache, loader: EnginePort, pool: AdapterPool,
                 adapters: AdapterResidency, adapter_guard: AdapterGuard, counters: EngineCounters,
                 runner: ModelRunner, scheduler: Scheduler, grammars: GrammarCompiler,
                 eos_token_ids: set[int], meter: StepMeter):
        self.config, self.model, self.device, self.max_model_len = config, model, device, max_model_len
        self.tokenizer, self.dtype, self.shapes = model.tokenizer, model.embed.dtype, model.dims.shapes()
        self.memory, self.kv = memory, kv  # the memory plan; the paged KV cache's block tensors
        self.loader, self.pool, self.adapters = loader, pool, adapters
        self.adapter_guard, self.counters = adapter_guard, counters
        self.runner, self.scheduler, self.grammars = runner, scheduler, grammars
        self.eos_token_ids = eos_token_ids
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.consecutive_step_failures = 0
        self.failed_steps = 0
        self.meter = meter  # step time charged to requests, slot and load time to adapters

    # ----- adapters -------------------------------------------------------------------------

    def start_load(self, adapter_id: str) -> Future[LoraWeights | None]:
        """Begin fetching an adapter to the host (a done future when it is already on the device)."""
        check_adapter_id(adapter_id)
        if self.pool.version_of(adapter_id) == self.loader.version(adapter_id):
            done: Future[LoraWeights | None] = Future()
            done.set_result(None)
            return done
        return self.adapters.start_load(adapter_id)

    def forget_failed_load(self, adapter_id: str) -> None:
        """Drop a failed load so that the next request retries it."""
        self.adapters.forget_failed(adapter_id)

    def load_adapter(self, adapter_id: str) -> None:
        """Fetch and validate an adapter now (blocking); it is placed on the device on first use."""
        try:
            self.start_load(adapter_id).result()
        except Exception:
            self.forget_failed_load(adapter_id)
            raise

    def unload_adapter(self, adapter_id: str) -> bool:
        """Drop an adapter from the device and host; False when a sequence is using it."""
        return self.adapters.unload(adapter_id)

    # ----- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt ids, checked against the vocabulary and `max_model_len` (one new token must fit)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.model.dims.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len - 1)
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        adapter_id: str | None = None,
        sampling: SamplingParams | None = None,
        priority: int = 0,
        preempt_after_s: float = 0.0,
    ) -> None:
        """Queue a request (`priority`: lower is more urgent; `preempt_after_s`: how long it waits for a
        slot before it may preempt less urgent running work, see `Scheduler`); raises RequestError/
        PromptTooLongError/EngineOverloadedError at once."""
        check_priority(priority)
        if not 0.0 <= preempt_after_s < float("inf"):
            raise RequestError(f"preempt_after_s must be a finite number of seconds >= 0, "
                               f"got {preempt_after_s}")
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        if adapter_id is not None:
            check_adapter_id(adapter_id)
        sampling = sampling or SamplingParams()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sampling, name)
            limit = self.config.max_logprobs
            if k is not None and k > limit:
                raise RequestError(f"{name}={k} exceeds the limit of {limit} (max_logprobs)")
        vocab = self.model.dims.vocab_size
        if any(t >= vocab for t in sampling.logit_bias):
            bad = max(sampling.logit_bias)
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad}")
        seq = Sequence(
            request_id=request_id,
            adapter_id=adapter_id,
            prompt_ids=self.tokenize(prompt),
            sampling=sampling,
            detok=IncrementalDetokenizer(self.tokenizer),
            generator=make_generator(sampling, self.device),
            priority=priority,
            prompt_logprobs=None if sampling.prompt_logprobs is None else [None],
            guided=None if sampling.guided is None else GuidedState(self.grammars.compile(sampling.guided)),
        )
        seq.preempt_at = seq.arrival + preempt_after_s
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self.adapters.request_started(adapter_id, priority)  # queues its fetch now, off the step loop

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; frees its slot at once. Returns its final output, or None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.finish(seq)
        self.adapters.request_finished(seq.adapter_id, seq.priority)
        return snapshot(seq)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def has_fetches(self) -> bool:
        """Adapter fetches are held (a `step` lets go of those nobody waits for any more)."""
        return self.adapters.has_fetches()

    def live_fetches(self) -> int:
        """Adapter fetches of requests queued or running now; thread-safe (a background prefetcher
        outside the engine yields while it is not zero)."""
        return self.adapters.live_fetches()

    def counters_snapshot(self) -> dict[str, Any]:
        """The engine's cumulative counters (`engine.schedule.counters`) and the adapter pool's fragmentation
        (`AdapterPool.fragmentation`), for metrics. Call on the step loop's thread."""
        return {**self.counters.snapshot(), **self.scheduler.kv_blocks.prefix_stats(),
                "adapter_pool_fragmentation": self.pool.fragmentation()}

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            free_seq_slots=self.scheduler.num_free_slots,
            free_adapter_slots=self.pool.num_free,
            resident_adapters=tuple(self.pool.resident()),
            loading_adapters=self.adapters.loading(),
            held_fetches=self.adapters.held(),
            consecutive_step_failures=self.consecutive_step_failures,
            failed_steps=self.failed_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_adapter_preemptions=self.scheduler.num_adapter_preemptions,
            running_by_priority=dict(Counter(s.priority for s in self.scheduler.running)),
            waiting_by_priority=dict(Counter(s.priority for s in self.scheduler.waiting)),
            miss_penalty=self.adapter_guard.miss_penalty(),
            breakers=self.adapter_guard.snapshot(),
            adapter_thrash=self.adapter_guard.thrash_snapshot(),
        )

    # ----- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch (schedule, run the model and sample, take the tokens); returns an output for
        every request that got a token or finished.

        Never raises for a failure of the step itself: the requests it concerned end with an
        `EngineStepError` in their output (see the module docstring)."""
        try:
            plan = self.scheduler.schedule()
            self.adapters.end_step(self.scheduler.waiting)
        except Exception as e:  # the queues themselves are broken: nothing can run
            log.exception("scheduling failed")
            return self._fail(list(self._seqs.values()), "scheduling", e)
        outputs = [self._end(seq, FinishReason.ERROR) for seq in plan.failed]
        self.meter.resided(self.pool.resident())
        if plan.empty:
            self._idle()
            return outputs
        started = time.perf_counter()
        batch = self.runner.prepare(plan)
        try:
            sampled = self.runner.run(batch)
        except Exception as e:
            log.exception("engine step failed")
            self._charge(plan, started)
            return outputs + self._fail([*plan.decodes, *(s for s, _ in plan.prefills)], "step", e)
        taken, failed = self._take(plan, batch, sampled)
        device_s = self._charge(plan, started)
        for out in taken:
            out.device_s = device_s.get(out.request_id, out.device_s)
        self.counters.step(len(plan.decodes) + len(plan.prefills), len(batch.sampled))
        self.adapter_guard.stepped(time.perf_counter() - started)
        self._count_step(failed)
        return outputs + taken

    def _charge(self, plan: SchedulerOutput, started: float) -> dict[str, float]:
        """Charge the step's time since `started` to its sequences (`schedule.step_meter`)."""
        return self.meter.charge(time.perf_counter() - started, plan.decodes, plan.prefills,
                                 self.pool.slot_rank)

    def _idle(self) -> None:
        """An empty step: wait a little for an adapter load that waiting requests need, rather than
        spin the loop (e.g. while a draining adapter's turn comes)."""
        pending = self.adapters.pending()
        if pending and self.scheduler.waiting:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
        elif self.scheduler.waiting:
            time.sleep(IDLE_WAIT_S)

    def _take(self, plan: SchedulerOutput, batch: StepBatch,
              sampled: SampledTokens) -> tuple[list[RequestOutput], bool]:
        """Advance the step's sequences over what it computed and give each sampled one its token
        (`sample.stopping.append_token`); a request whose token fails (e.g. the detokenizer) ends alone.
        Returns the sampled sequences' outputs and whether any failed."""
        for seq in plan.decodes:
            seq.num_computed += 1
        for seq, n in plan.prefills:
            seq.num_computed += n
        outputs, failed = [], False
        for seq, token, logprob in zip(batch.sampled, sampled.tokens, sampled.logprobs, strict=True):
            try:
                reason = append_token(seq, token, logprob, self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    self._finish(seq, reason)
            except Exception as e:  # e.g. the detokenizer: this request alone ends
                log.exception("request %r failed after its step", seq.request_id)
                seq.error, failed = EngineStepError(f"engine step failed: {e!r}"), True
                self._finish(seq, FinishReason.ERROR)
            outputs.append(snapshot(seq))
        return outputs, failed

    def _fail(self, seqs: list[Sequence], stage: str, error: Exception) -> list[RequestOutput]:
        """End `seqs` with an EngineStepError naming the stage and the cause; count a failed step."""
        self._count_step(True)
        outputs = []
        for seq in seqs:
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.error = EngineStepError(f"engine {stage} failed: {error!r}")
            try:
                self._finish(seq, FinishReason.ERROR)
            except Exception:  # the scheduler itself is broken: still end the request
                log.exception("could not release request %r", seq.request_id)
                seq.status = SeqStatus.FINISHED
                if self._seqs.pop(seq.request_id, None) is not None:
                    self.adapters.request_finished(seq.adapter_id, seq.priority)
            outputs.append(snapshot(seq))
        return outputs

    def _count_step(self, failed: bool) -> None:
        if failed:
            self.consecutive_step_failures += 1
            self.failed_steps += 1
        else:
            self.consecutive_step_failures = 0

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        if self._seqs.pop(seq.request_id, None) is not None:  # once per request
            self.adapters.request_finished(seq.adapter_id, seq.priority)

    def _end(self, seq: Sequence, reason: FinishReason) -> RequestOutput:
        """Finish `seq` now; its final output."""
        self._finish(seq, reason)
        return snapshot(seq)

    # ----- offline API ----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        adapter_ids: list[str | None] | None = None,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, all in one continuous batch; outputs in prompt order.

        `priorities` (one per prompt, lower is more urgent; default all 0) order admission when the
        prompts do not all fit at once. Every distinct adapter is fetched and validated first, so a
        bad adapter raises its `AdapterError` before anything runs.
        """
        n = len(prompts)
        adapter_ids = _per_prompt(adapter_ids, n, None, "adapter ids")
        single = None if isinstance(sampling, list) else sampling or SamplingParams()
        params = _per_prompt(sampling if isinstance(sampling, list) else None, n, single, "sampling params")
        priorities = [check_priority(p) for p in _per_prompt(priorities, n, 0, "priorities")]
        for aid in dict.fromkeys(a for a in adapter_ids if a is not None):
            self.load_adapter(aid)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, aid, p, prio in zip(ids, prompts, adapter_ids, params, priorities, strict=True):
            self.add_request(rid, prompt, aid, p, prio)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def close(self) -> None:
        self.grammars.close()
        self.runner.close()
        self.adapters.close()
        self.loader.close()


def _per_prompt(values: list | None, n: int, default: object, what: str) -> list:
    """`values` (one per prompt), or `default` for every prompt; a RequestError when the counts differ."""
    if values is None:
        return [default] * n
    if len(values) != n:
        raise RequestError(f"{n} prompts but {len(values)} {what}")
    return values


__all__ = ["Engine", "EngineStats", "SeqStatus"]

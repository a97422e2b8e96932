"""A request's life inside the engine, and what the engine reports back about it.

Lifecycle: WAITING (queued; its adapter may still be loading) -> RUNNING (holds a KV slot and a
reference on its adapter's device slot; prefilling in chunks, then decoding one token per step)
-> FINISHED (slot and adapter reference released exactly once). A preempted sequence goes RUNNING
-> WAITING: it gives back its slot and adapter reference, its KV cache is forgotten
(`num_computed = 0`; the full blocks it computed stay in the prefix cache, for its re-admission to
find), and its prompt, output, detokenizer and generator are kept, so that once re-admitted it
prefills prompt + output again (but what it finds cached) and continues where it was. Abort and
failure go straight to FINISHED from either state.

Priority: an int, lower is more urgent (vLLM's convention), 0 by default.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.sample.guided_state import GuidedState
from lora_cluster.errors import LoraClusterError
from lora_cluster.request.output import FinishReason, RequestOutput, TokenLogprob
from lora_cluster.request.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Mutable engine-side state of one request."""

    request_id: str
    adapter_id: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    kv_slot: int | None = None
    lora_slot: int = -1  # device adapter slot, -1 = base model
    num_computed: int = 0  # tokens whose keys/values are in the KV cache
    finish_reason: FinishReason | None = None
    error: LoraClusterError | None = None
    first_token_time: float | None = None
    emitted_text: int = 0  # characters of detok.text already reported
    emitted_ids: int = 0  # output ids already reported
    priority: int = 0  # lower is more urgent
    preempt_at: float = 0.0  # monotonic time from which, waiting, it may preempt less urgent work
    arrival_order: int = 0  # stamped by the scheduler when queued; kept across preemptions
    num_preemptions: int = 0
    device_s: float = 0.0  # step time charged to it (engine.schedule.step_meter), recomputes included
    queue_s: float = 0.0  # time it waited to be scheduled (engine.schedule.step_meter), re-waits included
    waiting_since: float | None = None  # when its current wait began (arrival, preemption); None: ran since
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt id (first None), if asked
    guided: GuidedState | None = None  # the output constraint's matcher (engine.sample.guided_state), if any

    def __post_init__(self) -> None:
        if self.waiting_since is None:
            self.waiting_since = self.arrival  # a new sequence waits from its arrival

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """More than one token to compute before the next sample: the prompt of a new sequence, or
        prompt + output of a preempted one (recomputed). Prefill chunks run up to `num_tokens`, and
        the chunk that reaches it samples the next token: for a preempted sequence, the token its
        next decode would have sampled. A sequence with only its last token uncached decodes it."""
        return self.num_computed < len(self.prompt_ids) or self.num_computed < self.num_tokens - 1

    def token_at(self, index: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]


def snapshot(seq: Sequence) -> RequestOutput:
    """Report `seq` and mark what it reports as emitted."""
    text = seq.detok.text
    finished = seq.status is SeqStatus.FINISHED
    if seq.sampling.stop and not finished:  # hold back what may be the start of a stop string
        text = text[: max(seq.emitted_text, len(text) - max(len(s) for s in seq.sampling.stop) + 1)]
    out = RequestOutput(
        request_id=seq.request_id,
        adapter_id=seq.adapter_id,
        prompt_token_ids=seq.prompt_ids,
        token_ids=list(seq.output_ids),
        text=text,
        delta_text=text[seq.emitted_text :],
        delta_token_ids=seq.output_ids[seq.emitted_ids :],
        finished=finished,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        error=seq.error,
        time_to_first_token=(seq.first_token_time - seq.arrival) if seq.first_token_time else None,
        num_preemptions=seq.num_preemptions,
        num_cached_tokens=seq.num_cached_tokens or 0,
        device_s=seq.device_s,
        queue_s=seq.queue_s,
    )
    if seq.sampling.logprobs is not None:
        out.logprobs = list(seq.output_logprobs)
        out.delta_logprobs = seq.output_logprobs[seq.emitted_ids :]
    if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == len(seq.prompt_ids):
        out.prompt_logprobs = seq.prompt_logprobs
    seq.emitted_text, seq.emitted_ids = len(text), len(seq.output_ids)
    return out

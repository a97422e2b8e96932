"""What the engine reports about a request: its output so far, each token's logprob, why it ended.

`RequestOutput` is a snapshot (cumulative text and ids, plus what is new since the last one); the
replica sends it over the wire, and the HTTP layer renders it as OpenAI's, LoRAX's or vLLM's answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lora_cluster.errors import LoraClusterError


class FinishReason(enum.StrEnum):
    LENGTH = "length"  # max_new_tokens or max_model_len reached
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"  # the model's end-of-sequence token
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed (e.g. its adapter could not be loaded); see RequestOutput.error


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the top alternatives at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), at most k entries

    @property
    def rank(self) -> int | None:
        """1-based rank of the token among the alternatives (None when it is not among them)."""
        for i, (tid, _) in enumerate(self.top):
            if tid == self.token_id:
                return i + 1
        return None


@dataclass
class RequestOutput:
    """A snapshot of one request: cumulative text and ids, plus what is new since the last one."""

    request_id: str
    adapter_id: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: LoraClusterError | None = None
    time_to_first_token: float | None = None
    num_preemptions: int = 0  # times the request was preempted (and recomputed)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's name)
    device_s: float = 0.0  # engine step time charged to it so far (docs/metering.md), recomputes included
    queue_s: float = 0.0  # time it waited in the engine's queue to be scheduled (after preemptions too)
    logprobs: list[TokenLogprob] | None = None  # one per token id (asked with SamplingParams.logprobs)
    delta_logprobs: list[TokenLogprob] | None = None  # one per delta token id
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt id, first None; once prefilled

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

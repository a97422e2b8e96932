"""What the ingress and the LoRA replicas send each other (plain picklable objects).

A generation call is `LoraReplica.generate(job: GenerateJob)`, a streaming method. The request
router reads the job (the call's first argument) to learn the adapter and the routing keys of its
prompt's prefix (`GenerateJob.routing_prefix`, from the token ids the ingress tokenized; computed
once per job, on the router's first read, and carried to the replica, which records them); admin
calls that must reach one particular replica pass `ToReplica(replica_id)` as their first argument instead.

The replica yields dicts. The first one carries `replica` (its id) and `hit` (whether the adapter
was already on its device when the request arrived). An item is either an output (`OUTPUT_KEYS`),
or `{"error": ApiError dict}` after which the stream ends. A job with `stream=False` gets a single
output item, the final one; the ingress sends such a job as the unary call `LoraReplica.complete(job)`,
whose reply is that item (the router reads the job there the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lora_cluster.cluster.prefix_keys import routing_keys
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.errors import RequestAbortedError
from lora_cluster.request import RequestOutput, SamplingParams
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.serve.ops.logs import request_id

T = TypeVar("T")
_END = object()
_DEFAULT_CLASS = SlaClasses().default  # of the default configuration


@dataclass
class GenerateJob:
    """One sequence to generate (an OpenAI request with n=2 and two prompts is four jobs).

    `priority_class` is the request's SLA class (its name) and `priority` that class's priority
    (lower = more urgent), which the replica passes to the engine. A job built without them (a
    benchmark, an older caller) is in the default configuration's default class."""

    request_id: str
    prompt: str | list[int]
    adapter_id: str | None
    sampling: SamplingParams
    stream: bool = True
    adapter_path: str | None = None  # set for adapters registered through /v1/load_lora_adapter
    priority_class: str = _DEFAULT_CLASS.name
    priority: int = _DEFAULT_CLASS.priority
    replica_id: str | None = None  # granted by the cluster controller: run there (None: router's choice)
    ticket_id: str | None = None  # the cluster queue ticket it was granted with (the replica reports it)
    queued_s: float = 0.0  # how long it waited for that grant at the ingress (its usage record's queue_s)
    merge: MergeSpec | None = None  # a merged adapter (then `adapter_id` is `merge.adapter_id`)
    tenant: str | None = None  # the request's tenant (None: open server); picks its replica group
    base: str | None = None  # the base model a request without adapter names (None: the first group's)
    # the `x-request-id` of the HTTP request that built the job (set by default from `logs.request_id()`):
    # the replica logs the job's lines with it
    http_request_id: str | None = field(default_factory=request_id)

    @functools.cached_property
    def routing_prefix(self) -> tuple[str, ...]:
        """The routing keys of the prompt's prefixes (`cluster.prefix_keys`; empty for a text prompt)."""
        if isinstance(self.prompt, str):
            return ()
        return routing_keys(self.adapter_id, self.prompt)


@dataclass(frozen=True)
class ToReplica:
    """Route this call to the replica with this id (admin broadcast, debug)."""

    replica_id: str


def output_item(out: RequestOutput, *, full: bool) -> dict[str, Any]:
    """The wire form of one engine output; `full` adds the cumulative text (final items)."""
    return {
        "text": out.text if full else None,
        "delta_text": out.delta_text,
        "delta_token_ids": list(out.delta_token_ids),
        "token_ids": list(out.token_ids) if full else None,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.num_cached_tokens,  # prompt tokens found in the replica's prefix cache
        "completion_tokens": out.completion_tokens,
        "ttft_s": out.time_to_first_token,
        "device_s": out.device_s,  # engine time charged to it so far (the ingress's usage counters)
        "delta_logprobs": out.delta_logprobs,  # a TokenLogprob per delta id (None: not asked)
        "logprobs": out.logprobs if full else None,
        "prompt_logprobs": out.prompt_logprobs if full else None,
    }


def routing_key(args: tuple | list) -> tuple[str | None, str | None]:
    """(adapter id, target replica id) of a replica call, from its positional arguments."""
    first = args[0] if args else None
    if isinstance(first, ToReplica):
        return None, first.replica_id
    if isinstance(first, GenerateJob):
        return first.adapter_id, first.replica_id
    return None, None


def routing_prefix(args: tuple | list) -> tuple[str, ...]:
    """The routing keys of a generation call's prompt prefix (empty for any other call)."""
    first = args[0] if args else None
    return first.routing_prefix if isinstance(first, GenerateJob) else ()


async def batches(source: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """The items of `source` in groups: each group is everything that arrived while the consumer was
    busy with the previous one (one item per group when the consumer keeps up). A slow consumer thus
    gets fewer, larger messages instead of a growing backlog. An error of `source` is raised after
    the items that preceded it; closing this generator closes `source` (e.g. aborts the request).

    Invariant: however `source` ends (exhausted, an exception, or a `CancelledError` or other
    BaseException that did not come from closing this generator), the consumer gets that end and never
    waits forever. A cancellation of `source` itself reaches the consumer as `RequestAbortedError`:
    the consumer was not cancelled, so re-raising `CancelledError` into it would be a lie."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as exc:
            queue.put_nowait(exc)
        except BaseException as exc:  # CancelledError from the source, or this task cancelled on close
            aborted = RequestAbortedError(f"the request's output stream was cancelled ({type(exc).__name__})")
            aborted.__cause__ = exc
            queue.put_nowait(aborted)
            raise

    task = asyncio.create_task(pump())
    try:
        while True:
            got = [await queue.get()]
            while not queue.empty():
                got.append(queue.get_nowait())
            ends = [x for x in got if x is _END or isinstance(x, Exception)]
            group = [x for x in got if x is not _END and not isinstance(x, Exception)]
            if group:
                yield group
            if ends:
                if isinstance(ends[0], Exception):
                    raise ends[0]
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""A LoRA replica's usage record of one request, built where the facts are (issue 48).

`UsageTap.watch` passes the engine's outputs through and keeps the latest one; when the request
ends, however it ends, `UsageTap.record` builds its `UsageRecord` from the job (tenant, adapter and
its version, SLA class), the replica (its id, its base model) and that output (prompt, cached and
output tokens, device-seconds, preemptions, finish reason). Its `queue_s` is the request's whole wait:
for its grant in the cluster queue (`GenerateJob.queued_s`, measured by the ingress) plus in the
engine's queue (`RequestOutput.queue_s`). A request that ended with no output is
`refused` when the replica refused it, `cancelled` when its caller went away, else `failed`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from lora_cluster.request import RequestOutput
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.tenancy.usage_record import (
    MAX_FIELD_CHARS,
    Outcome,
    UsageRecord,
    adapter_version,
    final_outcome,
)


class UsageTap:
    """The latest output of one request, and the record built from it."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None

    async def watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """`outputs`, unchanged; closing this closes `outputs`."""
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                self.last = out
                yield out

    def record(self, job: GenerateJob, replica: str, base_model: str, *, cancelled: bool,
               refused: bool) -> UsageRecord:
        """The request's record, as it ended (see the module docstring)."""
        out = self.last
        adapter, version = adapter_version(job.adapter_id)
        if out is None:
            outcome = Outcome.REFUSED if refused else Outcome.CANCELLED if cancelled else Outcome.FAILED
        else:
            ended = cancelled and not out.finished
            outcome = final_outcome(out.finish_reason, ended, out.num_preemptions > 0)
        cut = MAX_FIELD_CHARS  # names past the store's bound are cut, never a failed request
        return UsageRecord(
            request_id=job.request_id[:cut], tenant=(job.tenant or "")[:cut], adapter=adapter[:cut],
            version=version, sla_class=job.priority_class[:cut], base_model=base_model[:cut],
            replica=replica[:cut],
            prompt_tokens=0 if out is None else len(out.prompt_token_ids),
            cached_tokens=0 if out is None else out.num_cached_tokens,
            output_tokens=0 if out is None else len(out.token_ids),
            device_s=0.0 if out is None else out.device_s,
            queue_s=job.queued_s + (0.0 if out is None else out.queue_s), outcome=outcome,
            ended_at=time.time(), preempted=out is not None and out.num_preemptions > 0)


__all__ = ["UsageTap"]

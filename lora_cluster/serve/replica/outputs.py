"""The engine's output stream as the replica hands it on: wire items, merged while the caller lags
(`coalesce`), and the SLA class's first-token and finish times taken on the way (`tracked`).
Closing either aborts the request in the engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from lora_cluster.cluster.class_stats import RequestTracker
from lora_cluster.request import RequestOutput
from lora_cluster.serve.protocol import batches, output_item


async def coalesce(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
    """Wire items of an engine output stream: one per output while the caller keeps up, else the
    outputs that queued up merged into one item (deltas joined). Closing it aborts the request."""
    async with contextlib.aclosing(batches(outputs)) as groups:  # closed here, not when collected
        async for group in groups:
            last = group[-1]
            item = output_item(last, full=last.finished)
            if len(group) > 1:
                item["delta_text"] = "".join(o.delta_text for o in group)
                item["delta_token_ids"] = [t for o in group for t in o.delta_token_ids]
                if last.delta_logprobs is not None:
                    item["delta_logprobs"] = [lp for o in group for lp in o.delta_logprobs or ()]
            yield item
            if last.finished:
                return


async def tracked(outputs: AsyncIterator[RequestOutput],
                  tracker: RequestTracker) -> AsyncIterator[RequestOutput]:
    """`outputs`, telling `tracker` when the first token and the final output arrive; closing it
    closes `outputs` (aborts the request)."""
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            if out.completion_tokens:
                tracker.first_token()
            if out.finished:
                tracker.finished(out.time_to_first_token, out.completion_tokens)
            yield out


__all__ = ["coalesce", "tracked"]

"""One job running on one replica, as the ingress holds it: its first item, the rest of its stream,
and the seat it takes in the cluster admission's books until its replica ends it.

Seat (`on_done`, `Dispatcher`: the admission's in-flight count of its replica): given back once the
replica has ended the job, not once the caller has read it. A job whose first item is its final one
(every non-streaming job: its unary reply is its whole result) gives it back as it starts; a stream is
read ahead of the caller (`read_ahead`: one task per stream, its items kept in order until the caller
takes them, at most the job's own output) and gives it back at the stream's end. So the seats of a
request's own choices never wait for the caller: a fan-out (`n > 1`, several prompts) with more
choices than the replicas have seats starts them all as seats free, where the seats held by its ended
but unread choices would otherwise keep its last choices parked until the cluster queue's timeout.
However the generation ends (its final item, an error, its replica lost, the caller's cancel),
`on_done` runs exactly once.

Usage is unchanged by reading ahead: `tokens` and `last` are what was handed on to the caller
(`items`), so a client that leaves is charged what it received (`Dispatcher`'s module docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from lora_cluster.serve.http_errors import ApiError, ApiException, describe
from lora_cluster.serve.ops import metrics
from lora_cluster.serve.ops.generation_metrics import GenerationMetrics
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.routing_guard import is_routing_error


def is_cancellation(exc: BaseException | None) -> bool:
    """Whether a replica call failed because it was cancelled under the request: Ray Serve cancels a
    request's calls when its client disconnects (`TaskCancelledError`, which Serve's
    `RequestCancelledError` is), sometimes before the request's own task sees its cancellation."""
    from ray import exceptions as ray_exc

    return isinstance(exc, ray_exc.TaskCancelledError)


def cancel_call(response: Any) -> None:
    """Cancel a Serve call. `cancel()` re-raises the call's own error when it already failed (for
    example BackPressureError); there is nothing left to cancel then."""
    with contextlib.suppress(Exception):
        response.cancel()


def _ends(item: dict[str, Any]) -> bool:
    """Whether a replica's item is the last of its stream (its final output, or its error)."""
    return bool(item.get("finished")) or "error" in item


@dataclass
class Generation:
    """One job running on one replica; iterate `items()` for its outputs (the first is already in)."""

    job: GenerateJob
    replica: str
    hit: bool
    first: dict[str, Any]
    stream: Any  # ray.serve.handle.DeploymentResponseGenerator (a DeploymentResponse: non-streaming job)
    tokens: int = 0
    finished: bool = field(default=False)
    on_done: Callable[[], None] | None = None  # called once when the generation ends, however it ends
    on_routing_error: Callable[[Generation], None] | None = None  # its replica died or went away mid-stream
    last: dict[str, Any] | None = None  # the last item passed on to the caller
    meter: GenerationMetrics | None = None  # its request metrics (labels: adapter, tenant, class)
    on_cancelled: Callable[[Generation], None] | None = None  # the ingress cancelled it before it ended
    # the items read ahead of the caller, and the task reading them (`read_ahead`; None: not read ahead)
    _ahead: asyncio.Queue[dict[str, Any] | Exception] | None = field(default=None, init=False, repr=False)
    _reader: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def _done(self) -> None:
        callback, self.on_done = self.on_done, None
        if callback is not None:
            callback()

    def read_ahead(self) -> None:
        """Give the seat back when the replica ends the job (module docstring): at once when the first
        item ends it, else when a task reading the stream ahead of the caller sees its end. Called
        once, on the event loop, as the generation starts."""
        if _ends(self.first):
            self._done()
            return
        self._ahead = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(self._ahead))

    async def _read(self, ahead: asyncio.Queue[dict[str, Any] | Exception]) -> None:
        """The stream's items into `ahead` up to its last one; a failure (its end included:
        StopAsyncIteration) is put there for `items` to raise. The seat is given back as it ends."""
        try:
            while True:
                item = await self.stream.__anext__()
                ahead.put_nowait(item)
                if _ends(item):
                    return
        except Exception as exc:  # handed to the reader of `items`, which raises it
            ahead.put_nowait(exc)
        finally:
            self._done()

    async def _next(self) -> dict[str, Any]:
        """The stream's next item: read ahead, or from the stream itself."""
        if self._ahead is None:
            return await self.stream.__anext__()
        got = await self._ahead.get()
        if isinstance(got, Exception):
            raise got
        return got

    async def items(self) -> AsyncIterator[dict[str, Any]]:
        """Output items to the final one; raises ApiException for an error item mid-stream."""
        item: dict[str, Any] | None = self.first
        try:
            while item is not None:
                if "error" in item:
                    self.finished = True  # the replica ended the stream: nothing to cancel
                    self._meter_failed()
                    raise ApiException(ApiError.from_dict(item["error"]))
                if self.meter is not None:  # by the cumulative count: a non-streaming item has one delta
                    self.meter.tokens(item["completion_tokens"] - self.tokens)
                self.tokens = item["completion_tokens"]
                self.last = item
                if item["finished"]:
                    self.finished = True
                    if self.meter is not None:
                        self.meter.finished(item["prompt_tokens"], item["completion_tokens"],
                                            item.get("cached_tokens") or 0, item.get("device_s") or 0.0)
                yield item
                if item["finished"]:
                    return
                try:
                    item = await self._next()
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    if not is_cancellation(exc):  # the replica's record, or the lost part, accounts for it
                        self.on_cancelled = None
                    if is_routing_error(exc):
                        metrics.ROUTING_ERRORS.inc()
                        if self.on_routing_error is not None:
                            self.on_routing_error(self)  # the replica died mid-stream
                    self._meter_failed()
                    raise ApiException(describe(exc)) from exc
        finally:
            if not self.finished:
                self.cancel()
            self._done()

    async def final(self) -> dict[str, Any]:
        """Run to the end; the final item (with the cumulative `text` and `token_ids`)."""
        last: dict[str, Any] = {}
        async for item in self.items():
            last = item
        return last

    def _meter_failed(self) -> None:
        if self.meter is not None:
            self.meter.failed()

    def cancel(self) -> None:
        """Abort the request on its replica (frees its batch slot). `tokens` then counts at least
        the tokens of the first item, which the replica generated whether or not anyone read it. A
        generation not yet ended first has `on_cancelled` record what was handed on (`last`), once."""
        self.tokens = max(self.tokens, int(self.first.get("completion_tokens") or 0))
        if not self.finished:
            self.finished = True
            callback, self.on_cancelled = self.on_cancelled, None
            if callback is not None:
                callback(self)
            metrics.CANCELLED.inc()
            if self.meter is not None:
                self.meter.cancelled()
            if self._reader is not None:
                self._reader.cancel()
            cancel_call(self.stream)
        self._done()

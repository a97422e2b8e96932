"""Server-sent events: framing, and the streaming response that carries the routing headers.

The generator behind an `EventStream` is closed when the client disconnects (Starlette cancels the
response task); the `on_close` callback then cancels the replica calls, which aborts the requests
in their engines. `on_close` runs exactly once however the response ends, also when it ends before
its first byte (the client went away while the headers were being sent: the generator never ran).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lora_cluster.serve.protocol import batches

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    """One SSE `data:` event with a JSON payload."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response; events that queue up while the previous write is in flight go out as one
    body chunk (still separate events), which saves per-message costs of the Serve proxy hop."""

    media_type = "text/event-stream"  # what a route with `response_class=EventStream` declares

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str], on_close: Callable[[], None]):
        self._on_close: Callable[[], None] | None = on_close

        async def guarded() -> AsyncIterator[bytes]:
            try:
                async for group in batches(events):
                    yield b"".join(group)
            finally:
                self._close()

        super().__init__(guarded(), media_type="text/event-stream",
                         headers={"cache-control": "no-cache", **headers})

    def _close(self) -> None:
        callback, self._on_close = self._on_close, None
        if callback is not None:
            callback()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()  # the response ended before its generator ran (or the generator closed it)

"""Request body limits, checked before FastAPI parses a body: size, UTF-8, JSON nesting depth.

Each refusal is a 400 in the OpenAI error shape naming the limit:

* `max_body_bytes` (default 1 MiB): a `content-length` above it is refused before anything is
  read; a body sent without one (chunked) is read up to the limit and refused there, never buffered
  further (`body_too_large`);
* the body must be valid UTF-8 (`invalid_utf8`; JSON bodies are UTF-8 by RFC 8259);
* arrays and objects may nest at most `max_json_depth` deep (`json_too_deep`): a deeply nested
  body would otherwise cost recursion in the JSON parser and in validation.

The checks are linear in the body (C-speed `bytes.decode` and regular expressions, see
`body_problem`); a body over `THREAD_ABOVE_BYTES` is checked on a worker thread, so that the event
loop never spends more than a fraction of a millisecond on one body. Requests without a body (GET)
pass untouched.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from lora_cluster.serve.http_errors import ApiError

THREAD_ABOVE_BYTES = 64 << 10
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"[\[{][\]}]")


def json_depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether the JSON `text` nests arrays/objects deeper than `max_depth` (a malformed text is left
    to the JSON parser: only nesting that provably goes deeper counts)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(max_depth):  # each pass removes the innermost level
        brackets = _INNERMOST.sub("", brackets)
        if not brackets:
            return False
    return _INNERMOST.search(brackets) is not None


def body_problem(body: bytes, max_depth: int) -> ApiError | None:
    """The 400 for a body that is not UTF-8 or nests too deep; None when it passes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _error("invalid_utf8", f"the request body is not valid UTF-8 (byte {exc.start})")
    if json_depth_exceeds(text, max_depth):
        return _error("json_too_deep", f"the request body nests JSON arrays/objects deeper than "
                                       f"max_json_depth={max_depth}")
    return None


def _error(code: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", code, message)


def _too_large(limit: int) -> ApiError:
    return _error("body_too_large", f"the request body exceeds max_body_bytes={limit} bytes")


class BodyLimitsMiddleware:
    """ASGI middleware applying the limits (see the module docstring), then replaying the body."""

    def __init__(self, app: Any, max_bytes: int, max_depth: int):
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _respond(send, _too_large(self.max_bytes))
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _respond(send, _too_large(self.max_bytes))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if len(body) > THREAD_ABOVE_BYTES:
            problem = await asyncio.to_thread(body_problem, body, self.max_depth)
        else:
            problem = body_problem(body, self.max_depth)
        if problem is not None:
            await _respond(send, problem)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _respond(send: Any, error: ApiError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})

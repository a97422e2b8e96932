"""Log lines of lora-cluster: one format per process (`text` or `json`) and the request id in every line.

Request id: `x-request-id` is accepted from the client, or generated when absent, and echoed on every
response (`RequestIdMiddleware`; under Ray Serve the HTTP proxy already accepts, generates and echoes
it, so the app only reads it there). The id lives in a context variable for the request's task
(`request_id()`); the ingress puts it into each `GenerateJob` (`GenerateJob.http_request_id`) and the
replica sets it for its generation (`set_request_id`), so replica-side lines of that request carry it
too. Work handed to threads must copy the context (`contextvars.copy_context().run`) to keep it;
long-lived background tasks started during a request must not keep it (`detached()`).

Policy of `configure_logging`: one handler on the `lora_cluster` logger (not the root logger, which
Ray and other libraries configure for themselves), writing to the process's own stderr,
`sys.__stderr__` (a Ray worker's stderr is its log file, streamed to `serve run`'s console; Ray
Serve's throughput-optimized mode replaces a replica's `sys.stderr` by a proxy into Serve's own
buffered log file, which would hide the ready line). Calling it again replaces that handler, never
adds a second.
Every line carries `request_id` (`-` outside a request). JSON lines are one object per line:
`ts` (ISO 8601, UTC), `level`, `logger`, `message`, `request_id`, and `exc_info` when there is one.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
import uuid
from typing import IO, Any, Literal

LogFormat = Literal["text", "json"]
HEADER_REQUEST_ID = "x-request-id"
MAX_REQUEST_ID_CHARS = 128  # a longer client id is cut: it is echoed and logged with every line
NO_REQUEST = "-"
LOGGER = "lora_cluster"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("lora_cluster_request_id",
                                                                         default=None)


def request_id() -> str | None:
    """The id of the request this task serves (None outside a request)."""
    return _request_id.get()


def set_request_id(value: str | None) -> contextvars.Token:
    """Make `value` the current request's id for this task (and the tasks it starts from now on)."""
    return _request_id.set(value)


def detached() -> contextvars.Context:
    """A fresh, empty context for a background task started while serving a request
    (`loop.create_task(coro, context=detached())`): its lines belong to no request, neither ours
    (no request id) nor Ray Serve's (its request context, also a context variable, is left behind)."""
    return contextvars.Context()


def new_request_id() -> str:
    return uuid.uuid4().hex


def clean_request_id(value: str | None) -> str:
    """A client's id as it is logged and echoed: printable ASCII, at most MAX_REQUEST_ID_CHARS;
    a missing or empty one is replaced by a new id."""
    text = "".join(c for c in (value or "") if 32 < ord(c) < 127)[:MAX_REQUEST_ID_CHARS]
    return text or new_request_id()


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the current request's id, or `-`) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = request_id() or NO_REQUEST
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", NO_REQUEST),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def make_formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    return logging.Formatter(TEXT_FORMAT)


_HANDLER_NAME = "lora-cluster"


def configure_logging(log_format: LogFormat = "text", level: int | str = logging.INFO,
                      stream: IO[str] | None = None) -> logging.Handler:
    """Install (or replace) the one handler of the `lora_cluster` logger; returns it."""
    logger = logging.getLogger(LOGGER)
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.__stderr__)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(make_formatter(log_format))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the root logger belongs to Ray: no line twice
    return handler


class RequestIdMiddleware:
    """ASGI middleware: the request's id from `x-request-id` (a new one when absent) for the duration of
    the request, and, when `echo`, the same header on the response. Under Ray Serve the proxy has
    already set and will echo the header, so the ingress passes `echo=False` (no second header)."""

    def __init__(self, app: Any, echo: bool = True):
        self.app, self.echo = app, echo

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope.get("headers", ()) if k == HEADER_REQUEST_ID.encode()), None)
        rid = clean_request_id(raw.decode("latin-1") if raw is not None else None)
        token = set_request_id(rid)

        async def send_with_id(message: dict) -> None:
            if self.echo and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (HEADER_REQUEST_ID.encode(), rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
        # an exception leaves the id set: Starlette's outermost error handler still logs with it
        _request_id.reset(token)

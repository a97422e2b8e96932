"""THE one place that maps exceptions to HTTP status codes and the OpenAI error shape.

Every API route, and the replicas (which report errors inside their output stream), call
`describe(exc)`; nothing else picks status codes. The body is OpenAI's
`{"error": {"message", "type", "code"}}`, for the LoRAX and vLLM routes too (the LoRAX client maps
errors by status code).

| exception                                   | status | type                  | code                |
|---------------------------------------------|--------|-----------------------|---------------------|
| PromptTooLongError                          | 400    | invalid_request_error | prompt_too_long     |
| RequestError, request validation            | 400    | invalid_request_error | invalid_parameter   |
| AdapterNotFoundError                        | 404    | not_found_error       | adapter_not_found   |
| AdapterFormat/Rank/Shape/IntegrityError     | 400    | invalid_request_error | invalid_adapter     |
| EngineOverloadedError, AdapterCapacityError | 429    | rate_limit_error      | overloaded          |
| Ray Serve BackPressureError                 | 429    | rate_limit_error      | overloaded          |
| AdapterSourceUnavailableError (Retry-After) | 503    | service_unavailable   | source_unavailable  |
| AdapterLoadError                            | 503    | service_unavailable   | adapter_unavailable |
| NoReplicaError, dead/unavailable replicas   | 503    | service_unavailable   | no_replica          |
| EngineUnavailableError                      | 503    | service_unavailable   | engine_unavailable  |
| EngineStepError                             | 500    | server_error          | engine_error        |
| ClusterOverloadedError (Retry-After: its s) | 429    | rate_limit_error      | overloaded          |
| ClusterQueueTimeoutError                    | 503    | service_unavailable   | queue_timeout       |
| RoutingUnavailableError (Retry-After)       | 503    | service_unavailable   | routing_unavailable |
| ControllerOffError                          | 503    | service_unavailable   | controller_unavailable |
| RegistryUnavailableError                    | 503    | service_unavailable   | registry_unavailable |
| cancelled call (client disconnect): INFO log | 503   | service_unavailable   | aborted             |
| AuthenticationError (no or unknown API key) | 401    | invalid_request_error | missing/invalid_api_key |
| PermissionDeniedError (tenant key, admin route) | 403 | permission_error     | permission_denied   |
| QuotaExceededError (Retry-After: its s)     | 429    | rate_limit_error      | rate_limit_exceeded |
| BudgetExceededError (Retry-After: month end) | 429   | rate_limit_error      | budget_exceeded     |
| QuotaUnavailableError (ledger unreachable) | 503    | service_unavailable   | quota_unavailable   |
| UsageUnavailableError (no usage store)     | 503    | service_unavailable   | usage_unavailable   |
| ReleaseConflictError (a release's state)    | 409    | invalid_request_error | release_conflict    |
| ReleaseStateUnavailableError (state store)  | 503    | service_unavailable   | release_state_unavailable |
| anything else                               | 500    | server_error          | internal_error      |

No information leaks: every error body passes `ApiError.body()`, which replaces local filesystem
paths (`/abs/path`, `~/path`, `file://...`) in the message with `<path>`. An unknown adapter's 404
says only that the adapter does not exist or is not accessible, in one body whatever the reason
(no source has it, its registered path is gone, or the caller's tenant may not use it: see
`not_found_adapter`), so that a tenant cannot learn which adapters other tenants have. A 500 names
the exception's type only (the details, and the traceback, go to the server log); Ray's errors are
summarised by type, never by their text (which can carry tracebacks and node addresses).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from dataclasses import asdict, dataclass

from lora_cluster import errors as e

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiError:
    status: int
    type: str
    code: str
    message: str
    retry_after_s: float | None = None  # 429/503: when a retry may succeed (the Retry-After header)

    def body(self) -> dict:
        """The OpenAI error body; the message's filesystem paths are replaced (see the module doc)."""
        return {"error": {"message": scrub(self.message), "type": self.type, "code": self.code}}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ApiError:
        retry = d.get("retry_after_s")
        return cls(int(d["status"]), str(d["type"]), str(d["code"]), str(d["message"]),
                   None if retry is None else float(retry))

    def retry_after_header(self) -> dict[str, str]:
        """`Retry-After` in whole seconds (at least 1) for 429 and 503, else nothing."""
        if self.status not in (429, 503):
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s or 1)))}


# a file:// URI, or an absolute or ~ path that is not one of the API's own routes
_PATH = re.compile(r"file://\S+|(?<![\w.:/~-])~?/(?!(?:v1|generate|generate_stream|health|metrics|debug)\b)"
                   r"(?:[\w.@%+=,~-]+/)*[\w.@%+=~-]+/?")


def scrub(message: str) -> str:
    """`message` with every local filesystem path replaced by `<path>` (s3:// and hf:// URIs stay:
    they name the adapter source an operator configured)."""
    return _PATH.sub("<path>", message)


def not_found_adapter(adapter_id: str) -> str:
    """THE message of every unknown or inaccessible adapter's 404 (one body whatever the reason)."""
    return f"adapter {adapter_id!r} does not exist or you do not have access to it"


class ApiException(Exception):
    """Raised inside the HTTP layer to answer with `error`."""

    def __init__(self, error: ApiError):
        self.error = error
        super().__init__(error.message)


class NoReplicaError(e.LoraClusterError):
    """No LoRA replica is running (or the targeted one is gone)."""


def bad_request(message: str, code: str = "invalid_parameter") -> ApiException:
    return ApiException(ApiError(400, "invalid_request_error", code, message))


def not_found(message: str, code: str = "not_found") -> ApiException:
    return ApiException(ApiError(404, "not_found_error", code, message))


def conflict(message: str, code: str) -> ApiException:
    """409: the request is valid but conflicts with the server's state (a name already taken)."""
    return ApiException(ApiError(409, "invalid_request_error", code, message))


_DOMAIN: list[tuple[type[BaseException], int, str, str]] = [
    (e.PromptTooLongError, 400, "invalid_request_error", "prompt_too_long"),
    (e.RequestError, 400, "invalid_request_error", "invalid_parameter"),
    (e.AdapterNotFoundError, 404, "not_found_error", "adapter_not_found"),
    (e.AdapterBaseConflictError, 409, "invalid_request_error", "adapter_base_conflict"),
    (e.AdapterCapacityError, 429, "rate_limit_error", "overloaded"),
    (e.AdapterLoadError, 503, "service_unavailable", "adapter_unavailable"),
    (e.AdapterError, 400, "invalid_request_error", "invalid_adapter"),
    (e.EngineOverloadedError, 429, "rate_limit_error", "overloaded"),
    (NoReplicaError, 503, "service_unavailable", "no_replica"),
    (e.RequestAbortedError, 503, "service_unavailable", "aborted"),
    (e.EngineUnavailableError, 503, "service_unavailable", "engine_unavailable"),
    (e.EngineStepError, 500, "server_error", "engine_error"),
    (e.ClusterQueueTimeoutError, 503, "service_unavailable", "queue_timeout"),
    (e.ControllerOffError, 503, "service_unavailable", "controller_unavailable"),
    (e.RegistryUnavailableError, 503, "service_unavailable", "registry_unavailable"),
    (e.ReleaseStateUnavailableError, 503, "service_unavailable", "release_state_unavailable"),
    (e.PermissionDeniedError, 403, "permission_error", "permission_denied"),
    (e.QuotaUnavailableError, 503, "service_unavailable", "quota_unavailable"),
    (e.UsageUnavailableError, 503, "service_unavailable", "usage_unavailable"),
    (e.ReleaseConflictError, 409, "invalid_request_error", "release_conflict"),
]


def _ray_error(exc: BaseException) -> ApiError | None:
    """Ray Serve's own failures: overload (429) and replicas that cannot serve (503)."""
    try:
        from ray import exceptions as ray_exc
        from ray.serve import exceptions as serve_exc
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if isinstance(exc, ray_exc.TaskCancelledError):  # Serve's RequestCancelledError is one too
        return cancelled(exc)
    if isinstance(exc, serve_exc.BackPressureError):
        return ApiError(429, "rate_limit_error", "overloaded", f"server overloaded, retry later: {exc}")
    unavailable = (serve_exc.DeploymentUnavailableError, ray_exc.ActorDiedError,
                   ray_exc.ActorUnavailableError, ray_exc.ActorUnschedulableError)
    if isinstance(exc, unavailable):
        return ApiError(503, "service_unavailable", "no_replica",
                        f"no replica can serve the request ({type(exc).__name__})")
    if isinstance(exc, ray_exc.RayTaskError) and isinstance(exc.cause, BaseException):
        return describe(exc.cause) if not isinstance(exc.cause, ray_exc.RayTaskError) else None
    return None


def cancelled(exc: BaseException) -> ApiError:
    """A call cancelled under the request, normally because its client disconnected (Ray Serve then
    cancels the request's calls, which raise `TaskCancelledError`): one INFO line, no traceback."""
    log.info("request cancelled (client disconnected?): %s", type(exc).__name__)
    return ApiError(503, "service_unavailable", "aborted", "the request was cancelled")


def describe(exc: BaseException) -> ApiError:
    """The HTTP error for an exception (see the module table)."""
    if isinstance(exc, ApiException):
        return exc.error
    if isinstance(exc, asyncio.CancelledError):
        return cancelled(exc)
    if isinstance(exc, e.ClusterOverloadedError):
        return ApiError(429, "rate_limit_error", "overloaded", str(exc), exc.retry_after_s)
    if isinstance(exc, e.RoutingUnavailableError):
        return ApiError(503, "service_unavailable", "routing_unavailable", str(exc), exc.retry_after_s)
    if isinstance(exc, e.AdapterSourceUnavailableError):
        return ApiError(503, "service_unavailable", "source_unavailable", str(exc), exc.retry_after_s)
    if isinstance(exc, e.QuotaExceededError):
        return ApiError(429, "rate_limit_error", "rate_limit_exceeded", str(exc), exc.retry_after_s)
    if isinstance(exc, e.BudgetExceededError):
        return ApiError(429, "rate_limit_error", "budget_exceeded", str(exc), exc.retry_after_s)
    if isinstance(exc, e.AuthenticationError):
        return ApiError(401, "invalid_request_error", exc.code, str(exc))
    if isinstance(exc, e.AdapterNotFoundError) and not isinstance(exc, e.AdapterIdError):
        return ApiError(404, "not_found_error", "adapter_not_found", not_found_adapter(exc.adapter_id))
    for cls, status, kind, code in _DOMAIN:
        if isinstance(exc, cls):
            return ApiError(status, kind, code, str(exc))
    ray_error = _ray_error(exc)
    if ray_error is not None:
        return ray_error
    log.error("unexpected error", exc_info=exc)
    return ApiError(500, "server_error", "internal_error",
                    f"internal error ({type(exc).__name__}); the server log has the details")


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 naming the invalid fields of a request body (FastAPI/pydantic validation errors); unknown
    fields of a body that forbids them are OpenAI's "Unrecognized request argument supplied"."""
    unknown = [".".join(str(p) for p in err.get("loc", ()) if p != "body") for err in errors
               if err.get("type") == "extra_forbidden"]
    if unknown and len(unknown) == len(errors):
        return ApiError(400, "invalid_request_error", "unknown_parameter",
                        f"Unrecognized request argument supplied: {', '.join(unknown[:5])}")
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return ApiError(400, "invalid_request_error", "invalid_parameter", "invalid request: " + "; ".join(parts))


def allowed_methods(request) -> list[str]:
    """The methods the app's OpenAPI schema declares for the request's path (a path may have a route
    per method: GET and POST of `/v1/adapters/{name}/releases`)."""
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)), request.url.path):
            methods |= {method.upper() for method in operations}
    return sorted(methods)


def install_handlers(app) -> None:
    """Make a FastAPI app answer every error in the OpenAI shape with the status from `describe`."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.retry_after_header())

    async def on_validation(_request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(list(exc.errors())))

    async def on_http(request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = respond(ApiError(exc.status_code, kind, "http_error", str(exc.detail)))
        response.headers.update(exc.headers or {})  # e.g. `Allow` on a 405, which RFC 9110 requires
        if exc.status_code == 405:  # every route of the path, not only the first one Starlette matched
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    async def on_any(_request, exc: Exception) -> JSONResponse:
        return respond(describe(exc))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(ApiException, on_any)
    app.add_exception_handler(e.LoraClusterError, on_any)
    app.add_exception_handler(Exception, on_any)

"""The HTTP contract as the OpenAPI schema states it: every status, its body, SSE, the headers.

Generated clients and API gateways read `/openapi.json`; it must say what the app really answers.
This module is the one place that declares it. Each route passes one of the profiles below as
FastAPI's `responses=`; each profile lists the statuses that route answers, every error with the
OpenAI-shaped body that `http_errors` produces (`ErrorBody`), `Retry-After` on 429 and 503, the
routing headers on generations, and `text/event-stream` on the routes that stream. `install_openapi`
removes FastAPI's automatic 422 entries: validation errors are answered 400 (`http_errors`).

Which status means what is `http_errors`'s table; here is only which route can answer which.
Authentication (401) and admin-only routes (403) apply when a tenants file is configured; the
body limit (413) to every request with a body. With a tenants file the schema also declares the two
ways to send a key (`securitySchemes`: bearer and `x-api-key`), required on every route except
the `open_routes`, which declare none; every route that needs a key lists 401 and 403.

The schema and its pages (`/openapi.json`, `/docs`, `/redoc`) are served by routes of the app
itself (`install_openapi`), not by FastAPI's built-in ones, so that authentication covers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

from lora_cluster.errors import ConfigError
from lora_cluster.serve.http.request_policy import HEADER_PRIORITY
from lora_cluster.serve.routing.auth import HEADER_API_KEY, Authenticator


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, naming the parameter, adapter or limit.")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error, rate_limit_error.")
    code: str = Field(description="Machine-readable code, e.g. prompt_too_long, adapter_not_found.")


class ErrorBody(BaseModel):
    """Every error response, on every route (OpenAI's shape, also for the LoRAX and vLLM routes)."""

    error: ErrorDetail


_MEANING = {
    400: "Invalid request: malformed JSON or UTF-8, a parameter out of range or unsupported, a prompt "
         "over the token limit, an invalid adapter.",
    401: "Missing or unknown API key (`Authorization: Bearer <key>` or `x-api-key`; tenants file).",
    403: "The API key may not use this route (admin routes need an admin key).",
    404: "Unknown adapter (or one the caller may not use), or an adapter that was not loaded.",
    409: "The name is already loaded, being loaded or unloaded, or no more adapters can be loaded.",
    413: "The request body is larger than the limit.",
    429: "Overloaded or over quota: retry after `Retry-After` seconds.",
    500: "The engine failed while generating (the error names the exception's type only).",
    503: "No replica, adapter source, cluster queue or controller can serve now: retry after "
         "`Retry-After` seconds.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds after which a retry may succeed.",
                                "schema": {"type": "integer", "minimum": 1}}}
_ROUTING_HEADERS = {
    "x-lora-replica": {"description": "The replica(s) that served the request, comma-separated.",
                       "schema": {"type": "string"}},
    "x-lora-adapter-hit": {"description": "Whether the adapter was already on the replica's device.",
                           "schema": {"type": "string", "enum": ["true", "false"]}},
    "x-lora-priority-class": {"description": "The SLA class that served the request.",
                              "schema": {"type": "string"}},
    "x-lora-truncated-tokens": {"description": "Tokens cut from the request's prompts to fit the prompt "
                                "limit (prompt_truncation: auto; absent when none were).",
                                "schema": {"type": "integer", "minimum": 1}},
    "x-lora-adapter-version": {"description": "The version of the adapter that answered (`name@N`'s N; "
                               "absent for the base model and a merge).",
                               "schema": {"type": "integer", "minimum": 1}},
    "x-lora-cached-tokens": {"description": "Prompt tokens whose KV came from the replicas' prefix caches "
                             "(once per prompt, as usage.prompt_tokens_details.cached_tokens).",
                             "schema": {"type": "integer", "minimum": 0}},
}
SSE_CONTENT = {"text/event-stream": {"itemSchema": {  # one event (OpenAPI 3.2's itemSchema, as FastAPI)
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "A JSON chunk; an error after the first token "
                            "as `{\"error\": ...}` (ErrorBody); the OpenAI routes end with `[DONE]`."},
                   "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer", "minimum": 0}}}}}
TEXT_CONTENT = {"text/plain": {"schema": {"type": "string"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for these error statuses, each with `ErrorBody`."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": _MEANING[status]}
        if status in (429, 503):
            entry["headers"] = _RETRY_AFTER
        out[status] = entry
    return out


_GENERATION_ERRORS = (400, 401, 403, 404, 413, 429, 500, 503)

# POST /v1/completions, /v1/chat/completions, / : JSON, or SSE with `stream: true`
GENERATION = {200: {"description": "The generation (JSON), or its chunks as server-sent events when the "
                    "request asks for `stream: true`.", "headers": _ROUTING_HEADERS, "content": SSE_CONTENT},
              **errors(*_GENERATION_ERRORS)}
# POST /generate: JSON only
GENERATION_JSON = {200: {"description": "The generation.", "headers": _ROUTING_HEADERS},
                   **errors(*_GENERATION_ERRORS)}
# POST /generate_stream: SSE only (the route's response_class is `sse.EventStream`)
GENERATION_STREAM = {200: {"description": "The generation's tokens as server-sent events.",
                           "headers": _ROUTING_HEADERS, "content": SSE_CONTENT},
                     **errors(*_GENERATION_ERRORS)}
# GET /v1/models
LISTING = errors(401, 403, 429, 503)
# POST /v1/load_lora_adapter, /v1/unload_lora_adapter (text/plain success, as vLLM)
ADMIN_ACTION = errors(400, 401, 403, 404, 409, 413, 503)
# GET /v1/cluster, /debug/replicas
ADMIN_VIEW = errors(400, 401, 403, 503)
# /v1/adapters/{name}/releases...: JSON, a release's status, list or events
RELEASE_VIEW = errors(400, 401, 403, 404)
RELEASE_ACTION = errors(400, 401, 403, 404, 409, 413, 503)
# GET /health
HEALTH = errors(503)


SCHEMA_URL = "/openapi.json"
DESCRIPTION_ROUTES = (SCHEMA_URL, "/docs", "/redoc")
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <key>`."},
    "apiKey": {"type": "apiKey", "in": "header", "name": HEADER_API_KEY,
               "description": "`x-api-key: <key>`."},
}
_KEY_REQUIRED = [{"bearer": []}, {"apiKey": []}]  # either header


def _describe_routes(app: FastAPI, schema: Any) -> None:
    """`/openapi.json`, `/docs` and `/redoc` as the app's own routes (not in the schema)."""

    @app.get(SCHEMA_URL, include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        # built once, off the loop: the limits it states are measured with the chat templates
        return JSONResponse(await asyncio.to_thread(schema))

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=SCHEMA_URL, title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=SCHEMA_URL, title=f"{app.title} - ReDoc")


def _check_open_routes(app: FastAPI, auth: Authenticator, generate: Callable[[], dict[str, Any]]) -> None:
    """Every open route is a route of the app (a typo would otherwise leave nothing open, silently);
    `generate`: FastAPI's own schema, whose paths are the app's (the bodies' limits are not needed)."""
    paths = {*generate().get("paths", {}), *DESCRIPTION_ROUTES}
    unknown = sorted(auth.open_routes - paths)
    if unknown:
        raise ConfigError(f"open_routes lists {', '.join(unknown)}, which is not a route of the API "
                          f"(routes: {', '.join(sorted(paths))})")


def _declare_auth(path: str, operation: dict[str, Any], auth: Authenticator | None) -> None:
    if auth is None or auth.is_open(path):
        return
    operation["security"] = _KEY_REQUIRED
    responses = operation.setdefault("responses", {})
    for status, entry in errors(401, 403).items():
        if str(status) not in responses:
            responses[str(status)] = {"description": entry["description"], "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorBody"}}}}


def install_openapi(app: FastAPI, priority_classes: Sequence[str] = (), auth: Authenticator | None = None,
                    bodies: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Serve the schema (`/openapi.json`, `/docs`, `/redoc`: build the app with FastAPI's own turned
    off) without FastAPI's automatic 422 entries (validation errors are 400 here), with
    every error body as application/json (FastAPI files an error model under the route's own media
    type, e.g. text/event-stream for /generate_stream), with the configured SLA class names as
    the values the `x-lora-priority` header may take (another name is a 400), and, when `auth`
    requires keys, the key headers on every route but the open ones. `bodies(component_schemas)`
    adds the configured limits and the rules between fields to the request bodies
    (`schema_limits.constrain`). ConfigError when an open route is not a route of the app."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            if auth is not None and auth.secured:
                schema.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
            if bodies is not None:
                bodies(schema["components"]["schemas"])
            for route, path in schema.get("paths", {}).items():
                for operation in path.values():
                    _declare_auth(route, operation, auth if auth is not None and auth.secured else None)
                    for parameter in operation.get("parameters", ()):
                        if parameter.get("name") == HEADER_PRIORITY and priority_classes:
                            parameter["schema"] = {"type": "string", "enum": list(priority_classes)}
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    for status, response in responses.items():
                        content = response.get("content")
                        if content and "itemSchema" in content.get("text/event-stream", {}):
                            content["text/event-stream"].pop("schema", None)  # FastAPI's, for the stream
                        if status[0] in "45" and content and "application/json" not in content:
                            response["content"] = {"application/json": next(iter(content.values()))}
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    _describe_routes(app, openapi)
    if auth is not None:
        _check_open_routes(app, auth, generate)
        app.openapi_schema = None  # FastAPI's generator keeps what it made: the served schema is built anew

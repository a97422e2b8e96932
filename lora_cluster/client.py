"""A small HTTP client of a running lora-cluster server, for the `lora-cluster` command line.

Standard library only (urllib), blocking, one request per call. Every failure becomes a
`ServerError` whose message is one line fit for a terminal: the server is not reachable (with the
URL and the cause), or it answered an error (status and the OpenAI-shaped error's message).
`--api-key` is sent as `Authorization: Bearer <key>`.

Calls: `cluster()` (GET /v1/cluster), `models()` (GET /v1/models), `load_adapter` and
`unload_adapter` (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter), `health()`.
`status_lines(view)` renders the cluster view as `lora-cluster status` prints it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
MAX_ERROR_CHARS = 300  # of a non-JSON error body shown to the user


class ServerError(Exception):
    """A call failed; `str(e)` is one line. `status` is the HTTP status (None: no answer); `api_error`:
    the answer was an OpenAI-shaped error body (a lora-cluster server answered)."""

    def __init__(self, message: str, status: int | None = None, api_error: bool = False):
        super().__init__(message)
        self.status, self.api_error = status, api_error


class LoraClusterClient:
    """Talks to the server at `url` (scheme, host and port; a path prefix is kept)."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            message, api_error = _error_message(exc.read())
            raise ServerError(f"{method} {path}: HTTP {exc.code}: {message}", exc.code, api_error) from None
        except urllib.error.URLError as exc:
            raise ServerError(f"server not reachable at {self.url}: {exc.reason}") from None
        except TimeoutError:
            raise ServerError(f"server at {self.url} did not answer within {self.timeout_s:g} s") from None
        except (ConnectionError, OSError) as exc:
            raise ServerError(f"server not reachable at {self.url}: {exc}") from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        _, raw = self._call(method, path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{method} {path}: the answer is not JSON (is {self.url} a lora-cluster "
                              f"server?)") from None

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def usage(self, **params: Any) -> list[dict[str, Any]]:
        """Usage sums per group (GET /v1/usage; `sla_class` is the query's `class`); None values are
        left out."""
        query = {("class" if k == "sla_class" else k): v for k, v in params.items() if v is not None}
        path = "/v1/usage" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        return self._json("GET", path)["data"]

    def cluster(self) -> dict[str, Any]:
        """The cluster controller's view (GET /v1/cluster)."""
        return self._json("GET", "/v1/cluster")

    def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: the base model first, then the adapters."""
        return list(self._json("GET", "/v1/models").get("data", []))

    def load_adapter(self, name: str, path: str) -> str:
        """Register the adapter at `path` (a folder the replicas can read) as `name`; the server's answer."""
        return self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})[1].decode()

    def unload_adapter(self, name: str) -> str:
        return self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})[1].decode()

    def create_release(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/adapters/{name}/releases: the new release's status."""
        return self._json("POST", f"/v1/adapters/{name}/releases", body)

    def releases(self, name: str) -> list[dict[str, Any]]:
        """GET /v1/adapters/{name}/releases: the releases of `name`, oldest first."""
        return list(self._json("GET", f"/v1/adapters/{name}/releases").get("data", []))

    def release(self, name: str, release_id: str, action: str | None = None) -> Any:
        """One release's status (action None), its audit log (`events`), or a command's answer
        (`promote`, `pause`, `resume`, `rollback`)."""
        path = f"/v1/adapters/{name}/releases/{release_id}"
        if action is None:
            return self._json("GET", path)
        if action == "events":
            return list(self._json("GET", f"{path}/events").get("data", []))
        return self._json("POST", f"{path}/{action}")


def _error_message(raw: bytes) -> tuple[str, bool]:
    """(the `error.message` of an OpenAI-shaped error body, else the body's start, on one line;
    whether the body was OpenAI-shaped)."""
    try:
        message, api_error = str(json.loads(raw)["error"]["message"]), True
    except (ValueError, KeyError, TypeError):
        message, api_error = raw.decode("utf-8", "replace")[:MAX_ERROR_CHARS], False
    return " ".join(message.split()) or "(no message)", api_error


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f} MiB"


def status_lines(view: dict[str, Any], *, url: str) -> list[str]:
    """The cluster view as text: one block per node and replica (device tier, loading, host tier);
    with replica groups (`{"groups": {name: view}}`), one such section per group."""
    if "groups" in view:
        lines = []
        for name, group_view in sorted(view["groups"].items()):
            lines.append(f"group {name}")
            lines.extend(f"  {line}" for line in status_lines(group_view, url=url))
        return lines
    ctl, queue = view.get("controller", {}), view.get("queue", {})
    by_class = ", ".join(f"{c} {n}" for c, n in sorted(queue.get("by_class", {}).items())) or "empty"
    lines = [f"server {url}: {ctl.get('replicas', 0)} replicas, controller up {ctl.get('up_s', 0):.0f} s",
             f"queue: {queue.get('depth', 0)}/{queue.get('size', '?')} waiting ({by_class}), "
             f"oldest {queue.get('oldest_wait_s', 0):.1f} s"]
    for node_id, node in sorted(view.get("nodes", {}).items()):
        lines.append(f"node {node_id[:16]}")
        for rid, r in sorted(node.get("replicas", {}).items()):
            adapters, memory = r.get("adapters", {}), r.get("memory", {})
            lines.append(f"  replica {rid}: running {r.get('running', 0)}, waiting {r.get('waiting', 0)}, "
                         f"free {r.get('free', 0)}/{r.get('capacity', 0)}, adapter slots free "
                         f"{r.get('free_adapter_slots', 0)}/{r.get('max_loras', 0)}")
            lines.append(f"    device: {', '.join(adapters.get('resident', [])) or '-'}"
                         f"  loading: {', '.join(adapters.get('loading', [])) or '-'}")
            lines.append(f"    host cache: {_mib(memory.get('host_cache'))} of "
                         f"{_mib(memory.get('host_cache_budget'))}; kv cache {_mib(memory.get('kv_cache'))}, "
                         f"adapter pool {_mib(memory.get('adapter_pool'))}, "
                         f"device free {_mib(memory.get('free'))}")
    for adapter, replicas in sorted(view.get("placement", {}).items()):
        lines.append(f"placement: {adapter} -> {', '.join(replicas)}")
    return lines

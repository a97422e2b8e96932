"""The `lora-cluster` command line without a lora-cluster server: demo zoo safety, progress bars, the
HTTP client's errors and headers. (`status` and `adapters` against a running server: test_serve_e2e.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from lora_cluster.cli import main

# ----- lora-cluster demo: an existing zoo built with other arguments is not silently replaced ------------


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_demo_refuses_other_arguments_into_an_existing_zoo_unless_forced(tmp_path, capsys):
    out = tmp_path / "zoo"
    assert main(["demo", "--out", str(out), "--num-adapters", "3"]) == 0, "the first build succeeds"
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--num-adapters", "1"]) == 1, "other arguments are refused"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, f"the refusal is one line: {err}"
    assert "3 adapters" in err[0] and "1 adapters" in err[0], f"it names both zoos: {err}"
    assert "--force" in err[0], f"it says how to replace the zoo: {err}"
    assert _manifest(out)["num_adapters"] == 3, "the existing zoo is left as it was"
    assert main(["demo", "--out", str(out), "--num-adapters", "3"]) == 0, "the same arguments reuse it"
    assert main(["demo", "--out", str(out), "--num-adapters", "1", "--force"]) == 0, "--force replaces it"
    assert _manifest(out)["num_adapters"] == 1, "the zoo now has the new adapter count"
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["a0"], "and only its adapters"


def test_demo_progress_bar_on_request_and_not_in_a_pipe(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "quiet"), "--num-adapters", "2"]) == 0, "a plain build"
    assert "demo adapters" not in capsys.readouterr().err, "no bar when stderr is not a terminal"
    assert main(["demo", "--out", str(tmp_path / "bar"), "--num-adapters", "2", "--progress"]) == 0, (
        "a build with --progress")
    err = capsys.readouterr().err
    assert "demo adapters" in err and "2/2" in err, f"--progress shows a bar that reaches 2/2: {err!r}"


# ----- the HTTP client: one-line errors, the api key -----------------------------------------------------


@pytest.mark.parametrize("argv", [["status"], ["adapters", "list"], ["adapters", "load", "x", "/p"],
                                  ["adapters", "unload", "x"], ["release", "status", "x"],
                                  ["release", "rollback", "x", "rel-1"]])
def test_an_unreachable_server_is_one_clear_line(free_port, argv, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main([*argv, "--url", url, "--timeout", "5"]) == 1, f"{argv}: exit status 1"
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, f"{argv}: one line on stderr, no traceback: {captured.err}"
    assert f"server not reachable at {url}" in lines[0], f"{argv}: it names the URL: {lines}"
    assert captured.out == "", f"{argv}: nothing on stdout"


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with a fixed JSON body and records its method, path, headers and body."""

    seen: ClassVar[list[dict]] = []
    answer: tuple[int, bytes] = (200, b"{}")

    def _reply(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                "body": body})
        status, payload = type(self).answer
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _reply

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Recorder", (_Recorder,), {"seen": [], "answer": (200, b"{}")})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_the_api_key_is_sent_as_a_bearer_token_to_the_vllm_endpoints(recorder, capsys):
    url, handler = recorder
    handler.answer = (200, b"Success: LoRA adapter 'x' added successfully.")
    assert main(["adapters", "load", "x", "/adapters/x", "--url", url, "--api-key", "k-123"]) == 0, "load"
    assert main(["adapters", "unload", "x", "--url", url, "--api-key", "k-123"]) == 0, "unload"
    load, unload = handler.seen
    assert (load["method"], load["path"]) == ("POST", "/v1/load_lora_adapter"), "load uses vLLM's endpoint"
    assert json.loads(load["body"]) == {"lora_name": "x", "lora_path": "/adapters/x"}, "with vLLM's body"
    assert (unload["method"], unload["path"]) == ("POST", "/v1/unload_lora_adapter"), "unload: vLLM's"
    assert json.loads(unload["body"]) == {"lora_name": "x"}, "with vLLM's body"
    auth = [r["headers"].get("Authorization") for r in handler.seen]
    assert auth == ["Bearer k-123", "Bearer k-123"], "every call sends Authorization: Bearer <key>"


def test_an_error_answer_is_one_line_with_the_status_and_message(recorder, capsys):
    url, handler = recorder
    handler.answer = (503, b'{"error": {"message": "the cluster controller is off\\n(controller: false)", '
                           b'"type": "service_unavailable", "code": "controller_unavailable"}}')
    assert main(["status", "--url", url]) == 1, "an error answer is exit status 1"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lora-cluster status: GET /v1/cluster: HTTP 503: the cluster controller is off "
                   "(controller: false)"], f"one line with the status and the server's message: {err}"


def test_an_answer_that_is_not_json_says_so(recorder, capsys):
    url, handler = recorder
    handler.answer = (200, b"<html>some other server</html>")
    assert main(["status", "--url", url]) == 1, "a non-JSON answer is exit status 1"
    err = capsys.readouterr().err.strip()
    assert f"is {url} a lora-cluster server?" in err, f"it asks whether the URL is the right server: {err}"


def test_a_background_progress_bar_follows_its_futures_and_is_off_without_a_terminal(capsys):
    from concurrent.futures import ThreadPoolExecutor

    from lora_cluster.progress import track_futures

    with ThreadPoolExecutor(2) as pool:
        track_futures([pool.submit(pow, 2, i) for i in range(3)], desc="preloading adapters")
    assert "preloading adapters" not in capsys.readouterr().err, "no bar when stderr is not a terminal"
    with ThreadPoolExecutor(2) as pool:
        track_futures([pool.submit(pow, 2, i) for i in range(3)], desc="preloading adapters", enabled=True)
    err = capsys.readouterr().err
    assert "preloading adapters" in err and "3/3" in err, f"on request, a bar that reaches 3/3: {err!r}"


VIEW = {
    "controller": {"up_s": 12.0, "replicas": 1, "counts": {}},
    "classes": {"standard": {"priority": 1, "ttft_s": 5.0, "tpot_s": 0.5}},
    "queue": {"depth": 2, "size": 4096, "by_class": {"batch": 2}, "oldest_wait_s": 0.25},
    "nodes": {"node-abc": {"replicas": {"r1": {
        "capacity": 8, "running": 3, "waiting": 1, "free": 5, "max_num_seqs": 8, "max_loras": 4,
        "free_adapter_slots": 2, "adapters": {"resident": ["a1", "a2"], "loading": ["a3"]},
        "memory": {"base_weights": 1 << 20, "kv_cache": 2 << 20, "adapter_pool": 3 << 20, "free": None,
                   "host_cache": 1 << 20, "host_cache_budget": 4 << 30}}}}},
    "placement": {"a1": ["r1"]},
}


def test_status_prints_nodes_replicas_adapters_per_tier_and_queues(recorder, capsys):
    url, handler = recorder
    handler.answer = (200, json.dumps(VIEW).encode())
    assert main(["status", "--url", url]) == 0, "status succeeds"
    lines = capsys.readouterr().out.splitlines()
    assert handler.seen[0]["path"] == "/v1/cluster", "status reads GET /v1/cluster"
    assert lines[0] == f"server {url}: 1 replicas, controller up 12 s", f"the server line: {lines}"
    assert lines[1] == "queue: 2/4096 waiting (batch 2), oldest 0.2 s", f"the queue line: {lines}"
    assert "node node-abc" in lines, f"a line per node: {lines}"
    assert "  replica r1: running 3, waiting 1, free 5/8, adapter slots free 2/4" in lines, (
        f"a line per replica with its load: {lines}")
    assert "    device: a1, a2  loading: a3" in lines, f"the device tier and loading adapters: {lines}"
    assert any(line.startswith("    host cache: 1.0 MiB of 4096.0 MiB") for line in lines), (
        f"the host tier's bytes and budget: {lines}")
    assert "placement: a1 -> r1" in lines, f"the placement: {lines}"
    assert main(["status", "--url", url, "--json"]) == 0, "status --json succeeds"
    assert json.loads(capsys.readouterr().out) == VIEW, "--json prints the view as the server sent it"


def test_status_prints_one_section_per_replica_group(recorder, capsys):
    url, handler = recorder
    handler.answer = (200, json.dumps({"groups": {"fin": VIEW, "ops": VIEW}}).encode())
    assert main(["status", "--url", url]) == 0, "status succeeds with replica groups"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "group fin" and "group ops" in lines, f"a section per group: {lines}"
    assert "    replica r1: running 3, waiting 1, free 5/8, adapter slots free 2/4" in lines, (
        f"each group's replicas, indented under it: {lines}")


def test_release_commands_call_the_release_routes(recorder, tmp_path, capsys):
    url, handler = recorder
    handler.answer = (200, b'{"id": "rel-1", "state": "canary"}')
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text('{"prompt": "2+2=", "expected": "4"}\n\n')
    create = ["release", "create", "fin", "/zoo/fin-2", "--steps", "10,100", "--min-requests", "5",
              "--dwell", "0", "--eval-set", str(eval_set), "--shadow", "10", "--url", url]
    assert main(create) == 0, "create succeeds"
    assert main(["release", "promote", "fin", "rel-1", "--url", url]) == 0, "promote succeeds"
    assert main(["release", "status", "fin", "rel-1", "--url", url]) == 0, "status succeeds"
    created, promoted, status = handler.seen
    assert (created["method"], created["path"]) == ("POST", "/v1/adapters/fin/releases"), "create's route"
    assert json.loads(created["body"]) == {"lora_path": "/zoo/fin-2", "steps": [10.0, 100.0],
                                           "step_min_requests": 5, "step_dwell_s": 0.0,
                                           "shadow_percent": 10.0,
                                           "eval_set": [{"prompt": "2+2=", "expected": "4"}]}, "its body"
    assert (promoted["method"], promoted["path"]) == ("POST", "/v1/adapters/fin/releases/rel-1/promote"), \
        "a command posts to the release's action"
    assert (status["method"], status["path"]) == ("GET", "/v1/adapters/fin/releases/rel-1"), "status reads"
    assert '"state": "canary"' in capsys.readouterr().out, "the answers are printed as JSON"

"""The served OpenAPI schema read as a user reads it: the standard schemathesis CLI (`st run`, every
default check and phase, no body filter) against `serve run` of the shipped serve_config.yaml, only its
port and the demo zoo's size changed, run from the repository (its `schemathesis.toml` loads the API's
formats). Every operation is generated and tested, chat included: a conversation longer than the demo
model's 512 positions is served on its latest messages (prompt_truncation: auto, the default)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, serve_run

CLI_EXAMPLES = 60  # per operation and phase (the number the trial used)


@pytest.fixture(scope="module")
def shipped_server(free_port, tmp_path_factory) -> Any:
    """`serve run serve_config.yaml` as shipped, only its port changed, on a demo zoo of 8 adapters
    in a temporary folder (LORA_CLUSTER_DEMO_DIR, LORA_CLUSTER_DEMO_NUM_ADAPTERS: quicker to build)."""
    folder = tmp_path_factory.mktemp("serve-run")
    port = free_port()
    config = folder / "serve_config.yaml"
    config.write_text((ROOT / "serve_config.yaml").read_text().replace("port: 8000", f"port: {port}"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "LORA_CLUSTER_DEMO_DIR": str(folder / "demo"),
           "LORA_CLUSTER_DEMO_NUM_ADAPTERS": "8"}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, as `serve run` on a fresh machine
    url = f"http://127.0.0.1:{port}"
    log = folder / "serve.log"
    with serve_run(config, env, url, log):
        yield url, log


def _server_state(url: str, log: Path) -> str:
    """What a failed run needs to be understood afterwards: the engine's and the cluster queue's gauges
    now, and the end of the server's own log (the replicas' errors reach it through `serve run`)."""
    import httpx

    try:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        gauges = "\n".join(line for line in lines if line.startswith(
            ("lora_cluster_engine_running_requests", "lora_cluster_engine_waiting_requests",
             "lora_cluster_queue_depth", "lora_cluster_adapter_slots_in_use")))
    except httpx.HTTPError as error:
        gauges = f"/metrics did not answer: {error!r}"
    return f"gauges after the run:\n{gauges}\nserve log (end):\n{log.read_text()[-4000:]}"


def _st_run(url: str, *options: str) -> tuple[int, str]:
    """The schemathesis CLI over `url`'s schema, run from the repository (its `schemathesis.toml`
    loads the API's formats), every check and phase at its default: (exit code, output)."""
    st_cli = Path(sys.executable).parent / "st"
    result = subprocess.run([str(st_cli), "run", f"{url}/openapi.json", "-n", str(CLI_EXAMPLES), *options],
                            cwd=ROOT, capture_output=True, text=True, timeout=1500)
    return result.returncode, result.stdout + result.stderr


def _findings(out: str) -> str:
    """The CLI's failures and errors (its sections before the summary, up to 5,000 characters): what a
    failed run is read for, printed last so that the end of a long report shows it."""
    start = min((i for i in (out.find(" FAILURES "), out.find(" ERRORS ")) if i >= 0), default=-1)
    if start < 0:
        return "(none in the output)"
    end = out.find(" SUMMARY ", start)
    return out[start:end if end > start else None][:5000]


def _tested_every_operation(out: str) -> bool:
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    tested = re.search(r"Tested: (\d+)", out)
    return bool(selected and tested and selected.group(1) == tested.group(1) and "Schema Error" not in out)


@pytest.mark.e2e
def test_the_schemathesis_cli_passes_every_default_check_and_phase_against_serve_run(shipped_server):
    """Every operation, chat included: a conversation longer than the demo's 512 positions (the
    fuzzer's largest is) is served on its latest messages (prompt_truncation: auto, the default)."""
    url, log = shipped_server
    code, out = _st_run(url)
    tail = out[-6000:]
    assert "schemathesis.toml" in out, f"the repository's config (its formats) is loaded: {tail}"
    assert _tested_every_operation(out), f"every operation's bodies are generated and tested: {tail}"
    assert code == 0, (f"no failure and no error under every default check and phase: {out[-1500:]}\n"
                       f"{_server_state(url, log) if code else ''}\nthe CLI's findings:\n{_findings(out)}")


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_fan_out_with_more_choices_than_the_replica_has_seats_is_answered_in_full(shipped_server, stream):
    """3 prompts x n=13: 39 choices, the shipped replica's max_num_seqs is 32. Each choice's seat comes
    back when its replica ends it, read or not (`serve.routing.generation`); once, the last 7 waited
    for seats that the request's own unread choices held, until the cluster queue's timeout (300 s)."""
    import httpx

    url, log = shipped_server
    body = {"model": "demo", "prompt": ["the river", "a lamp", "seven stones"], "n": 13, "max_tokens": 4,
            "stream": stream}
    with httpx.Client(base_url=url, timeout=60) as client:
        answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, f"the fan-out is served: {answer.text[:500]}\n{_server_state(url, log)}"
    if stream:
        chunks = [line for line in answer.text.splitlines() if line.startswith("data: {")]
        indexes = {choice["index"] for line in chunks for choice in json.loads(line[6:])["choices"]}
    else:
        indexes = {choice["index"] for choice in answer.json()["choices"]}
    assert indexes == set(range(39)), f"every one of the 39 choices is answered: {sorted(indexes)}"

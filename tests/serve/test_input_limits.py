"""Input limits (each a 400 naming the limit) and error bodies that leak nothing, through the ingress's
FastAPI app in process. The leak test runs a real adapter store behind the fake replica, so that its
errors are the real ones a replica would report."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from app_client import FakeDispatcher, FakeTokenizer, serving

from lora_cluster.config import ServeConfig
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import LoraClusterError
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy

LIMITS = {"max_body_bytes": 4096, "max_json_depth": 8, "max_prompt_tokens": 24, "max_new_tokens": 32,
          "default_max_tokens": 8, "max_stop_sequences": 2, "max_stop_length": 8, "max_n": 2,
          "max_prompts": 2, "max_chat_messages": 2}


@contextlib.asynccontextmanager
async def limited_app(dispatcher: Any = None, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    limited = ServeConfig(model="base", **{**LIMITS, **config})
    async with serving(FakeTokenizer(), dispatcher or FakeDispatcher(), limited,
                       raise_app_exceptions=False) as client:
        yield client


OK = {"model": "a1", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LORAX = {"inputs": "hi", "parameters": {"adapter_id": "a1", "max_new_tokens": 2}}


def refusal(r: httpx.Response, code: str | None, *names: str) -> None:
    """Assert that `r` is a 400 (with `code`) whose message names every one of `names`."""
    assert r.status_code == 400, f"refused with 400: {r.status_code} {r.text}"
    error = r.json()["error"]
    if code is not None:
        assert error["code"] == code, f"code {code}: {error}"
    for name in names:
        assert name in error["message"], f"the message names {name}: {error['message']}"


async def test_a_body_over_max_body_bytes_is_refused_with_or_without_content_length():
    big = json.dumps({**OK, "prompt": "x" * 5000}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with limited_app() as client:
        declared = await client.post("/v1/completions", content=big,
                                     headers={"content-type": "application/json"})
        chunked = await client.post("/v1/completions", content=chunks(),
                                    headers={"content-type": "application/json"})
        small = await client.post("/v1/completions", json=OK)
    refusal(declared, "body_too_large", "max_body_bytes=4096")
    refusal(chunked, "body_too_large", "max_body_bytes=4096")
    assert small.status_code == 200, f"a body within the limit is served: {small.text}"


async def test_malformed_utf8_and_deep_json_are_refused_naming_the_problem():
    deep = {**OK, "user": None}
    nested: Any = "x"
    for _ in range(20):
        nested = [nested]
    async with limited_app() as client:
        utf8 = await client.post("/v1/completions", content=b'{"model": "a1", "prompt": "\xff\xfe"}',
                                 headers={"content-type": "application/json"})
        too_deep = await client.post("/v1/completions", json={**deep, "stop": nested})
        shallow = await client.post("/v1/completions", json={**OK, "stop": ["a", "b"]})
        brackets_in_strings = await client.post("/v1/completions", json={**OK, "prompt": "[[[[[[[[[[[[[[[["})
    refusal(utf8, "invalid_utf8", "UTF-8")
    refusal(too_deep, "json_too_deep", "max_json_depth=8")
    assert shallow.status_code == 200, f"a shallow body is served: {shallow.text}"
    assert brackets_in_strings.status_code in (200, 400), "brackets inside strings do not count as nesting"
    assert brackets_in_strings.json().get("error", {}).get("code") != "json_too_deep", (
        f"brackets inside strings are not nesting: {brackets_in_strings.text}")


@pytest.mark.parametrize(("path", "body", "code", "names"), [
    ("/v1/completions", {**OK, "prompt": [120] * 25}, "prompt_too_long", ["25 tokens", "24"]),
    ("/v1/completions", {**OK, "max_tokens": 33}, None, ["max_tokens=33", "32"]),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "max_new_tokens": 33}}, None,
     ["max_new_tokens=33", "32"]),
    ("/v1/completions", {**OK, "stop": ["a", "b", "c"]}, None, ["max_stop_sequences=2"]),
    ("/v1/chat/completions", {**CHAT, "stop": "123456789"}, None, ["max_stop_length=8"]),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "stop": ["a", "b", "c"]}}, None,
     ["max_stop_sequences=2"]),
    ("/generate_stream", {**LORAX, "parameters": {**LORAX["parameters"], "stop": ["123456789"]}}, None,
     ["max_stop_length=8"]),
    ("/v1/completions", {**OK, "n": 3}, None, ["n=3", "2"]),
    ("/v1/completions", {**OK, "prompt": ["a", "b", "c"]}, None, ["max_prompts=2"]),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 3}, None, ["3 messages",
                                                                              "max_chat_messages=2"]),
    ("/v1/completions", {**OK, "frobnicate": 1}, "unknown_parameter", ["frobnicate"]),
    ("/v1/chat/completions", {**CHAT, "length_penalty": 1.1, "min_p": 0.1}, "unknown_parameter",
     ["length_penalty", "min_p"]),
])
async def test_each_limit_is_a_400_naming_it(path, body, code, names):
    dispatcher = FakeDispatcher()
    async with limited_app(dispatcher) as client:
        r = await client.post(path, json=body)
    refusal(r, code, *names)
    assert dispatcher.jobs == [], f"{path}: nothing reached a replica"


async def test_lorax_and_nested_objects_ignore_unknown_fields():
    async with limited_app() as client:
        lorax = await client.post("/generate", json={**LORAX, "parameters": {**LORAX["parameters"],
                                                                              "future_field": 1}})
        chat = await client.post("/v1/chat/completions", json={
            **CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]})
    assert lorax.status_code == 200, f"LoRAX ignores unknown parameters, as LoRAX/TGI do: {lorax.text}"
    assert chat.status_code == 200, f"unknown fields inside messages are ignored: {chat.text}"


# ----- no information leaks: error bodies carry no server path, no traceback ------------------------------


class StoreDispatcher(FakeDispatcher):
    """The fake replica, with a real adapter store deciding which adapters exist and registering them
    (errors travel as a replica sends them: `describe(exc).to_dict()`)."""

    def __init__(self, store: TieredAdapterStore):
        super().__init__()
        self.store = store

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id is not None:
            try:
                await asyncio.to_thread(self.store.load, job.adapter_id)
            except LoraClusterError as exc:
                raise ApiException(describe(exc)) from exc
        return await super().start(job, route)

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        if method == "register_adapter":
            try:
                await asyncio.to_thread(self.store.register, *args)
            except LoraClusterError as exc:
                return {"r1": {"error": describe(exc).to_dict()}}
        return await super().broadcast(method, *args)


class ExplodingDispatcher(FakeDispatcher):
    def __init__(self, where: Path):
        super().__init__()
        self.where = where

    async def start(self, job: GenerateJob, route: str) -> Generation:
        raise RuntimeError(f"cannot open {self.where}/weights.bin")


@pytest.fixture(scope="module")
def shapes(demo_model_dir):
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


async def test_error_bodies_never_show_server_paths_or_tracebacks(shapes, demo_adapters_dir, tmp_path):
    store = TieredAdapterStore([str(demo_adapters_dir)], AdmissionPolicy(shapes, 64),
                               disk_cache_dir=tmp_path / "disk")
    bodies = []
    try:
        async with limited_app(StoreDispatcher(store)) as client:
            for model in ("no-such-adapter", "a0/deeper", "../a0"):
                bodies.append(await client.post("/v1/completions", json={**OK, "model": model}))
                bodies.append(await client.post("/generate", json={
                    **LORAX, "parameters": {**LORAX["parameters"], "adapter_id": model}}))
            bodies.append(await client.post("/v1/load_lora_adapter", json={
                "lora_name": "mine", "lora_path": str(tmp_path / "missing" / "adapter")}))
            bodies.append(await client.post("/v1/load_lora_adapter", json={
                "lora_name": "mine", "lora_path": f"file://{tmp_path}/missing"}))
            served = await client.post("/v1/completions", json={**OK, "model": "a0"})
        async with limited_app(ExplodingDispatcher(tmp_path)) as client:
            bodies.append(await client.post("/v1/completions", json=OK))
    finally:
        store.close()
    assert served.status_code == 200, f"an adapter that exists is served: {served.text}"
    statuses = [r.status_code for r in bodies]
    assert statuses == [404] * 8 + [500], f"unknown adapters and paths are 404s, the crash a 500: {statuses}"
    for r in bodies:
        for secret in (str(tmp_path), str(demo_adapters_dir), "Traceback", "weights.bin"):
            assert secret not in r.text, f"an error body shows {secret!r}: {r.text}"
    assert bodies[0].json() == {"error": {
        "message": "adapter 'no-such-adapter' does not exist or you do not have access to it",
        "type": "not_found_error", "code": "adapter_not_found"}}, "an unknown adapter's 404 body"
    assert "RuntimeError" in bodies[-1].json()["error"]["message"], "a 500 names the exception's type"

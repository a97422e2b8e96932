"""Fuzzing: schemathesis over the HTTP API's OpenAPI schema, hypothesis over the engine's public API.

The HTTP fuzzer runs every operation of `/openapi.json` with every default schemathesis check, none
loosened (no 5xx, status codes, content types, headers, bodies and SSE events as documented, invalid
data rejected, valid data accepted, undeclared methods answered 405 with `Allow`, authentication
enforced where the schema declares it) against the real ingress app (`build_fastapi`, in process
through ASGI as in test_serve_app) whose dispatcher runs a real engine on the tiny demo zoo, the way
a replica does: generated prompts, token ids and parameters reach the engine. It runs twice: without
a tenants file (every route open) and with one (an admin key sent; schemathesis also checks that a
request without a key, or with a wrong one, is refused). The schema states every rule of the bodies
(`schema_limits.constrain`) but a prompt's token count, which the fuzzed app's `max_prompt_tokens` puts
out of reach of generated text prompts and which `filter_body` applies to generated chat bodies
(whose tools and tool calls carry JSON of any size), with the rules the schema states in words only
(a named tool_choice is one of the tools) or by a `format` that the constants schemathesis mixes in
ignore (`json-schema`, `grammar`); `SCHEMA_AGREES` pins bodies where schema and server must agree.
The engine fuzzer calls `SamplingParams`, `Engine.add_request`/`step` and `Engine.generate` with
random parameters, token ids and adapter ids: only domain errors (`LoraClusterError`) may come out,
and a valid request still succeeds afterwards. Both print how many requests they tried and what they answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from helpers import ROOT, serve_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import TemplateError
from pydantic import RootModel, ValidationError
from schemathesis_formats import GRAMMARS

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import build_sla_classes
from lora_cluster.config import ServeConfig
from lora_cluster.demo import train_tokenizer
from lora_cluster.engine import AsyncEngine, Engine, SamplingParams
from lora_cluster.errors import LoraClusterError
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.ingress import build_fastapi
from lora_cluster.serve.http.openai_schemas import ChatCompletionRequest
from lora_cluster.serve.http_errors import ApiError, ApiException, describe
from lora_cluster.serve.protocol import GenerateJob, output_item
from lora_cluster.serve.replica.deployment import coalesce
from lora_cluster.serve.replica.model import load_tokenizer
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.serve.routing.dispatch import Generation
from lora_cluster.tenancy.tenants import Directory, hash_key, parse_tenants

HTTP_EXAMPLES = 15  # per operation and phase: about a minute for all operations on an idle machine
ENGINE_EXAMPLES = 150
MAX_MODEL_LEN = 64  # bounds every generation the fuzzers start
ENGINE_SETTINGS = dict(max_loras=4, max_lora_rank=32, max_num_seqs=8, max_num_batched_tokens=256,
                       max_model_len=MAX_MODEL_LEN)


def _engine(make_engine, settings: dict[str, Any] = ENGINE_SETTINGS) -> Engine:
    return make_engine(**settings)


@pytest.fixture(scope="module")
def engine(make_engine) -> Any:
    """An engine stepped by the test itself (the HTTP app's engine is stepped by its AsyncEngine)."""
    engine = _engine(make_engine)
    yield engine
    engine.close()


def _report(request: pytest.FixtureRequest, title: str, counts: collections.Counter) -> None:
    """Print the fuzzer's figures: requests tried and what they answered (also with -q, after the tests)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{title}: {sum(counts.values())} tried"]
    lines += [f"  {key}: {n}" for key, n in sorted(counts.items(), key=lambda kv: str(kv[0]))]
    if reporter is not None:
        request.config.add_cleanup(lambda: [reporter.write_line(line) for line in lines])


# ----- schemathesis over the HTTP API ---------------------------------------------------------------------


class _Stream:
    """The rest of an output stream, as the ingress reads a replica's (`__anext__`, `cancel`)."""

    def __init__(self, items: AsyncIterator[dict[str, Any]]):
        self._items = items

    async def __anext__(self) -> dict[str, Any]:
        return await self._items.__anext__()

    def cancel(self) -> None:
        """Close the stream, which aborts the engine request (as Ray cancels a replica call)."""
        asyncio.get_running_loop().create_task(self._items.aclose())


class _Method:
    """`handle.method.remote(*args)` of a deployment handle, answered in process."""

    def __init__(self, fn: Any):
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class LocalController:
    """The cluster controller's policy core (`cluster.controller.Controller`) behind the calls of its
    deployment handle that the ingress makes (`snapshot`, `placement`)."""

    def __init__(self, config: ServeConfig):
        core = Controller(build_sla_classes(config))
        self.snapshot = _Method(core.snapshot)
        self.placement = _Method(lambda: {a: list(r) for a, r in core.placement().items()})


class EngineDispatcher:
    """The ingress's dispatcher calls answered by one in-process engine, as one replica "local" would:
    the same wire items (`coalesce`, `output_item`), errors reported as `describe` maps them."""

    def __init__(self, aengine: AsyncEngine, config: ServeConfig):
        self.aengine = aengine
        self.admission = ClusterAdmission(LocalController(config), capacity=None,
                                          replica_stats=self.replica_stats, timeout_s=1.0)

    def replica_stats(self) -> dict[str, RoutingStats]:
        return {"local": RoutingStats()}

    async def cluster_view(self) -> dict[str, Any]:
        return await self.admission.cluster_view()

    async def _items(self, job: GenerateJob) -> AsyncIterator[dict[str, Any]]:
        head: dict[str, Any] = {"replica": "local", "hit": True}
        try:
            aid = job.adapter_id
            if job.adapter_path is not None and aid is not None:
                await self.aengine.register_adapter(aid, job.adapter_path)
            if job.merge is not None:
                aid = self.aengine.define_merge(job.merge)
            outputs = self.aengine.generate(job.prompt, aid, job.sampling, request_id=job.request_id,
                                            priority=job.priority)
            if not job.stream:
                async for out in outputs:
                    if out.finished:
                        yield {**head, **output_item(out, full=True)}
                return
            async for item in coalesce(outputs):
                yield {**head, **item}
                head = {}
        except LoraClusterError as exc:
            yield {**head, "error": describe(exc).to_dict()}

    async def start(self, job: GenerateJob, route: str) -> Generation:
        items = self._items(job)
        first = await items.__anext__()
        if "error" in first:
            raise ApiException(ApiError.from_dict(first["error"]))
        return Generation(job=job, replica="local", hit=True, first=first, stream=_Stream(items))

    async def start_all(self, jobs: list[GenerateJob], route: str,
                        on_started: Callable[[Generation], None] | None = None) -> list[Generation]:
        started: list[Generation] = []
        try:
            for job in jobs:
                started.append(await self.start(job, route))
                if on_started is not None:
                    on_started(started[-1])
        except BaseException:
            for generation in started:
                generation.cancel()
            raise
        return started

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        return await self.aengine.list_adapters() if method == "list_adapters" else "local"

    async def call(self, replica_id: str, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        return (await self.broadcast(method, *args))["local"]

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        if method == "register_adapter":
            try:
                await self.aengine.register_adapter(*args)
            except LoraClusterError as exc:
                return {"local": {"error": describe(exc).to_dict()}}
        elif method == "unregister_adapter":
            await self.aengine.unregister_adapter(*args)
        return {"local": {"replica": "local", "ok": True}}


HTTP_STATUSES: collections.Counter = collections.Counter()
ADMIN_KEY = "sk-fuzz-admin-0123456789"
TENANT_KEY = "sk-fuzz-tenant-0123456789"
TENANTS_YAML = f"""
admin_api_keys: ["{hash_key(ADMIN_KEY)}"]
tenants:
  - name: fuzz
    api_keys: ["{hash_key(TENANT_KEY)}"]
    adapters: ["a[0-3]"]
"""
# prompts up to 448 tokens (the demo model's 512 positions): more than any generated prompt, so the
# one rule the schema cannot state (a text's token count) is not what the fuzzer meets; generations
# stay short (max_new_tokens). A chat prompt is the sum of its messages: the demo template spends
# 3 tokens (`<s>`, then `<|assistant|>\n`), 7 per message (`<|role|>\n...</s>\n`), 31 per tool result
# (`<tool_response>` wrapping) and 42 more per tool call (`<tool_call>` JSON), then the texts (role,
# content, a call's name and arguments, the tools' JSON; up to 4 tokens a character: byte-level BPE).
# max_chat_messages 4 caps the template at 3 + 4 * 31 = 127 tokens without calls (twenty-odd
# generated messages rendered 479 tokens); 4 messages without tools or calls rendered at most 249
# tokens in 600 generated bodies. Tools and calls carry JSON of any size: `filter_body` applies the
# token count to the chat bodies. max_n 1: n and best_of are then 1 at most, so the schema states no rule
# between them; with max_n 2 their rule and the structured-output rule (at most one constraint) expand
# past what schemathesis's canonicalizer models (jsonschema_rs: OUTGREW_INTERSECTIONS) and no body of
# the generation routes could be generated. best_of's rules are pinned with max_n 4 in
# test_structured_output_api.py (schema and server agree)
HTTP_ENGINE_SETTINGS = {**ENGINE_SETTINGS, "max_model_len": 512}
FUZZ_LIMITS = dict(max_new_tokens=16, default_max_tokens=8, max_n=1, max_prompt_tokens=448,
                   max_chat_messages=4, served_model_name="demo", **HTTP_ENGINE_SETTINGS)
SCHEMA_TOKENIZER = train_tokenizer("tiny")  # the demo zoo's tokenizer: its size bounds token ids
MODES = {"open": {}, "tenants": {"authorization": f"Bearer {ADMIN_KEY}"}}  # the headers the fuzzer sends


class StaticTenants:
    """A tenants file in force (`auth.TenantsSource`), parsed once: the fuzzer's admin key and a tenant."""

    def __init__(self) -> None:
        self.directory = parse_tenants(TENANTS_YAML)

    def current(self) -> Directory:
        return self.directory


class AppSlot:
    """An ASGI app that forwards to `app`: schemathesis loads the schema when this module is imported
    (to parametrize the test), before the fixtures that build the real app exist; the routes, and so
    the schema, depend on the limits and the tenants file but not on the model, so an app with the
    same config and no model serves the schema until then."""

    def __init__(self, mode: str) -> None:
        tenants = StaticTenants() if mode == "tenants" else None
        ctx = ApiContext(config=ServeConfig(model="schema-only", **FUZZ_LIMITS), tokenizer=SCHEMA_TOKENIZER,
                         dispatcher=None, tenants=tenants)
        self.mode, self.app = mode, build_fastapi(ctx)
        ctx.close()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


SLOTS = {mode: AppSlot(mode) for mode in MODES}
schema_open = schemathesis.openapi.from_asgi("/openapi.json", SLOTS["open"])
schema_tenants = schemathesis.openapi.from_asgi("/openapi.json", SLOTS["tenants"], headers=MODES["tenants"])


def _grammar(value: Any) -> bool:
    """Whether `value`, where the schema says `format: grammar`, is one of the format's generated
    grammars: schemathesis mixes example and source constants into strings without their format."""
    return value is None or value in GRAMMARS


def _schema_text(value: Any) -> bool:
    """Whether `value`, where the schema says `format: json-schema` (a schema object or its JSON
    text), is one (constants are mixed in as into `grammar` strings)."""
    if not isinstance(value, str):
        return True
    try:
        return isinstance(json.loads(value), dict)
    except ValueError:
        return False


def _tools_fit(body: dict[str, Any]) -> bool:
    """The tool rules JSON Schema cannot state (tools.tool_rules): tool names are unique, a named
    tool_choice is one of them."""
    def name(item: Any) -> Any:
        function = item.get("function") if isinstance(item, dict) else None
        return function.get("name") if isinstance(function, dict) else None

    tools = body.get("tools")
    names = [name(tool) for tool in tools] if isinstance(tools, list) else []
    named = name(body.get("tool_choice"))
    return len(names) == len(set(names)) and (named is None or named in names)


def filter_body(context: Any, body: Any) -> bool:
    """The rules of an OpenAI body that the schema states only in words (`schema_limits.constrain`) or by a
    format that mixed-in constants ignore, applied to the bodies the fuzzer generates: a `json-schema`
    text is a JSON schema object, a `grammar` one of the format's grammars; a chat body's tool names
    are unique and a named tool_choice is one of them; its conversation as the server renders it
    (`conversation()`, the tools, the demo chat template) has at most max_prompt_tokens tokens (tools
    and tool calls carry JSON of any size, so no count limit keeps every generated conversation
    within the demo model's positions). A body the server refuses before counting
    tokens (a 400 of its own) is kept; every other body, and every check, is unchanged."""
    path = None if context.operation is None else context.operation.path
    if path not in ("/v1/chat/completions", "/v1/completions") or not isinstance(body, dict):
        return True
    outputs = body.get("structured_outputs")
    texts = [body.get("guided_json"), outputs.get("json") if isinstance(outputs, dict) else None]
    if not all(_schema_text(text) for text in texts):
        return False
    grammars = [body.get("guided_grammar"), outputs.get("grammar") if isinstance(outputs, dict) else None]
    if not all(_grammar(text) for text in grammars):
        return False
    if path != "/v1/chat/completions":
        return True
    if not _tools_fit(body):
        return False
    try:
        chat = ChatCompletionRequest.model_validate(body)
        tools = chat.tool_use().template_tools()
        extra = {} if tools is None else {"tools": tools}
        text = SCHEMA_TOKENIZER.apply_chat_template(chat.conversation(), add_generation_prompt=True,
                                                    tokenize=False, **extra)
    except (ValidationError, ApiException, TemplateError):
        return True
    return len(SCHEMA_TOKENIZER.encode(text, add_special_tokens=False)) <= FUZZ_LIMITS["max_prompt_tokens"]


for fuzzed_schema in (schema_open, schema_tenants):
    fuzzed_schema.hook(filter_body)


@pytest.fixture(scope="module")
def zoo_engine(make_engine) -> Any:
    aengine = AsyncEngine(_engine(make_engine, HTTP_ENGINE_SETTINGS))
    yield aengine
    aengine.shutdown()


@contextlib.contextmanager
def _serving(mode: str, demo_zoo: Any, aengine: AsyncEngine) -> Any:
    """The slot's app replaced by the ingress app on a real engine, for the tests of one mode."""
    config = ServeConfig(model=str(demo_zoo.model_dir), adapter_source=[str(demo_zoo.adapters_dir)],
                         **FUZZ_LIMITS)
    tenants = StaticTenants() if mode == "tenants" else None
    ctx = ApiContext(config=config, tokenizer=load_tokenizer(config),
                     dispatcher=EngineDispatcher(aengine, config), tenants=tenants)
    slot = SLOTS[mode]
    schema_only, slot.app = slot.app, build_fastapi(ctx)
    try:
        yield slot.app
    finally:
        slot.app = schema_only
        ctx.close()


@pytest.fixture(scope="module")
def fuzzed_app(demo_zoo, zoo_engine) -> Any:
    """The app without a tenants file: every route open."""
    with _serving("open", demo_zoo, zoo_engine) as app:
        yield app


@pytest.fixture(scope="module")
def fuzzed_app_with_tenants(demo_zoo, zoo_engine) -> Any:
    """The app with a tenants file: the fuzzer sends an admin key (the schema declares the key headers,
    and schemathesis checks that the routes refuse a request without one or with a wrong one)."""
    with _serving("tenants", demo_zoo, zoo_engine) as app:
        yield app


@pytest.fixture(scope="module", autouse=True)
def _http_report(request) -> Any:
    yield
    if HTTP_STATUSES:
        _report(request, "schemathesis over the HTTP API", HTTP_STATUSES)


def _fuzz(case: Any, mode: str) -> None:
    """One case, every default schemathesis check, none loosened."""
    response = case.call(headers=MODES[mode])
    HTTP_STATUSES[f"{mode}: {case.method} {case.path} -> {response.status_code}"] += 1
    case.validate_response(response, headers=MODES[mode])


@schema_open.parametrize()
@settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_endpoint_passes_every_schemathesis_check(fuzzed_app, case) -> None:
    _fuzz(case, "open")


@schema_tenants.parametrize()
@settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_endpoint_passes_every_schemathesis_check_with_a_tenants_file(fuzzed_app_with_tenants, case,
                                                                            ) -> None:
    _fuzz(case, "tenants")


# ----- hypothesis over the engine's public API -------------------------------------------------------------

ENGINE_OUTCOMES: collections.Counter = collections.Counter()
_ids = itertools.count()
_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70))
_floats = st.one_of(st.floats(-2, 120), st.floats(allow_nan=True, allow_infinity=True))
sampling_kwargs = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-2, 8), st.just(10**9)),
    "temperature": _floats, "top_p": _floats, "top_k": _ints, "seed": _ints,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20)),
    "stop_token_ids": st.lists(_ints, max_size=4), "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), _ints), "prompt_logprobs": st.one_of(st.none(), _ints),
})
prompts = st.one_of(st.text(max_size=40), st.lists(_ints, max_size=70))
adapters = st.one_of(st.none(), st.sampled_from(["a0", "a1", "a15", "missing", "../a1", "", "a0/../a1"]),
                     st.text(max_size=12))


def _run(engine: Engine, request_id: str, prompt: Any, adapter: Any, sampling: SamplingParams,
         priority: int) -> str:
    """Add one request and step the engine until it finishes; its finish reason or domain error."""
    engine.add_request(request_id, prompt, adapter, sampling, priority=priority)
    for _ in range(4 * MAX_MODEL_LEN):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return type(out.error).__name__ if out.error is not None else f"finished:{out.finish_reason}"
    engine.abort(request_id)
    raise AssertionError(f"request {request_id} did not finish within {4 * MAX_MODEL_LEN} steps")


def _still_serves(engine: Engine) -> None:
    out = engine.generate(["the river"], adapter_ids=["a1"], sampling=SamplingParams(max_new_tokens=2,
                                                                                      temperature=0.0))[0]
    assert out.finish_reason == "length" and out.completion_tokens == 2, (
        f"a valid request still succeeds after the fuzzed one: {out}")


@settings(max_examples=ENGINE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs, prompt=prompts, adapter=adapters, priority=_ints)
def test_the_engine_raises_only_domain_errors_and_keeps_serving(engine, kwargs, prompt, adapter, priority):
    request_id = f"fuzz-{next(_ids)}"
    try:
        outcome = _run(engine, request_id, prompt, adapter, SamplingParams(**kwargs), priority)
    except LoraClusterError as exc:
        outcome = type(exc).__name__
    ENGINE_OUTCOMES[f"add_request -> {outcome}"] += 1
    _still_serves(engine)


@settings(max_examples=ENGINE_EXAMPLES // 3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.tuples(prompts, adapters, sampling_kwargs), min_size=1, max_size=4))
def test_offline_generate_raises_only_domain_errors_and_keeps_serving(engine, batch):
    try:
        params = [SamplingParams(**kwargs) for _, _, kwargs in batch]
        outs = engine.generate([p for p, _, _ in batch], adapter_ids=[a for _, a, _ in batch],
                               sampling=params)
        outcome = "finished" if all(o.finished for o in outs) else "unfinished"
    except LoraClusterError as exc:
        outcome = type(exc).__name__
    ENGINE_OUTCOMES[f"generate -> {outcome}"] += 1
    _still_serves(engine)


@pytest.fixture(scope="module", autouse=True)
def _engine_report(request) -> Any:
    yield
    if ENGINE_OUTCOMES:
        _report(request, "hypothesis over the engine API", ENGINE_OUTCOMES)


# ----- what the fuzzers found, pinned -----------------------------------------------------------------------


def test_a_tiny_temperature_or_top_p_samples_the_most_likely_token():
    import torch

    from lora_cluster.engine.sampling import make_generator, sample

    logits = torch.tensor([[0.5, 3.0, 1.0, 2.9]])
    for params in (SamplingParams(temperature=1e-145, seed=1), SamplingParams(top_p=1e-145, seed=1)):
        token = sample(logits, [params], [make_generator(params, torch.device("cpu"))])
        assert token == [1], f"{params}: the most likely token, not a NaN probability crash"


def test_schema_types_are_enforced_and_405_names_the_allowed_method(fuzzed_app):
    from starlette.testclient import TestClient

    with TestClient(fuzzed_app) as client:
        coerced = client.post("/generate", json={"inputs": "x", "stream": 0})
        integral = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2.0})
        wrong_method = client.delete("/v1/completions")
    assert coerced.status_code == 400, f"0 is not the boolean the schema asks for: {coerced.text}"
    assert integral.status_code == 200, f"2.0 is an integer, as in JSON Schema: {integral.text}"
    assert wrong_method.status_code == 405, "an undeclared method is a 405"
    assert wrong_method.headers.get("allow") == "POST", "the 405 names the allowed method (RFC 9110)"


CHAT = {"model": "a3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "a3", "prompt": "the river", "max_tokens": 2}
LORAX = {"inputs": "the river", "parameters": {"adapter_id": "a3", "max_new_tokens": 2}}
MERGE = {"ids": ["a0", "a1"], "weights": [0.5, 0.5]}  # ranks 8 + 16: within max_lora_rank
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (route, body, whether the server serves it): the schema must say the same
SCHEMA_AGREES = [
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "response_format": {}}}, False),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "merged_adapters": MERGE}}, True),
    ("/generate", {"inputs": "x", "parameters": {"merged_adapters": {"ids": [], "weights": []}}}, False),
    ("/generate", {"inputs": "x", "parameters": {"merged_adapters": {**MERGE, "weights": [1.0]}}}, False),
    ("/generate", {"inputs": "x", "parameters": {"merged_adapters": {**MERGE, "merge_strategy": "dare_ties",
                                                                      "density": 0.0}}}, False),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "merged_adapters": MERGE}}, False),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "max_new_tokens": 17}}, False),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "seed": 2**64, "do_sample": True}}, True),
    ("/v1/chat/completions", {**CHAT, "response_format": {}}, False),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, True),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, True),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object", "extra": 1}}, False),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "Item", "schema": {"type": "object"}, "strict": True}}}, True),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, False),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad name", "schema": {}}}}, False),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     False),
    ("/v1/completions", {**COMPLETION, "guided_regex": "[a-z]+"}, True),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["yes", "no"]}, True),
    ("/v1/completions", {**COMPLETION, "guided_choice": []}, False),
    ("/v1/completions", {**COMPLETION, "guided_json": '{"type": "object"}'}, True),
    ("/v1/completions", {**COMPLETION, "guided_json": {"type": "object"}, "guided_regex": "a"}, False),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": 'start: "a"'}}, True),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json_object": True}}, True),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json_object": False}}, False),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {}}, False),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}}, False),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     False),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, False),
    ("/v1/completions", {**COMPLETION, "best_of": 1, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, False),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "best_of": 1}}, True),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "best_of": 2, "do_sample": True}}, False),
    ("/generate_stream", {**LORAX, "parameters": {**LORAX["parameters"], "best_of": 0}}, False),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "response_format": {
        "type": "json_object", "schema": {"type": "object"}}}}, True),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "response_format": {
        "type": "json_object"}}}, True),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "response_format": {
        "type": "text", "schema": {"type": "object"}}}}, False),
    ("/v1/chat/completions", {**CHAT, "tools": []}, True),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, False),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL]}, True),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required"}, True),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": NAMED, "parallel_tool_calls": False},
     True),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, False),
    ("/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": NAMED}, True),  # no parameters: {}
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, False),
    ("/v1/chat/completions", {**CHAT, "messages": [*CHAT["messages"], {"role": "tool", "content": "x"}]},
     False),
    ("/v1/chat/completions", {**CHAT, "messages": [*CHAT["messages"], {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                             "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]}, True),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 4}, True),  # max_chat_messages
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 5}, False),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}, False),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, True),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 17}, False),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     False),
    ("/v1/completions", {**COMPLETION, "merged_adapters": MERGE}, False),
    ("/v1/completions", {**COMPLETION, "model": "demo", "merged_adapters": MERGE}, True),
    ("/v1/completions", {**COMPLETION, "echo": True, "stream": True}, True),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 512]}, False),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 511]}, True),
    ("/v1/completions", {**COMPLETION, "n": 3}, False),
    ("/v1/completions", {**COMPLETION, "suffix": "x"}, False),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 2.0, "511": -100}}, True),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"512": 2.0}}, False),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"01": 2.0}}, False),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"3": 100.5}}, False),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -2, "frequency_penalty": 2,
                              "repetition_penalty": 1.5}, True),
    ("/generate", {**LORAX, "parameters": {**LORAX["parameters"], "repetition_penalty": 0.005}}, False),
    ("/v1/completions", {**COMPLETION, "min_tokens": 2, "stop": ["e"]}, True),
    ("/v1/completions", {**COMPLETION, "min_tokens": 10**6}, True),
    ("/v1/completions", {**COMPLETION, "min_tokens": -1}, False),
    ("/v1/completions", {**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, False),
]


def _schema_accepts(app: Any, path: str, body: dict[str, Any]) -> bool:
    import jsonschema

    document = app.openapi()
    media = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**media, "components": document["components"]})
    return validator.is_valid(body)


@pytest.mark.parametrize(("path", "body", "served"), SCHEMA_AGREES)
def test_the_schema_accepts_exactly_what_the_server_serves(fuzzed_app, path, body, served):
    from starlette.testclient import TestClient

    with TestClient(fuzzed_app) as client:
        response = client.post(path, json=body)
    assert (response.status_code != 400) == served, f"{path} {body}: the server answers {response.text}"
    assert _schema_accepts(fuzzed_app, path, body) == served, (
        f"{path} {body}: the schema {'accepts' if not served else 'refuses'} what the server "
        f"{'refuses' if not served else 'serves'}")


# ----- the schema as standard tools read it: the schemathesis CLI on `serve run`, a generated client -----

CLI_EXAMPLES = 60  # per operation and phase (the number the trial used)
README_ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
                 "/generate": "LoraxRequest"}


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
    with serve_run(config, env, url, folder / "serve.log"):
        yield url


def _st_run(url: str, *options: str) -> tuple[int, str]:
    """The schemathesis CLI over `url`'s schema, run from the repository (its `schemathesis.toml`
    loads the API's formats), every check and phase at its default: (exit code, output)."""
    st_cli = Path(sys.executable).parent / "st"
    result = subprocess.run([str(st_cli), "run", f"{url}/openapi.json", "-n", str(CLI_EXAMPLES), *options],
                            cwd=ROOT, capture_output=True, text=True, timeout=1500)
    return result.returncode, result.stdout + result.stderr


def _tested_every_operation(out: str) -> bool:
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    tested = re.search(r"Tested: (\d+)", out)
    return bool(selected and tested and selected.group(1) == tested.group(1) and "Schema Error" not in out)


@pytest.mark.slow
def test_the_schemathesis_cli_passes_every_default_check_and_phase_against_serve_run(shipped_server):
    code, out = _st_run(shipped_server, "--exclude-path", "/v1/chat/completions")
    tail = out[-6000:]
    assert "schemathesis.toml" in out, f"the repository's config (its formats) is loaded: {tail}"
    assert _tested_every_operation(out), f"every operation's bodies are generated and tested: {tail}"
    assert code == 0, f"no failure and no error under every default check and phase: {tail}"


@pytest.mark.slow
def test_the_cli_s_only_failure_on_chat_is_a_conversation_over_the_prompt_limit(shipped_server):
    """Chat's one rule JSON Schema cannot state: a conversation's tokens (the demo model has 512
    positions). The fuzzer's first, largest conversation exceeds them; every failure it reports on
    chat must be that rule's 400, and nothing else."""
    code, out = _st_run(shipped_server, "--include-path", "/v1/chat/completions")
    tail = out[-6000:]
    assert _tested_every_operation(out), f"chat's bodies are generated and tested: {tail}"
    checks = set(re.findall(r"^- (ST\d+) ", out, flags=re.MULTILINE))
    assert checks <= {"ST202"}, f"no check but 'schema-valid request rejected' fails on chat: {tail}"
    rejected = re.findall(r"^\[400\] Bad Request:\s+`(\{.*\})`$", out, flags=re.MULTILINE)
    assert all(json.loads(body)["error"]["code"] == "prompt_too_long" for body in rejected), (
        f"every schema-valid body refused on chat is a conversation over the prompt limit: {tail}")
    assert code == 0 or rejected, f"the run ends without an error of its own: {tail}"


def _readme_bodies() -> list[tuple[str, dict[str, Any]]]:
    """(route, body) of every `curl ... -d '{...}'` example of the README."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"curl -s 127\.0\.0\.1:8000(/[\w/]+)(?:\s+-H '[^']*')*\s*\\?\s*-d '(\{.*?\})'", text,
                       re.DOTALL)
    return [(route, json.loads(body)) for route, body in found]


def test_a_client_generated_from_the_schema_validates_the_readme_bodies(tmp_path):
    ctx = ApiContext(config=ServeConfig(model="schema-only"), tokenizer=SCHEMA_TOKENIZER, dispatcher=None)
    (tmp_path / "openapi.json").write_text(json.dumps(build_fastapi(ctx).openapi()))
    ctx.close()
    codegen = Path(sys.executable).parent / "datamodel-codegen"
    subprocess.run([str(codegen), "--input", str(tmp_path / "openapi.json"), "--input-file-type", "openapi",
                    "--output-model-type", "pydantic_v2.BaseModel", "--output", str(tmp_path / "client.py")],
                   check=True, capture_output=True, timeout=300)
    spec = importlib.util.spec_from_file_location("generated_client", tmp_path / "client.py")
    client = importlib.util.module_from_spec(spec)
    sys.modules["generated_client"] = client  # its models resolve their forward references through it
    try:
        spec.loader.exec_module(client)
    finally:
        del sys.modules["generated_client"]
    bodies = _readme_bodies()
    assert {route for route, _ in bodies} == set(README_ROUTES), f"the README's examples cover {bodies}"
    for route, body in bodies:
        model = getattr(client, README_ROUTES[route])
        assert not issubclass(model, RootModel) and body.keys() <= model.model_fields.keys(), (
            f"{route}: the generated {model.__name__} is one plain model with the body's fields (a union of "
            "variants or a root model would mean the schema composes what a generator must expand)")
        assert model.model_validate(body) is not None, f"{route}: the generated model reads {body}"
    with pytest.raises(ValidationError):  # a bound the schema states is a bound of the generated model
        client.CompletionRequest.model_validate({"model": "a3", "prompt": "x", "max_tokens": 10**6})

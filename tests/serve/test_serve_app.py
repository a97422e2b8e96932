"""The ingress's FastAPI app without Ray: `build_fastapi` around a fake dispatcher and a fake tokenizer.

Requests go through httpx's ASGI transport on the test's own event loop, so several requests are in
flight together on one loop, as in the ingress. Concurrency is arranged with events, never with
sleeps; every wait has a bound so that a defect fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest
from app_client import BOUND_S, FakeDispatcher, FakeStream, FakeTokenizer, outputs, serving

from lora_cluster.serve.http.registrations import AdapterRegistrations
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation


class BlockingTemplateTokenizer(FakeTokenizer):
    """A chat template that blocks its thread until `release` is set (at most BOUND_S)."""

    def __init__(self) -> None:
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        self.entered.set()
        self.release.wait(BOUND_S)
        self.returned.set()
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


@pytest.fixture
def fake_dispatcher() -> FakeDispatcher:
    return FakeDispatcher()


# ----- tokenization and chat templates stay off the event loop -----------------------------------------


async def test_a_slow_chat_template_does_not_stall_other_requests_streams(fake_dispatcher):
    tokenizer = BlockingTemplateTokenizer()
    chat_body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    stream_body = {"model": "a2", "prompt": "hello", "max_tokens": 3, "stream": True}
    async with serving(tokenizer, fake_dispatcher) as client:
        chat = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body))
        entered = await asyncio.to_thread(tokenizer.entered.wait, BOUND_S)
        streamed = await asyncio.wait_for(client.post("/v1/completions", json=stream_body), BOUND_S)
        template_still_running = not tokenizer.returned.is_set()
        tokenizer.release.set()
        chat_response = await asyncio.wait_for(chat, BOUND_S)
    assert entered, "the chat request reached its chat template"
    assert template_still_running, (
        "a streaming request ran to its end while another request's chat template was still rendering "
        "(a template on the event loop would stall every other request until it returned)")
    assert streamed.status_code == 200, f"the streaming request succeeded: {streamed.text}"
    assert streamed.text.endswith("data: [DONE]\n\n"), "the streaming request's stream ran to [DONE]"
    assert streamed.text.count('"text":"x"') == 3, "the stream carried its three tokens"
    assert chat_response.status_code == 200, f"the chat request completed once its template returned: " \
                                              f"{chat_response.text}"


class ThreadRecordingTokenizer(FakeTokenizer):
    """Records the name of the thread each `encode` ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


async def test_every_text_prompt_short_or_long_is_tokenized_off_the_event_loop(fake_dispatcher):
    tokenizer = ThreadRecordingTokenizer()
    async with serving(tokenizer, fake_dispatcher) as client:
        short = await client.post("/v1/completions", json={"model": "a1", "prompt": "hello", "max_tokens": 1})
        long = await client.post("/v1/completions",
                                 json={"model": "a1", "prompt": "x" * 2000, "max_tokens": 1})
    assert short.status_code == 200 and long.status_code == 200, f"both requests succeed: {long.text}"
    assert short.json()["usage"]["prompt_tokens"] == len("hello"), "the short prompt is tokenized alike"
    for thread in tokenizer.threads:
        assert thread.startswith("lora-ingress-encode"), (
            f"tokenized on the tokenizer threads, not the loop: {thread}")


async def test_chat_and_completion_prompts_are_tokenized_with_the_tokenizer(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        completion = await client.post("/v1/completions", json={
            "model": "a1", "prompt": "hello", "max_tokens": 1})
        chat = await client.post("/v1/chat/completions", json={
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == len("hello"), "a text prompt is tokenized"
    rendered = FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], True, False)
    assert chat.json()["usage"]["prompt_tokens"] == len(rendered), (
        "a conversation is rendered with the chat template, then tokenized")


async def test_a_chat_template_error_is_a_400_naming_the_template(fake_dispatcher):
    class RejectingTokenizer(FakeTokenizer):
        def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                                tokenize: bool) -> str:
            raise ValueError("roles must alternate")

    async with serving(RejectingTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400, f"a template that rejects the conversation is the client's error: {r.text}"
    assert "cannot apply the chat template: roles must alternate" in r.json()["error"]["message"], (
        "the message says that the chat template refused and why")


# ----- vLLM load_lora_adapter: one registration per name, even for concurrent calls ---------------------


async def test_concurrent_loads_of_one_adapter_name_register_it_once():
    gate = asyncio.Event()
    dispatcher = FakeDispatcher(register_gate=gate)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        loads = [asyncio.create_task(client.post("/v1/load_lora_adapter", json=body)) for _ in range(2)]
        both_broadcast = asyncio.create_task(dispatcher.two_registers_in_flight.wait())
        await asyncio.wait([*loads, both_broadcast], timeout=BOUND_S, return_when=asyncio.FIRST_COMPLETED)
        gate.set()
        responses = await asyncio.wait_for(asyncio.gather(*loads), BOUND_S)
        both_broadcast.cancel()
        models = (await client.get("/v1/models")).json()["data"]
    statuses = sorted(r.status_code for r in responses)
    refusals = [r.json()["error"]["message"] for r in responses if r.status_code == 409]
    registers = [args for method, args in dispatcher.broadcasts if method == "register_adapter"]
    assert statuses == [200, 409], f"one concurrent load succeeds and the other is refused, got {statuses}"
    assert any("being loaded" in m for m in refusals), f"the refused call is told that the adapter is " \
                                                       f"being loaded: {refusals}"
    assert len(registers) == 1, "the replicas were asked to register the adapter once"
    assert [m["id"] for m in models].count("mine") == 1, "the adapter is listed once"


async def test_a_failed_load_releases_the_name_for_a_retry():
    dispatcher = FakeDispatcher(refuse_registers=1)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        refused = await client.post("/v1/load_lora_adapter", json=body)
        retried = await client.post("/v1/load_lora_adapter", json=body)
    assert refused.status_code == 400, f"a load that a replica refuses is an error: {refused.text}"
    assert retried.status_code == 200, f"the name is free again after a failed load: {retried.text}"


async def test_a_load_of_a_name_that_is_being_unloaded_is_refused():
    unregister_gate = asyncio.Event()
    dispatcher = FakeDispatcher(unregister_gate=unregister_gate)
    body = {"lora_name": "mine", "lora_path": "/adapters/mine"}
    async with serving(FakeTokenizer(), dispatcher) as client:
        loaded = await client.post("/v1/load_lora_adapter", json=body)
        unload = asyncio.create_task(client.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}))
        await asyncio.wait_for(dispatcher.unregister_started.wait(), BOUND_S)
        during = await client.post("/v1/load_lora_adapter", json=body)
        unregister_gate.set()
        unloaded = await asyncio.wait_for(unload, BOUND_S)
        after = await client.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, f"the first load succeeds: {loaded.text}"
    assert during.status_code == 409, f"a load while the name is being unloaded is a conflict: {during.text}"
    assert during.json()["error"]["code"] == "being_unloaded", "the refusal says the name is being unloaded"
    assert unloaded.status_code == 200, f"the unload succeeds: {unloaded.text}"
    assert after.status_code == 200, f"once unloaded, the name can be loaded again: {after.text}"


async def test_the_number_of_loaded_adapters_is_bounded(fake_dispatcher):
    registrations = AdapterRegistrations(limit=1)
    async with serving(FakeTokenizer(), fake_dispatcher, registrations=registrations) as client:
        first = await client.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": "/a/one"})
        second = await client.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": "/a/two"})
    assert first.status_code == 200, f"a load within the limit succeeds: {first.text}"
    assert second.status_code == 409, f"a load beyond the limit is a conflict: {second.text}"
    assert "at most 1 LoRA adapters" in second.json()["error"]["message"], "the refusal names the limit"


# ----- SLA classes: header, else vLLM's priority field, else the default; the job and response carry it ----

COMPLETION = {"model": "a1", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LORAX = {"inputs": "hi", "parameters": {"adapter_id": "a1", "max_new_tokens": 2}}


async def test_the_header_names_the_class_and_wins_over_the_priority_field(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "priority": 0},
                              headers={"x-lora-priority": "batch"})
    assert r.status_code == 200, f"a request naming a known class succeeds: {r.text}"
    assert fake_dispatcher.jobs[0].priority_class == "batch", (
        "the header's class wins over the priority field")
    assert fake_dispatcher.jobs[0].priority == 2, "the job carries its class's priority"
    assert r.headers["x-lora-priority-class"] == "batch", "the response names the class that served it"


async def test_the_priority_field_picks_the_class_when_there_is_no_header(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        completion = await client.post("/v1/completions", json={**COMPLETION, "priority": 0})
        chat = await client.post("/v1/chat/completions", json={**CHAT, "priority": 2})
    assert completion.status_code == 200, f"a completion with a priority succeeds: {completion.text}"
    assert chat.status_code == 200, f"a chat completion with a priority succeeds: {chat.text}"
    assert fake_dispatcher.jobs[0].priority_class == "interactive", "completions: priority 0 is interactive"
    assert fake_dispatcher.jobs[0].priority == 0, "completions: the job carries priority 0"
    assert fake_dispatcher.jobs[1].priority_class == "batch", "chat: priority 2 is batch"
    assert chat.headers["x-lora-priority-class"] == "batch", "chat: the response names the class"


async def test_a_request_without_header_or_priority_is_in_the_default_class(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json={**COMPLETION, "n": 2})
    assert r.status_code == 200, f"the request succeeds: {r.text}"
    assert [j.priority_class for j in fake_dispatcher.jobs] == ["standard", "standard"], (
        "every choice's job is in the default class")
    assert [j.priority for j in fake_dispatcher.jobs] == [1, 1], (
        "every job carries the default class's priority")
    assert r.headers["x-lora-priority-class"] == "standard", "the response names the default class"


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                            ("/generate", LORAX), ("/generate_stream", LORAX)])
async def test_an_unknown_class_is_a_400_naming_the_known_classes(fake_dispatcher, path, body):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post(path, json=body, headers={"x-lora-priority": "platinum"})
    assert r.status_code == 400, f"{path}: an unknown class is the client's error: {r.text}"
    message = r.json()["error"]["message"]
    assert "'platinum'" in message, f"{path}: the message names the unknown class: {message}"
    assert "interactive, standard, batch" in message, (
        f"{path}: the message names the known classes: {message}")
    assert fake_dispatcher.jobs == [], f"{path}: nothing was sent to a replica"


@pytest.mark.parametrize(("path", "body", "stream"), [
    ("/v1/completions", COMPLETION, False), ("/v1/completions", {**COMPLETION, "stream": True}, True),
    ("/v1/chat/completions", CHAT, False), ("/v1/chat/completions", {**CHAT, "stream": True}, True),
    ("/generate", LORAX, False), ("/generate_stream", LORAX, True),
    ("/", LORAX, False), ("/", {**LORAX, "stream": True}, True),
])
async def test_every_generation_response_names_its_class(fake_dispatcher, path, body, stream):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post(path, json=body, headers={"x-lora-priority": "interactive"})
    assert r.status_code == 200, f"{path}: the request succeeds: {r.text}"
    kind = "text/event-stream" if stream else "application/json"
    assert r.headers["content-type"].startswith(kind), f"{path}: the response is {kind}"
    assert r.headers["x-lora-priority-class"] == "interactive", f"{path}: the response names its class"
    assert fake_dispatcher.jobs[0].priority_class == "interactive", f"{path}: the job carries the class"
    assert fake_dispatcher.jobs[0].priority == 0, f"{path}: the job carries the class's priority"


async def test_lorax_routes_ignore_a_priority_field_and_use_the_default_class(fake_dispatcher):
    body = {**LORAX, "parameters": {**LORAX["parameters"], "priority": 0}}
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/generate", json=body)
    assert r.status_code == 200, f"the request succeeds: {r.text}"
    assert r.headers["x-lora-priority-class"] == "standard", (
        "LoRAX's schema has no priority field: without the header, the default class")


# ----- x-request-id: accepted or generated, echoed, in every log line of the request; JSON lines -----


@pytest.fixture
def log_lines():
    """lora-cluster's log lines in JSON, captured while the test runs (a list of dicts, filled lazily)."""
    import io
    import json
    import logging

    from lora_cluster.serve.ops.logs import LOGGER, configure_logging

    stream = io.StringIO()
    handler = configure_logging("json", logging.INFO, stream=stream)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(handler)
        logger.propagate, logger.level = True, logging.NOTSET


class LoggingTokenizer(FakeTokenizer):
    """Logs one INFO line per prompt it encodes (on the ingress's tokenizer threads)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        import logging

        logging.getLogger("lora_cluster.test_tokenizer").info("encoding %d characters", len(text))
        return super().encode(text, add_special_tokens)


async def test_a_client_request_id_is_echoed_and_travels_with_the_job(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "req-42"})
    assert r.status_code == 200, f"the request succeeds: {r.text}"
    assert r.headers.get_list("x-request-id") == ["req-42"], "the client's x-request-id is echoed once"
    assert fake_dispatcher.jobs[0].http_request_id == "req-42", (
        "the job sent to the replica carries the request id (the replica logs with it)")


async def test_a_request_id_is_generated_when_absent_and_echoed_on_errors_too(fake_dispatcher):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        ok = await client.post("/v1/completions", json=COMPLETION)
        other = await client.post("/v1/completions", json=COMPLETION)
        bad = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": -1},
                                headers={"x-request-id": "bad-1"})
    generated = ok.headers.get("x-request-id", "")
    assert re.fullmatch(r"[0-9a-f]{32}", generated), f"a request without one gets a new id: {generated!r}"
    assert other.headers.get("x-request-id") != generated, "each request gets its own id"
    assert fake_dispatcher.jobs[0].http_request_id == generated, "the job carries the generated id"
    assert bad.status_code == 400, f"an invalid request is refused: {bad.text}"
    assert bad.headers.get("x-request-id") == "bad-1", "an error response echoes the id too"


async def test_every_log_line_of_a_request_carries_its_id_and_json_lines_parse(fake_dispatcher, log_lines):
    async with serving(LoggingTokenizer(), fake_dispatcher) as client:
        first = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "one"})
        second = client.post("/v1/completions", json={**COMPLETION, "prompt": "hello"},
                             headers={"x-request-id": "two"})
        responses = await asyncio.gather(first, second)
    assert [r.status_code for r in responses] == [200, 200], "both requests succeed"
    lines = [line for line in log_lines() if line["logger"] == "lora_cluster.test_tokenizer"]
    by_id = {line["request_id"]: line["message"] for line in lines}
    assert by_id == {"one": "encoding 2 characters", "two": "encoding 5 characters"}, (
        f"each request's line (logged on a tokenizer thread) carries that request's id: {lines}")
    assert all({"ts", "level", "logger", "message", "request_id"} <= set(line) for line in lines), (
        "a JSON line has ts, level, logger, message and request_id")


async def test_a_cancelled_call_is_an_info_line_not_an_unexpected_error(fake_dispatcher, log_lines):
    """Regression: when a client disconnects, Ray Serve cancels the request's calls and the stream being
    read raises TaskCancelledError; that was logged as ERROR "unexpected error" with a traceback."""
    from ray.exceptions import TaskCancelledError

    class CancelledStream(FakeStream):
        async def __anext__(self) -> dict[str, Any]:
            raise TaskCancelledError()

    async def start(job: GenerateJob, route: str) -> Generation:
        fake_dispatcher.jobs.append(job)
        first = outputs(job)[0]
        return Generation(job=job, replica="r1", hit=True, first=first, stream=CancelledStream([]))

    fake_dispatcher.start = start
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "gone"})
    lines = log_lines()
    assert r.status_code == 503, f"a cancelled call ends the request as aborted: {r.text}"
    assert not [line for line in lines if line["level"] in ("ERROR", "CRITICAL")], (
        f"a cancelled call logs no error: {lines}")
    info = [line for line in lines if line["level"] == "INFO" and "cancelled" in line["message"]]
    assert len(info) == 1, f"it is one INFO line: {lines}"
    assert "exc_info" not in info[0], "without a traceback"
    assert info[0]["request_id"] == "gone", "and with the request's id"


# ----- log probabilities and merged adapters at the ingress (issue 12) --------------------------------


def _with_logprobs(fake_dispatcher: FakeDispatcher) -> None:
    """Make the fake replica attach a logprob (and 2 alternatives) to each "x" token, as the engine does."""
    from lora_cluster.request.output import TokenLogprob

    lp = TokenLogprob(120, -0.5, ((120, -0.5), (121, -1.5)))

    async def start(job: GenerateJob, route: str) -> Generation:
        fake_dispatcher.jobs.append(job)
        items = outputs(job)
        for item in items:
            item["delta_logprobs"] = [lp]
            item["logprobs"] = [lp] * item["completion_tokens"] if item["finished"] else None
        return Generation(job=job, replica="r1", hit=True, first=items[0], stream=FakeStream(items[1:]))

    fake_dispatcher.start = start


async def test_openai_logprobs_reach_the_engine_and_come_back_in_openai_shapes(fake_dispatcher):
    _with_logprobs(fake_dispatcher)
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        completion = await client.post("/v1/completions", json={
            "model": "a1", "prompt": "hi", "max_tokens": 3, "logprobs": 2})
        chat = await client.post("/v1/chat/completions", json={
            "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 1})
        stream = await client.post("/v1/completions", json={
            "model": "a1", "prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True})
    sent = [job.sampling.logprobs for job in fake_dispatcher.jobs]
    assert sent == [2, 1, 1], f"the engine is asked for the requested alternatives: {sent}"
    lp = completion.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["x", "x", "x"], "token_logprobs": [-0.5] * 3,
                  "top_logprobs": [{"x": -0.5, "y": -1.5}] * 3, "text_offset": [0, 1, 2]}, (
        f"completions logprobs in OpenAI's shape: {lp}")
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": [
        {"token": "x", "logprob": -0.5, "bytes": [120]}, {"token": "y", "logprob": -1.5, "bytes": [121]}]}, (
        f"chat logprobs in OpenAI's shape: {content}")
    offsets = re.findall(r'"text_offset":\[(\d+)\]', stream.text)
    assert offsets == ["0", "1", "2"], f"streamed chunks carry their tokens' offsets, continued: {offsets}"


@pytest.mark.parametrize("route,body,needle", [
    ("/v1/chat/completions", {"model": "a1", "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "requires logprobs"),
    ("/v1/completions", {"model": "a1", "prompt": "hi", "logprobs": 21}, "max_logprobs"),
    ("/generate", {"inputs": "hi", "parameters": {"return_k_alternatives": 21}}, "max_logprobs"),
    ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "a1", "merged_adapters": {
        "ids": ["a0"], "weights": [1.0], "density": 1.0}}}, "at most one"),
    ("/v1/completions", {"model": "base", "prompt": "hi", "merged_adapters": {
        "ids": [f"a{i}" for i in range(9)], "weights": [1.0] * 9, "density": 1.0}}, "max_merged_adapter_ids"),
    ("/generate", {"inputs": "hi", "parameters": {"merged_adapters": {
        "ids": ["a0", "a1"], "weights": [1.0], "density": 1.0}}}, "2 ids but 1 weights"),
    ("/generate", {"inputs": "hi", "parameters": {"merged_adapters": {
        "ids": ["a0"], "weights": [1.0], "merge_strategy": "svd", "density": 1.0}}}, "merge_strategy"),
])
async def test_invalid_logprobs_and_merges_are_400s_naming_the_field(fake_dispatcher, route, body, needle):
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        r = await client.post(route, json=body)
    assert r.status_code == 400, f"{route} {body}: a 400, got {r.status_code} {r.text}"
    assert needle in r.json()["error"]["message"], f"the message names the problem ({needle}): {r.text}"
    assert not fake_dispatcher.jobs, "nothing is sent to a replica"


async def test_a_merge_is_sent_as_its_own_adapter_id_with_its_recipe(fake_dispatcher):
    merged = {"ids": ["a0", "a2"], "weights": [0.5, 0.5], "merge_strategy": "ties", "density": 0.5}
    async with serving(FakeTokenizer(), fake_dispatcher) as client:
        lorax = await client.post("/generate", json={"inputs": "hi", "parameters": {"merged_adapters": merged,
                                                                                     "max_new_tokens": 1}})
        openai = await client.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 1,
                                                             "merged_adapters": merged})
    assert [lorax.status_code, openai.status_code] == [200, 200], f"both succeed: {lorax.text} {openai.text}"
    first, second = fake_dispatcher.jobs
    assert first.merge is not None and first.merge.ids == ("a0", "a2"), "the job carries the merge recipe"
    assert first.merge.strategy == "ties" and first.merge.density == 0.5, "with its strategy and density"
    assert first.adapter_id == first.merge.adapter_id and first.adapter_id.startswith("merged/"), (
        "the job's adapter id is the merge's own (routing affinity, one device slot)")
    assert second.adapter_id == first.adapter_id, "the same merge from the OpenAI route has the same id"


async def test_a_background_task_started_during_a_request_logs_without_its_id(log_lines):
    import logging

    from lora_cluster.serve.ops.logs import detached, set_request_id

    log = logging.getLogger("lora_cluster.test_background")

    async def request() -> None:
        set_request_id("req-9")
        log.info("in the request")
        loop = asyncio.get_running_loop()
        await loop.create_task(asyncio.to_thread(log.info, "background"), context=detached())

    await asyncio.create_task(request())
    ids = {line["message"]: line["request_id"] for line in log_lines()}
    assert ids == {"in the request": "req-9", "background": "-"}, (
        f"the request's line has its id, a detached background task's line has none: {ids}")

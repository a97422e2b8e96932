"""Pure parts of the serving layer, without Ray: routing policy, request mapping, errors, SSE, metrics; a
replica (on the tiny engine, outside Serve) whose caller goes away."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from lora_cluster import errors as e
from lora_cluster.cluster.routing_score import PlacementTracker, ReplicaView, adapter_cost, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.config import ServeConfig
from lora_cluster.engine import SamplingParams
from lora_cluster.serve.http.lorax_schemas import LoraxParameters, LoraxRequest
from lora_cluster.serve.http.openai_schemas import ChatCompletionRequest, CompletionRequest
from lora_cluster.serve.http.sse import DONE, event
from lora_cluster.serve.http_errors import ApiError, ApiException, NoReplicaError, describe, validation_error
from lora_cluster.serve.ops import metrics, metrics_exposition
from lora_cluster.serve.protocol import GenerateJob, ToReplica, routing_key

LIMITS = ServeConfig(model="m", max_new_tokens=100, default_max_tokens=20, max_n=4)


def view(rid: str, adapters=(), ongoing=0, seqs=8, empty=4, can_allocate=True) -> ReplicaView:
    return ReplicaView(rid, ongoing, seqs, empty, frozenset(adapters), can_allocate)


# ----- routing policy ---------------------------------------------------------------------------


def test_replica_holding_the_adapter_wins():
    assert rank_replicas("x", [view("r1"), view("r2", ["x"])], miss_cost=4)[0] == "r2", (
        "a request goes to the replica that already holds its adapter")


def test_new_adapter_goes_to_the_replica_with_more_empty_slots_then_fewer_requests():
    assert rank_replicas("new", [view("r1", empty=1), view("r2", empty=3)], 4)[0] == "r2", (
        "a new adapter goes to the replica with more empty adapter slots")
    assert rank_replicas("new", [view("r1", ongoing=3), view("r2", ongoing=1)], 4)[0] == "r2", (
        "with equal slots, a new adapter goes to the replica with fewer ongoing requests")
    assert rank_replicas("new", [view("r1", empty=0), view("r2", ongoing=9, seqs=8)], 4)[0] == "r2", (
        "evicting an adapter (no empty slot) costs more than a replica with a little queue")


def test_hot_adapter_spills_only_when_its_queue_exceeds_the_miss_cost():
    busy = view("r1", ["hot"], ongoing=8 + 3, seqs=8)  # 4 requests would wait beyond the batch
    idle = view("r2")
    assert adapter_cost("hot", busy, 4) == 4, "the holder's cost is its queue excess (4 waiting)"
    assert adapter_cost("hot", idle, 4) == 4, "an idle replica without the adapter costs the miss cost"
    assert rank_replicas("hot", [busy, idle], 4)[0] == "r2", "on a cost tie, fewer ongoing requests wins"
    less_busy = view("r1", ["hot"], ongoing=8 + 2, seqs=8)
    assert rank_replicas("hot", [less_busy, idle], 4)[0] == "r1", (
        "a hot adapter stays on its replica while its queue excess is below the miss cost")


def test_blocked_replica_is_avoided_for_a_new_adapter():
    assert rank_replicas("n", [view("r1", can_allocate=False), view("r2", ongoing=2)], 4)[0] == "r2", (
        "a replica whose adapter slots are all pinned by running requests is avoided for a new adapter")


def test_base_model_requests_balance_by_load_and_ties_are_deterministic():
    assert rank_replicas(None, [view("r1", ongoing=2), view("r2", ongoing=1)], 4) == ["r2", "r1"], (
        "base-model requests go to the least loaded replica first")
    assert rank_replicas("a", [view("b"), view("a")], 4) == ["a", "b"], (
        "full ties are broken by the lower replica id, so concurrent routers agree")


def test_placements_count_until_reports_confirm_them():
    t = PlacementTracker(ttl_s=5)
    t.record("r1", "x", now=100.0)
    v = t.view("r1", RoutingStats(empty_adapter_slots=2, max_num_seqs=8), 0, now=101)
    assert "x" in v.adapters, "a recent placement counts as held before the report shows it"
    assert v.empty_adapter_slots == 1, "a recent placement takes one of the reported empty slots"
    reported = RoutingStats(resident=("x",), empty_adapter_slots=1)
    assert t.view("r1", reported, 0, now=101).empty_adapter_slots == 1, (
        "a placement that the report confirms is not counted twice")
    assert "x" not in t.view("r1", RoutingStats(), 0, now=106).adapters, (
        "an expired placement no longer counts when the report lacks it")
    t.prune(["r2"], now=106)
    assert t.recent("r1", 106) == set(), "pruning forgets replicas that are gone"


def test_unknown_replica_is_assumed_to_have_room():
    v = PlacementTracker(ttl_s=5).view("r9", RoutingStats(), ongoing=3, now=0)
    assert v.max_num_seqs > 1000, "without a report, the batch is assumed to have room"
    assert v.empty_adapter_slots >= 1, "without a report, an adapter slot is assumed empty"
    assert v.can_allocate, "without a report, a new adapter is assumed to fit"


def test_routing_key_reads_the_call_arguments():
    job = GenerateJob("id", [1], "a7", SamplingParams())
    assert routing_key((job,)) == ("a7", None), "a generation call is routed by its job's adapter"
    assert routing_key([ToReplica("r1"), "x"]) == (None, "r1"), "a ToReplica call is pinned to its replica"
    assert routing_key(()) == (None, None), "a call without arguments has no adapter and no target"


# ----- request mapping --------------------------------------------------------------------------


def test_openai_parameters_map_to_sampling_params():
    body = CompletionRequest(model="a1", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5,
                             stop="x", seed=3, n=2, ignore_eos=True, stop_token_ids=[9])
    body.check(LIMITS)
    p = body.sampling(LIMITS, 16, choice=1)
    assert p.max_new_tokens == 7, "max_tokens becomes max_new_tokens"
    assert p.temperature == 0.5, "temperature is passed on"
    assert p.top_p == 0.9, "top_p is passed on"
    assert p.top_k == 5, "top_k is passed on"
    assert p.seed == 4, "choice i of a seeded request uses seed + i"
    assert p.stop == ["x"], "a single stop string becomes a list"
    assert p.ignore_eos, "ignore_eos is passed on"
    assert p.stop_token_ids == [9], "stop_token_ids are passed on"
    assert CompletionRequest(model="a", prompt="hi").sampling(LIMITS, 16).max_new_tokens == 16, (
        "without max_tokens the route's default applies")
    assert CompletionRequest(model="a", prompt="hi", top_k=-1).sampling(LIMITS, 16).top_k == 0, (
        "vLLM's top_k=-1 (disabled) becomes the engine's 0")


def test_prompt_forms():
    assert CompletionRequest(model="m", prompt="a").prompts() == ["a"], "a string is one text prompt"
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]], "a list of ints is one prompt"
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"], (
        "a list of strings is several text prompts")
    assert CompletionRequest(model="m", prompt=[[1], [2]]).prompts() == [[1], [2]], (
        "a list of int lists is several token prompts")
    for empty in ("", [], [""], [[]]):  # the body's schema refuses it: a 400 over HTTP
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt=empty)


@pytest.mark.parametrize("extra", [{"logprobs": 21}, {"suffix": "x"}, {"best_of": 5},
                                   {"n": 5}, {"max_tokens": 101}])
def test_unsupported_or_out_of_limit_openai_parameters_are_refused(extra):
    body = CompletionRequest(model="m", prompt="hi", **extra)
    with pytest.raises(ApiException) as info:
        body.check(LIMITS)
        body.sampling(LIMITS, 16)
    assert info.value.error.status == 400, f"{extra} is refused as the client's error"


def test_chat_request_uses_max_completion_tokens_and_text_parts():
    body = ChatCompletionRequest(model="m", max_completion_tokens=9, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    body.check(LIMITS)
    assert body.sampling(LIMITS, 20).max_new_tokens == 9, "max_completion_tokens limits the reply"
    assert body.conversation() == [{"role": "user", "content": "ab"}], "text content parts are joined"
    named = {"type": "function", "function": {"name": "absent"}}
    absent = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                   tools=[{"type": "function", "function": {"name": "f"}}], tool_choice=named)
    absent.check(LIMITS)
    assert absent.tool_use().name == "absent", (
        "a named function not among the tools is called as a function without parameters (OpenAI: "
        "omitting parameters defines an empty parameter list), not refused")


def test_lorax_greedy_unless_sampling_is_asked_for():
    p, seed = LoraxParameters(max_new_tokens=5).sampling(LIMITS)
    assert p.greedy, "without do_sample or a warper, LoRAX decodes greedily"
    assert seed is None, "a greedy request reports no seed"
    assert p.max_new_tokens == 5, "max_new_tokens is passed on"
    p, seed = LoraxParameters(do_sample=True, seed=11).sampling(LIMITS)
    assert not p.greedy, "do_sample turns sampling on"
    assert seed == 11, "the request's seed is reported"
    assert p.seed == 11, "the request's seed is used"
    assert p.max_new_tokens == 20, "without max_new_tokens the configured default applies"
    p, seed = LoraxParameters(temperature=0.7).sampling(LIMITS)
    assert p.temperature == 0.7, "a warper is passed on"
    assert seed is not None, "a warper turns sampling on (TGI's rule) and a seed is chosen and reported"
    assert p.seed == seed, "the reported seed is the one used"
    assert LoraxParameters(temperature=0.0, do_sample=True).sampling(LIMITS)[0].greedy, (
        "temperature 0 is greedy even with do_sample")
    req = LoraxRequest.model_validate({"inputs": "x", "parameters": {"adapter_id": "a", "stop": ["q"],
                                                                     "return_full_text": True}})
    assert req.parameters.sampling(LIMITS)[0].stop == ["q"], "stop sequences are passed on"
    with pytest.raises(ApiException):
        LoraxParameters(typical_p=0.5).check()


# ----- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "status", "code"), [
    (e.PromptTooLongError(600, 511), 400, "prompt_too_long"),
    (e.RequestError("bad"), 400, "invalid_parameter"),
    (e.AdapterNotFoundError("x", "not found"), 404, "adapter_not_found"),
    (e.AdapterFormatError("x", "pickle"), 400, "invalid_adapter"),
    (e.AdapterRankError("x", 128, 64), 400, "invalid_adapter"),
    (e.AdapterCapacityError("x", "full"), 429, "overloaded"),
    (e.EngineOverloadedError("queue full"), 429, "overloaded"),
    (e.AdapterLoadError("x", "s3 down"), 503, "adapter_unavailable"),
    (NoReplicaError("none"), 503, "no_replica"),
    (ValueError("boom"), 500, "internal_error"),
])
def test_error_mapping(exc, status, code):
    error = describe(exc)
    name = type(exc).__name__
    assert error.status == status, f"{name} maps to status {status}"
    assert error.code == code, f"{name} maps to code {code}"
    body = error.body()["error"]
    assert set(body) == {"message", "type", "code"}, "the body has OpenAI's error shape"
    assert body["message"], "the body carries a message"
    assert ApiError.from_dict(error.to_dict()) == error, "an error survives its wire form (replica->ingress)"


def test_prompt_too_long_message_names_the_limit():
    assert "the limit is 511 tokens" in describe(e.PromptTooLongError(600, 511)).message, (
        "the message names the prompt limit")


def test_ray_serve_failures_map_to_429_and_503():
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    assert describe(BackPressureError(num_queued_requests=5, max_queued_requests=4)).status == 429, (
        "Serve's back pressure (router queue full) is a 429")
    assert describe(DeploymentUnavailableError("LoraReplica")).status == 503, (
        "an unavailable deployment is a 503")


def test_validation_errors_name_the_field():
    err = validation_error([{"loc": ("body", "temperature"), "msg": "must be <= 100"}])
    assert err.status == 400, "an invalid request body is a 400"
    assert "temperature: must be <= 100" in err.message, "the message names the field and the rule"


# ----- SSE, metrics, config ---------------------------------------------------------------------


def test_sse_framing():
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode(), "an event is compact UTF-8 JSON"
    assert DONE == b"data: [DONE]\n\n", "the stream ends with OpenAI's [DONE] event"


def test_engine_gauges_come_from_the_replica_reports():
    report = RoutingStats(num_running=3, num_waiting=1, max_loras=4, empty_adapter_slots=1, miss_penalty=0.5,
                          adapter_thrash={"copy_share": 0.25, "reload_share": 0.75})
    metrics_exposition.set_replica_stats_source(lambda: {"r1": report})
    text = metrics_exposition.render().decode()
    assert 'lora_cluster_adapter_miss_penalty_ratio{replica="r1"} 0.5' in text, "the thrash routing score"
    assert 'lora_cluster_adapter_thrash_copy_ratio{replica="r1"} 0.25' in text, "the copy share of step time"
    assert 'lora_cluster_adapter_thrash_reload_ratio{replica="r1"} 0.75' in text, "the reload share"
    assert 'lora_cluster_engine_running_requests{replica="r1"} 3.0' in text, "running requests per replica"
    assert 'lora_cluster_adapter_slots_in_use{replica="r1"} 3.0' in text, "slots in use = max_loras - empty"
    assert "lora_cluster_replicas 1.0" in text, "the replica count"
    metrics.REQUESTS.labels("/v1/completions", "200").inc()
    text = metrics_exposition.render().decode()
    assert 'lora_cluster_requests_total{route="/v1/completions",status="200"}' in text, (
        "requests are counted by route template and status")


def test_adapter_store_tiers_are_exported_per_replica_and_tier():
    store = {"host": {"hits": 3, "misses": 1, "bytes": 2048, "budget_bytes": 4096}, "disk": {"evictions": 2}}
    metrics_exposition.set_replica_stats_source(lambda: {"r1": RoutingStats(max_loras=4, store=store),
                                              "r2": RoutingStats(max_loras=4)})
    text = metrics_exposition.render().decode()
    assert 'lora_cluster_adapter_cache_hits_total{replica="r1",tier="host"} 3.0' in text, "tier hit counters"
    assert 'lora_cluster_adapter_cache_evictions_total{replica="r1",tier="disk"} 2.0' in text, (
        "tier eviction counters")
    assert 'lora_cluster_adapter_cache_bytes{replica="r1",tier="host"} 2048.0' in text, "tier byte gauges"
    assert 'replica="r2",tier=' not in text, "a replica without an adapter store exports no tier series"


def test_serve_config_reads_the_environment_and_explicit_args_win(monkeypatch):
    monkeypatch.setenv("LORA_CLUSTER_NUM_REPLICAS", "3")
    monkeypatch.setenv("LORA_CLUSTER_MAX_LORAS", "5")
    assert ServeConfig().num_replicas == 3, "a serving field is read from LORA_CLUSTER_<FIELD>"
    assert ServeConfig().engine.max_loras == 5, "an engine field is read from LORA_CLUSTER_<FIELD>"
    assert ServeConfig(num_replicas=2).num_replicas == 2, "an explicit argument wins over the environment"
    assert ServeConfig().model == "demo", "the default model is the demo zoo"
    with pytest.raises(ValueError):
        ServeConfig(max_new_tokens=10, default_max_tokens=20)


def test_build_app_graph_without_starting_ray(tmp_path):
    from lora_cluster.serve.app import replica_options

    opts = replica_options(ServeConfig(model=str(tmp_path), num_replicas=3, num_gpus=0.5, router_miss_cost=2))
    router = opts["request_router_config"]
    assert opts["num_replicas"] == 3, "num_replicas sets the replica deployment's size"
    assert opts["ray_actor_options"]["num_gpus"] == 0.5, "num_gpus is each replica's GPU share"
    assert router.request_router_class.endswith("LoraAffinityRouter"), "the replicas use the affinity router"
    section = router.request_router_kwargs["router"]
    assert section["router_miss_cost"] == 2, "router_miss_cost reaches the router"
    assert json.dumps(router.request_router_kwargs), "the router kwargs are JSON-serialisable, as Serve needs"


def test_a_replica_takes_its_batch_slots_of_preempting_grants_beyond_max_ongoing_requests(tmp_path):
    from lora_cluster.serve.app import replica_options

    on = replica_options(ServeConfig(model=str(tmp_path), max_num_seqs=2, max_ongoing_requests=4))
    off = replica_options(ServeConfig(model=str(tmp_path), max_num_seqs=2, max_ongoing_requests=4,
                                      controller=False))
    assert on["max_ongoing_requests"] == 6, (
        "with the controller on, Serve lets urgent requests preempt past a full admission window")
    assert off["max_ongoing_requests"] == 4, "without it, max_ongoing_requests is Serve's limit as it is"


def test_the_controller_has_room_for_the_queue_of_the_most_replicas_its_group_runs(tmp_path):
    from lora_cluster.serve.app import most_replicas
    from lora_cluster.serve.routing.replica_groups import replica_groups

    fixed = ServeConfig(model=str(tmp_path), num_replicas=3)
    scaled = ServeConfig(model=str(tmp_path), autoscaling_config={"min_replicas": 1, "max_replicas": 40})
    assert most_replicas(fixed, replica_groups(fixed)[0]) == 3, "num_replicas: that many"
    assert most_replicas(scaled, replica_groups(scaled)[0]) == 40, "autoscaling: its max_replicas"
    invalid = ServeConfig(model=str(tmp_path), autoscaling_config={"min_replicas": 5, "max_replicas": 2})
    with pytest.raises(e.ConfigError, match="invalid autoscaling_config"):
        most_replicas(invalid, replica_groups(invalid)[0])


def test_the_ingress_and_replicas_run_on_serves_main_loop_unless_the_environment_says_otherwise(monkeypatch):
    from lora_cluster.serve.app import SINGLE_LOOP_ENV, single_loop

    for name in SINGLE_LOOP_ENV:
        monkeypatch.delenv(name, raising=False)
    options = single_loop({"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}})
    assert options["runtime_env"]["env_vars"] == {"A": "1", **SINGLE_LOOP_ENV}, (
        "the actor's environment gets Serve's single-loop switches, beside its own variables")
    assert options["runtime_env"]["pip"] == ["x"] and options["num_cpus"] == 1, "the other options are kept"
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    kept = single_loop({"num_cpus": 1})["runtime_env"]["env_vars"]
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" not in kept, (
        "a switch the deploying environment sets itself is left to that environment")
    assert kept == {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}, "the other switch is still set"
    own = {"env_vars": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}}
    assert single_loop({"runtime_env": own})["runtime_env"] == own, "the options' own value of a switch wins"


# ----- the replica's stream coalescing -------------------------------------------------------------


def _out(i: int, finished: bool = False) -> object:
    from lora_cluster.engine import RequestOutput

    return RequestOutput(request_id="r", adapter_id=None, prompt_token_ids=[1, 2],
                         token_ids=list(range(i + 1)), text="x" * (i + 1), delta_text="x",
                         delta_token_ids=[i], finished=finished,
                         finish_reason="length" if finished else None)


async def test_coalesce_merges_outputs_that_queue_up_and_keeps_errors_in_order():
    import asyncio

    from lora_cluster.serve.replica.outputs import coalesce

    async def outputs():
        for i in range(3):
            yield _out(i)  # three outputs at once: the consumer sleeps meanwhile
        await asyncio.sleep(0.05)
        yield _out(3, finished=True)

    items = []
    async for item in coalesce(outputs()):
        items.append(item)
        await asyncio.sleep(0.02)
    assert items[-1]["delta_token_ids"] == [3], "the last output arrives on its own"
    assert items[-1]["finished"], "the last item is the finished one"
    assert sum(len(i["delta_token_ids"]) for i in items) == 4, "no token is lost in merging"
    assert len(items) < 4, "outputs that queued up while the consumer slept were merged"
    assert "".join(i["delta_text"] for i in items) == "xxxx", "the merged deltas join to the whole text"
    assert items[-1]["text"] == "xxxx", "the final item carries the whole text"


async def test_coalesce_keeps_every_tokens_logprob():
    import asyncio

    from lora_cluster.request.output import TokenLogprob
    from lora_cluster.serve.replica.outputs import coalesce

    def with_logprob(i: int, finished: bool = False) -> object:
        out = _out(i, finished)
        out.delta_logprobs = [TokenLogprob(i, -float(i))]
        out.logprobs = [TokenLogprob(j, -float(j)) for j in range(i + 1)]
        return out

    async def outputs():
        for i in range(3):
            yield with_logprob(i)
        await asyncio.sleep(0.05)
        yield with_logprob(3, finished=True)

    items = []
    async for item in coalesce(outputs()):
        items.append(item)
        await asyncio.sleep(0.02)
    merged = [lp.token_id for item in items for lp in item["delta_logprobs"]]
    assert len(items) < 4, "outputs that queued up were merged"
    assert merged == [0, 1, 2, 3], "the merged items carry every token's logprob, in order"
    assert [lp.token_id for lp in items[-1]["logprobs"]] == [0, 1, 2, 3], "the final item carries them all"

    async def failing():
        yield _out(0)
        raise e.AdapterNotFoundError("a", "gone")

    got = []
    with pytest.raises(e.AdapterNotFoundError):
        async for item in coalesce(failing()):
            got.append(item)
    assert len(got) == 1, "the output before the error was delivered before the error was raised"


async def test_leaving_a_coalesced_stream_closes_the_engine_stream():
    import asyncio

    from lora_cluster.serve.replica.outputs import coalesce

    closed = asyncio.Event()

    async def endless():
        try:
            i = 0
            while True:
                yield _out(i)
                i += 1
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    stream = coalesce(endless())
    await stream.__anext__()
    await stream.aclose()
    await asyncio.wait_for(closed.wait(), 20)  # bounded: fails (TimeoutError) if the source stays open


# ----- the replica: a caller going away ------------------------------------------------------------


@pytest.fixture
def replica(demo_zoo, monkeypatch):
    """A `LoraReplica` outside Ray Serve (its Serve and Ray context faked, the test process's logging
    left alone) on the tiny demo model, its engine steps slowed to 5 ms at least: a 400-token request
    runs for 2 s or more, so it is still running when the test's caller goes away."""
    import time
    from types import SimpleNamespace

    from lora_cluster.serve.replica import deployment as replica_module

    monkeypatch.setattr(replica_module.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    monkeypatch.setattr(replica_module.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=str))
    monkeypatch.setattr(replica_module, "configure_logging", lambda *args, **kwargs: None)
    made = replica_module.LoraReplica.func_or_class({
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "max_loras": 2,
        "max_num_seqs": 4, "lora_cpu_native": False})
    step = made.engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(made.engine, "step", slow_step)
    yield made
    made.aengine.shutdown()


def _long_job(max_new_tokens: int = 400) -> GenerateJob:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateJob(request_id="gone", prompt="the quick brown fox", adapter_id="a1", sampling=sampling)


async def _running(replica) -> int:
    """Requests the engine runs, asked on its loop after every command already sent to it."""
    return await replica.aengine.call(lambda engine: engine.stats().num_running)


@pytest.mark.parametrize("leave", ["task cancelled", "CancelledError at the yield", "closed at the yield"])
async def test_a_caller_going_away_aborts_the_request_and_counts_it_as_cancelled(replica, leave):
    """However the cancellation reaches `generate`: Ray cancels the task that awaits its next item
    (Serve's default mode), or, while it waits at its `yield`, Serve throws `CancelledError` there or
    closes it (Serve running user code on its own loop, as in throughput mode). Regression: the two
    ways at the `yield` were not counted as cancelled, and the abort was left to garbage collection."""
    import asyncio

    stream = replica.generate(_long_job())
    first = await asyncio.wait_for(stream.__anext__(), 20)
    assert not first["finished"], "the request has more tokens to generate"
    assert await _running(replica) == 1, "the request is generating when its caller goes away"
    if leave == "task cancelled":
        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    elif leave == "CancelledError at the yield":
        with pytest.raises(asyncio.CancelledError):
            await stream.athrow(asyncio.CancelledError())
    else:
        await stream.aclose()
    assert await _running(replica) == 0, "the abort reached the engine before the call ended"
    assert replica.counts["cancelled"] == 1, "the replica counts the request as cancelled"


async def test_a_caller_closing_the_stream_after_its_last_item_cancels_nothing(replica):
    stream = replica.generate(_long_job(max_new_tokens=4))
    items = []
    async for item in stream:
        items.append(item)
        if item["finished"]:
            break  # the caller stops at the last item, before the stream's end
    await stream.aclose()
    assert items[-1]["finished"], "the request ran to its end"
    assert replica.counts["cancelled"] == 0, "a request that ended is not counted as cancelled"


def test_an_oversubscribed_replica_loses_ties_so_thrashing_stops():
    # r1 was sent 5 distinct adapters lately but has 4 slots; "x" is also on r2, which is not full
    r1 = ReplicaView("r1", 0, 8, 0, frozenset("abcdx"), confirmed=frozenset("abcx"), working_set=5,
                     max_loras=4)
    r2 = ReplicaView("r2", 0, 8, 0, frozenset("efgx"), confirmed=frozenset("efgx"), working_set=4,
                     max_loras=4)
    assert rank_replicas("x", [r1, r2], 4)[0] == "r2", "an oversubscribed replica loses a tie"
    assert rank_replicas("a", [r1, r2], 4)[0] == "r1", "a hit on an oversubscribed replica still wins"


def test_a_confirmed_copy_wins_over_a_recent_placement():
    placed = ReplicaView("r1", 0, 8, 2, frozenset("x"), confirmed=frozenset())
    resident = ReplicaView("r2", 0, 8, 2, frozenset("x"), confirmed=frozenset("x"))
    assert rank_replicas("x", [placed, resident], 4)[0] == "r2", (
        "a replica whose report confirms the adapter beats one that was only recently sent it")


async def test_a_source_cancelled_under_the_consumer_ends_its_batches_with_an_abort_error():
    import asyncio

    from lora_cluster.serve.protocol import batches

    async def cancelled_source():
        yield 1
        raise asyncio.CancelledError  # e.g. the call under the stream was cancelled by someone else

    got: list[int] = []

    async def consume() -> None:
        async for group in batches(cancelled_source()):
            got.extend(group)

    with pytest.raises(e.RequestAbortedError):
        await asyncio.wait_for(consume(), 20)  # bounded: the defect was a consumer waiting forever
    assert got == [1], "the items that preceded the cancellation were delivered first"


async def test_a_cancelled_choice_ends_a_merged_response_with_an_abort_error():
    import asyncio

    from lora_cluster.serve.http.context import merge

    class Choice:
        """Duck-typed `Generation`: yields `items`, then ends as `end` says."""

        def __init__(self, items: list[dict], end: BaseException | None):
            self._items, self._end, self.cancelled = items, end, False

        async def items(self):
            for item in self._items:
                yield item
            if self._end is not None:
                raise self._end

        def cancel(self) -> None:
            self.cancelled = True

    choices = [Choice([{"n": 0}], None), Choice([{"n": 1}], asyncio.CancelledError())]
    got: list[tuple[int, dict]] = []

    async def consume() -> None:
        async for index, item in merge(choices):  # type: ignore[arg-type]
            got.append((index, item))

    with pytest.raises(e.RequestAbortedError, match="choice 1 was cancelled"):
        await asyncio.wait_for(consume(), 20)
    assert (1, {"n": 1}) in got, "the cancelled choice's items before the cancellation were delivered"
    assert all(c.cancelled for c in choices), "leaving the merge cancels every choice"


def test_only_the_ingress_keeps_serves_access_line_unless_internal_calls_are_asked_for(monkeypatch):
    from lora_cluster.serve.app import internal_logging
    from lora_cluster.serve.controller_actor import ClusterController
    from lora_cluster.serve.http.ingress import LoraIngress

    config = ServeConfig()
    assert ClusterController.options(logging_config=internal_logging(config)).logging_config[
        "enable_access_log"] is False, "an internal deployment writes no access line per call by default"
    assert LoraIngress.logging_config is None, (
        "the ingress's logging_config is left to the application (Serve's HTTP access line stays on)")
    monkeypatch.setenv("LORA_CLUSTER_INTERNAL_ACCESS_LOG", "true")
    assert internal_logging(ServeConfig()) == {"enable_access_log": True}, (
        "LORA_CLUSTER_INTERNAL_ACCESS_LOG=true turns the internal calls' access lines on")


def test_the_prompt_limit_is_the_tightest_of_the_settings_and_the_model_context():
    from types import SimpleNamespace

    from lora_cluster.serve.http.prompt_limits import prompt_limit

    config = ServeConfig(model="m", max_model_len=4096)
    assert prompt_limit(config, SimpleNamespace(model_max_length=512)) == 511, (
        "a model whose tokenizer states a 512-token context takes prompts of at most 511 tokens")
    assert prompt_limit(config, SimpleNamespace(model_max_length=10**30)) == 4095, (
        "a tokenizer without a stated context leaves max_model_len - 1")
    capped = ServeConfig(model="m", max_model_len=4096, max_prompt_tokens=100)
    assert prompt_limit(capped, SimpleNamespace()) == 100, "max_prompt_tokens caps it"
    grouped = ServeConfig(model="m", max_model_len=2048, replica_groups=[
        {"name": "long", "engine": {"max_model_len": 8192}}])
    assert prompt_limit(grouped, SimpleNamespace()) == 8191, (
        "a replica group's own max_model_len is not cut by the top level's (its engine refuses over it)")

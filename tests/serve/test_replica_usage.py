"""A replica's usage record of one request (`serve.replica.usage`): built from the job and the latest
output, whatever way the request ended."""

from __future__ import annotations

from lora_cluster.request import RequestOutput, SamplingParams
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.replica.usage import UsageTap
from lora_cluster.tenancy.usage_record import Outcome, adapter_version


def job(adapter_id: str | None = "fin@3", queued_s: float = 0.0) -> GenerateJob:
    return GenerateJob(request_id="req-1", prompt=[1, 2, 3], adapter_id=adapter_id,
                       sampling=SamplingParams(max_new_tokens=4), priority_class="standard", tenant="acme",
                       queued_s=queued_s)


def output(finished: bool, tokens: int, preemptions: int = 0, reason: str | None = "length") -> RequestOutput:
    return RequestOutput(request_id="req-1", adapter_id="fin@3", prompt_token_ids=[1, 2, 3],
                         token_ids=list(range(tokens)), text="", delta_text="", delta_token_ids=[],
                         finished=finished, finish_reason=reason if finished else None,
                         num_preemptions=preemptions, num_cached_tokens=2, device_s=0.25, queue_s=0.5)


async def replay(tap: UsageTap, outs: list[RequestOutput]) -> None:
    async def source():
        for out in outs:
            yield out

    async for _ in tap.watch(source()):
        pass


async def test_a_completed_request_reports_the_tokens_and_device_time_of_its_last_output():
    tap = UsageTap()
    await replay(tap, [output(False, 1), output(True, 4)])
    rec = tap.record(job(), "rep-1", "demo", cancelled=False, refused=False)
    assert (rec.tenant, rec.adapter, rec.version) == ("acme", "fin", 3), \
        "tenant, adapter and version of the job"
    assert (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens) == (3, 2, 4), "tokens of the last output"
    assert rec.device_s == 0.25, "device-seconds of the last output (cumulative)"
    assert rec.outcome is Outcome.COMPLETED, "a finished request completed"


async def test_a_preempted_then_finished_request_reads_preempted_resumed():
    tap = UsageTap()
    await replay(tap, [output(True, 4, preemptions=1)])
    rec = tap.record(job(), "rep-1", "demo", cancelled=False, refused=False)
    assert rec.outcome is Outcome.PREEMPTED_RESUMED, "a preemption then completion is preempted_resumed"


async def test_a_caller_gone_mid_stream_is_cancelled_with_what_it_got():
    tap = UsageTap()
    await replay(tap, [output(False, 2)])
    rec = tap.record(job(), "rep-1", "demo", cancelled=True, refused=False)
    assert rec.outcome is Outcome.CANCELLED, "a request whose caller went away is cancelled"
    assert rec.output_tokens == 2, "it is charged the tokens produced so far"


def test_a_request_refused_before_any_output_is_refused_with_no_cost():
    rec = UsageTap().record(job(None), "rep-1", "demo", cancelled=False, refused=True)
    assert rec.outcome is Outcome.REFUSED, "refused before running"
    assert (rec.adapter, rec.version, rec.device_s) == ("", 0, 0.0), "base model, no device time"


def test_adapter_ids_without_a_version_read_version_0():
    assert adapter_version("team/fin") == ("team/fin", 0), "no @N suffix: version 0"


async def test_the_queue_time_is_the_cluster_queue_wait_plus_the_engine_wait():
    tap = UsageTap()
    await replay(tap, [output(True, 4)])
    rec = tap.record(job(queued_s=1.25), "rep-1", "demo", cancelled=False, refused=False)
    assert rec.queue_s == 1.75, "1.25 s waiting for its grant at the ingress plus 0.5 s in the engine's queue"

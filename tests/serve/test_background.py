"""`serve.ops.background`: the serving side's background tasks (`keep_running`) and the bounded wait
they stop in (`within`)."""

from __future__ import annotations

import asyncio

import pytest

from lora_cluster.serve.ops.background import keep_running, within


async def test_a_cancel_that_arrives_as_the_awaited_call_completes_stops_the_waiting_task():
    """Python 3.11's `asyncio.wait_for` returns the result and drops such a cancel, so a background
    loop that was stopped ran on (a CI run hung at its event loop's teardown on the metrics pusher)."""
    answer = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(within(answer, 5.0))
    await asyncio.sleep(0)  # the task now waits for the answer
    answer.set_result("granted")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_call_that_does_not_answer_in_time_times_out():
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await within(never, 0.01)


async def test_an_answer_in_time_is_returned():
    answer = asyncio.get_running_loop().create_future()
    answer.set_result(7)
    assert await within(answer, 1.0) == 7, "the awaited result"


async def test_a_running_task_is_kept_and_an_ended_one_started_again():
    started = 0

    async def loop_forever() -> None:
        nonlocal started
        started += 1
        await asyncio.Event().wait()

    task = keep_running(None, loop_forever)
    await asyncio.sleep(0)
    assert keep_running(task, loop_forever) is task, "a running task is kept"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    again = keep_running(task, loop_forever)
    assert again is not task, "an ended task is started again"
    await asyncio.sleep(0)
    again.cancel()
    assert started == 2, "each start ran the loop once"


def test_off_an_event_loop_nothing_is_started():
    async def never_run() -> None:
        raise AssertionError("started off a loop")

    coroutine_factory_calls = []

    def start():
        coroutine_factory_calls.append(1)
        return never_run()

    assert keep_running(None, start) is None, "no running loop: no task"
    assert not coroutine_factory_calls, "and no coroutine made"

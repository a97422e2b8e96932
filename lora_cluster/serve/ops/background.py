"""One background task per owner, kept running: the pollers, pushers, reporters and tickers of the
serving side (`keep_running`), and a bounded wait that such a loop can be stopped in (`within`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from lora_cluster.serve.ops.logs import detached

T = TypeVar("T")


def keep_running(task: asyncio.Task[None] | None,
                 start: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None] | None:
    """`task` while it runs; otherwise (never started, ended, failed) a new task of `start()` on the
    running event loop, in a context of its own (`logs.detached`: its log lines belong to no
    request). Called off an event loop, `task` as it is: the first call on one starts it."""
    if task is not None and not task.done():
        return task
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return task
    return loop.create_task(start(), context=detached())


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await awaitable`, raising TimeoutError after `timeout_s`. Unlike `asyncio.wait_for` on Python
    3.11, a cancellation of the waiting task that arrives as the awaitable completes is not lost
    (wait_for then returns the result, and a loop that was being stopped runs on: a task that never
    ends when cancelled, and a shutdown that waits for it forever)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable

"""One background task per owner, kept running: the pollers, pushers, reporters and tickers of the
serving side (`keep_running`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from lora_cluster.serve.ops.logs import detached


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

"""The controller's batch window on the actor's event loop: `cluster.batch_window.BatchWindow` (the
policy, shared with the simulator) with its timer on the running loop and each caller's outcome a
future to await.

At `window_s` 0 the window is sent at the end of the event loop's current turn (`call_soon`), so the
inputs that reach the actor in one turn still go together; above 0, `window_s` after it opened. A
park whose caller was cancelled before its window is sent is left out (`wanted`); one cancelled
after is the caller's to cancel (`Controller.cancel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from lora_cluster.cluster import batch_window
from lora_cluster.cluster.batch_window import Outcome, Park
from lora_cluster.cluster.cluster_queue import Ticket


def _on_loop(delay_s: float, fn: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    if delay_s > 0:
        loop.call_later(delay_s, fn)
    else:
        loop.call_soon(fn)


def _settle(future: asyncio.Future[Any], value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    _settle(future, error=error)


def _wanted(future: asyncio.Future[Any]) -> bool:
    return not future.cancelled()


class BatchWindow:
    def __init__(self, park_many: Callable[[Sequence[Park]], list[Outcome]], dispatch: Callable[[], None],
                 window_s: float, after: Callable[[], None] = lambda: None):
        self.window = batch_window.BatchWindow(park_many, dispatch, window_s, _on_loop, after)

    async def park(self, ticket: Ticket, claims: Mapping[str, Any] | None) -> Outcome:
        """`ticket`'s outcome as `Controller.park_many` gives it, once its window is sent."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.window.park(ticket, claims, deliver=lambda outcome: _settle(future, outcome),
                         fail=lambda error: _settle(future, error=error),
                         wanted=lambda: not future.cancelled())
        return await future

    async def park_all(self, parks: Sequence[tuple[Ticket, Mapping[str, Any] | None]]
                       ) -> list[Outcome | BaseException]:
        """Each ticket's outcome, in order, as `park` gives it (an error of the batch in its place)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Outcome]] = []
        for ticket, claims in parks:
            future: asyncio.Future[Outcome] = loop.create_future()
            futures.append(future)
            self.window.park(ticket, claims, deliver=partial(_settle, future),
                             fail=partial(_fail, future), wanted=partial(_wanted, future))
        return list(await asyncio.gather(*futures, return_exceptions=True))

    async def dispatched(self) -> None:
        """Return once the current window (opened now if none is) has been sent: its dispatch done
        (or failed: the error goes to the event loop's handler)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.window.on_sent(lambda: _settle(future))
        await asyncio.shield(future)

    def dispatch_soon(self) -> None:
        """The queue is to be dispatched at the end of the current window (opened now if none is)."""
        self.window.dispatch_soon()

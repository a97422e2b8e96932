"""The cluster controller's inputs in batch windows (`controller_batch_window_s`): the actor hands the
parks that reach it within one window to `Controller.park_many` at once, and the replica reports of
the window, each taken at once (`Controller.report(..., dispatch=False)`), share that window's one
dispatch of the queue; a report's reply waits for it (`dispatched`), so that its queue depth counts
what is left after the grants of the report's room. A burst of parks and reports thus costs the
controller one dispatch (and one update of each ingress's claims), not one per call.

A window opens with its first park or report and is sent `window_s` later (0: at the end of the
event loop's current turn), so a parked request, or a slot a report frees, waits at most `window_s`
longer for its grant. A park whose caller went away before its window is sent is left out (it never
reaches the queue); one whose caller goes away after is the caller's to cancel
(`Controller.cancel`). If `park_many` fails, every park of its window gets that error; if a dispatch
fails, the error goes to the event loop's handler (logged) and the next window dispatches again.
After each window, `after` runs (the actor delivers the grants decided for tickets parked earlier).
Runs on one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import Grant, Refusal
from lora_cluster.errors import LoraClusterError

Outcome = Grant | Refusal | LoraClusterError | None
Park = tuple[Ticket, Mapping[str, Any] | None]


class BatchWindow:
    def __init__(self, park_many: Callable[[Sequence[Park]], list[Outcome]], dispatch: Callable[[], None],
                 window_s: float, after: Callable[[], None] = lambda: None):
        self._park_many, self._dispatch, self._after = park_many, dispatch, after
        self.window_s = window_s
        self._pending: list[tuple[Ticket, Mapping[str, Any] | None, asyncio.Future[Outcome]]] = []
        self._open = False  # a window is open: its send is scheduled
        self._sent: asyncio.Future[None] | None = None  # resolved when the open window is sent

    async def park(self, ticket: Ticket, claims: Mapping[str, Any] | None) -> Outcome:
        """`ticket`'s outcome as `Controller.park_many` gives it, once its window is sent."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending.append((ticket, claims, future))
        self.dispatch_soon()
        return await future

    async def dispatched(self) -> None:
        """Return once the current window (opened now if none is) has been sent: its dispatch done."""
        self.dispatch_soon()
        if self._sent is None:
            self._sent = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._sent)

    def dispatch_soon(self) -> None:
        """The queue is to be dispatched at the end of the current window (opened now if none is)."""
        if self._open:
            return
        self._open = True
        loop = asyncio.get_running_loop()
        if self.window_s > 0:
            loop.call_later(self.window_s, self._send)
        else:
            loop.call_soon(self._send)

    def _send(self) -> None:
        self._open = False
        parks = [p for p in self._pending if not p[2].cancelled()]
        sent, self._pending, self._sent = self._sent, [], None
        try:
            if not parks:
                self._dispatch()
                self._after()
                return
            try:
                outcomes = self._park_many([(ticket, claims) for ticket, claims, _ in parks])
            except Exception as error:  # every caller of the window hears of it
                for _, _, future in parks:
                    if not future.done():
                        future.set_exception(error)
                return
            for (_, _, future), outcome in zip(parks, outcomes, strict=True):
                if not future.done():
                    future.set_result(outcome)
            self._after()
        finally:
            if sent is not None and not sent.done():
                sent.set_result(None)  # a failed dispatch too: the reports' replies go out

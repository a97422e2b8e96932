"""The cluster controller's inputs in batch windows (`controller_batch_window_s`), as a pure object over an
injected timer: the live actor runs it on its event loop (`serve.batch_window`), the simulator on its
simulated clock (`sim.cluster_policy`), so both run one composition.

The parks that reach the controller within one window go to `Controller.park_many` at once, and the
replica reports of the window, each taken without a dispatch (`Controller.report(..., dispatch=False)`),
share that window's one dispatch of the queue; a report's reply waits for it (`on_sent`), so that its
queue depth counts what is left after the grants of the report's room. A burst of parks and reports
thus costs the controller one dispatch (and one update of each ingress's claims), not one per call.

Policy. A window opens with its first park or report and is sent `window_s` later (`timer(window_s,
send)`; at 0 the live timer sends at the end of the event loop's current turn, the simulator's at
once), so a parked request, or a slot a report frees, waits at most `window_s` longer for its grant.
A park whose caller went away before its window is sent (`wanted()` false) is left out: it never
reaches the queue. Sending: the wanted parks go to `park_many` (none: `dispatch`), each caller's
`deliver` gets its own outcome in park order, then `after` runs once (the actor delivers the grants
decided for tickets parked earlier), then every `on_sent` callback of the window. If `park_many`
raises, every park of the window gets the error (`fail`) and the next window is sent as usual; if
`dispatch` raises, the error propagates to the timer's caller, and the reports' callbacks still run.
Not thread-safe: one event loop, or one simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import Grant, Refusal
from lora_cluster.errors import LoraClusterError

Outcome = Grant | Refusal | LoraClusterError | None
Park = tuple[Ticket, Mapping[str, Any] | None]
Timer = Callable[[float, Callable[[], None]], None]  # timer(delay_s, fn): run fn once, that much later


@dataclass
class _Pending:
    ticket: Ticket
    claims: Mapping[str, Any] | None
    deliver: Callable[[Outcome], None]
    fail: Callable[[BaseException], None]
    wanted: Callable[[], bool]


class BatchWindow:
    """The batch window of one controller (see the module docstring)."""

    def __init__(self, park_many: Callable[[Sequence[Park]], list[Outcome]], dispatch: Callable[[], None],
                 window_s: float, timer: Timer, after: Callable[[], None] = lambda: None):
        self._park_many, self._dispatch, self._after, self._timer = park_many, dispatch, after, timer
        self.window_s = window_s
        self._pending: list[_Pending] = []
        self._on_sent: list[Callable[[], None]] = []
        self._open = False  # a window is open: its send is scheduled

    def park(self, ticket: Ticket, claims: Mapping[str, Any] | None, deliver: Callable[[Outcome], None],
             fail: Callable[[BaseException], None], wanted: Callable[[], bool] = lambda: True) -> None:
        """Add `ticket` to the window (opened now if none is); `deliver` gets its outcome when the
        window is sent, or `fail` the error of its batch."""
        self._pending.append(_Pending(ticket, claims, deliver, fail, wanted))
        self.dispatch_soon()

    def on_sent(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the current window (opened now if none is) has been sent."""
        self._on_sent.append(callback)
        self.dispatch_soon()

    def dispatch_soon(self) -> None:
        """The queue is to be dispatched at the end of the current window (opened now if none is)."""
        if self._open:
            return
        self._open = True
        self._timer(self.window_s, self._send)

    def _send(self) -> None:
        self._open = False
        parks = [p for p in self._pending if p.wanted()]
        waiting, self._pending, self._on_sent = self._on_sent, [], []
        try:
            if not parks:
                self._dispatch()
                self._after()
                return
            try:
                outcomes = self._park_many([(p.ticket, p.claims) for p in parks])
            except Exception as error:  # every caller of the window hears of it
                for p in parks:
                    p.fail(error)
                return
            for p, outcome in zip(parks, outcomes, strict=True):
                p.deliver(outcome)
            self._after()
        finally:
            for callback in waiting:  # a failed dispatch too: the reports' replies go out
                callback()

"""How the simulated ingress and replicas reach the cluster controller, and how its grants come back:
through the controller actor's loop when one is modelled (`sim.control_loop`), else at once.

With a loop, an input's `act` runs at the start of the loop's turn that takes it and the output it
returns leaves at that turn's end; the batch window (at `controller_batch_window_s` 0, the live
actor's `call_soon`) is sent at the turn's end, after its inputs; the grants decided in the turn
(the window's and the ones `take_grants` hands over) leave at its end too. Without one (no cost
model, or a positive window, whose timer then runs on the simulated clock as before), an input acts
and is answered at the instant it arrives, and a grant leaves when it is decided.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from lora_cluster.cluster.controller import Grant, Refusal
from lora_cluster.sim.control_loop import ControlCost, ControlLoop
from lora_cluster.sim.events import EventLoop

Output = Callable[[], None]


class ControlInbox:
    """The controller's inputs and grants (see the module docstring). `deliver()` takes the grants
    decided since the last call and hands each to `granted`; `grant(ticket_id, grant)` sends one."""

    def __init__(self, cost: ControlCost | None, loop: EventLoop, deliver: Output,
                 grant: Callable[[str, Grant | Refusal], None]):
        self._events, self._deliver, self._grant = loop, deliver, grant
        self.loop = None if cost is None else ControlLoop(cost, loop.clock, loop.at, self._end_turn)
        self._window_send: Output | None = None  # the window's send, at the turn's end
        self._outbox: list[tuple[str, Grant | Refusal]] = []  # a turn's grants, sent at its end

    def input(self, kind: str, act: Callable[[], Output | None]) -> None:
        """An input of `kind` (`control_loop.KINDS`) reaches the controller now."""
        if self.loop is not None:
            self.loop.submit(kind, act)
        elif (output := act()) is not None:
            output()

    def window_timer(self, delay_s: float, fn: Output) -> None:
        """The batch window's timer (`cluster.batch_window.Timer`)."""
        if delay_s > 0:
            self._events.after(delay_s, fn)
        elif self.loop is not None:
            self._window_send = fn
        else:
            fn()

    def granted(self, ticket_id: str, grant: Grant | Refusal) -> None:
        """A grant decided: sent at once, or with a loop when its turn ends."""
        if self.loop is not None:
            self._outbox.append((ticket_id, grant))
        else:
            self._grant(ticket_id, grant)

    def figures(self) -> dict[str, float | bool]:
        """Whether a loop is modelled; with one, the share of the run it was busy and its inputs per turn."""
        if self.loop is None:
            return {"controller_loop_modelled": False}
        return {"controller_loop_modelled": True,
                "controller_busy_share": self.loop.busy_s / max(self._events.now, 1e-9),
                "inputs_per_turn": self.loop.inputs / max(1, self.loop.turns)}

    def _end_turn(self) -> Output | None:
        send, self._window_send = self._window_send, None
        if send is not None:
            send()  # the window's `after` takes the grants
        else:
            self._deliver()
        outbox, self._outbox = self._outbox, []
        return partial(self._send_all, outbox) if outbox else None

    def _send_all(self, outbox: list[tuple[str, Grant | Refusal]]) -> None:
        for ticket_id, grant in outbox:
            self._grant(ticket_id, grant)

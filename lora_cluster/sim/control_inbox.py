"""How the simulated ingress and replicas reach the cluster controller, and how its grants come back:
through the controller actor's loop when one is modelled (`sim.control_loop`), else at once.

With a loop, an input's `act` runs at the start of the loop's turn that takes it and the output it
returns leaves at that turn's end; the batch window (at `controller_batch_window_s` 0, the live actor's
`call_soon`) is sent at the turn's end, after its inputs. A park goes in a batch of the ingress's parks
(`cluster.park_batch`), whose call's reply carries the outcomes decided at once; the grants decided
later reach the ingress with the reply of a park call of the same turn (`carry`), or else through its
grants poll: one call in flight (`poll`, a call's cost) while the ingress has tickets waiting, answered
at the end of the first turn that decided a grant or refusal for it and had no park call to carry it,
and sent again as soon as its answer arrives (so each answered poll costs the loop one call). Without a
loop (no cost model, or a positive window, whose timer then runs on the simulated clock as before), an
input acts and is answered at the instant it arrives, and a grant leaves when it is decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from lora_cluster.cluster.batch_window import BatchWindow
from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.controller import Grant, Refusal
from lora_cluster.cluster.park_batch import ParkBatcher
from lora_cluster.sim.control_loop import ControlCost, ControlLoop
from lora_cluster.sim.events import EventLoop

Output = Callable[[], None]


class ControlInbox:
    """The controller's inputs and grants (see the module docstring). `deliver()` takes the grants
    decided since the last call and hands each to `granted`; `grant(ticket_id, grant)` gives one to
    the ingress; `awaiting()` says whether the ingress has tickets at the controller (it polls then)."""

    def __init__(self, cost: ControlCost | None, loop: EventLoop, deliver: Output,
                 grant: Callable[[str, Grant | Refusal], None], awaiting: Callable[[], bool] = lambda: False):
        self._events, self._deliver, self._grant, self._awaiting = loop, deliver, grant, awaiting
        self.loop = None if cost is None else ControlLoop(cost, loop.clock, loop.at, self._end_turn)
        self._window_send: Output | None = None  # the window's send, at the turn's end
        self._mailbox: list[tuple[str, Grant | Refusal]] = []  # grants decided, for the ingress's next poll
        self._polling = False  # the ingress's grants poll is in flight (sent, not answered)
        self._poll_waits = False  # ... and the controller has taken it: the next grants answer it
        self._carrier = False  # a park call's reply leaves at this turn's end: it carries the grants

    def input(self, kind: str, act: Callable[[], Output | None], count: int = 1) -> None:
        """An input of `kind` (`control_loop.KINDS`), carrying `count` items, reaches the controller now."""
        if self.loop is not None:
            self.loop.submit(kind, act, count)
        elif (output := act()) is not None:
            output()

    def deliver(self) -> None:
        """Take the grants decided since the last call (`take_grants`)."""
        self._deliver()

    def poll(self) -> None:
        """The ingress has tickets at the controller: its grants poll goes, unless one is in flight."""
        if self.loop is None or self._polling or not self._awaiting():
            return
        self._polling = True
        self.input("poll", self._poll_taken)

    def _poll_taken(self) -> None:
        self._poll_waits = True

    def carry(self) -> None:
        """A park call of this turn replies at its end: that reply carries the ingress's grants."""
        self._carrier = True

    def window_timer(self, delay_s: float, fn: Output) -> None:
        """The batch window's timer (`cluster.batch_window.Timer`)."""
        if delay_s > 0:
            self._events.after(delay_s, fn)
        elif self.loop is not None:
            self._window_send = fn
        else:
            fn()

    def granted(self, ticket_id: str, grant: Grant | Refusal) -> None:
        """A grant decided: sent at once, or with a loop with the answer to the ingress's grants poll."""
        if self.loop is not None:
            self._mailbox.append((ticket_id, grant))
        else:
            self._grant(ticket_id, grant)

    def figures(self) -> dict[str, float | bool]:
        """Whether a loop is modelled; with one, the share of the run it was busy, its inputs per turn and
        their mean latency (from reaching the actor to the end of the turn that took them)."""
        if self.loop is None:
            return {"controller_loop_modelled": False}
        span = max(self._events.now, 1e-9)
        return {"controller_loop_modelled": True,
                "controller_busy_share": self.loop.busy_s / span,
                "inputs_per_turn": self.loop.inputs / max(1, self.loop.turns),
                "input_latency_s_mean": self.loop.latency_s / max(1, self.loop.inputs),
                "inputs_per_s": self.loop.inputs / span,
                "parks_per_s": self.loop.items["park"] / span,
                "park_calls_per_s": self.loop.by_kind["park"] / span,
                "report_inputs_per_s": self.loop.by_kind["report"] / span,
                "poll_calls_per_s": self.loop.by_kind["poll"] / span}

    def _end_turn(self) -> Output | None:
        send, self._window_send = self._window_send, None
        if send is not None:
            send()  # the window's `after` takes the grants
        else:
            self._deliver()
        carrier, self._carrier = self._carrier, False
        if not self._mailbox or not (carrier or self._poll_waits):
            return None
        outbox, self._mailbox = self._mailbox, []
        if carrier:  # with a park call's reply: the poll, if any, still waits
            return partial(self._send_all, outbox)
        self._poll_waits = False
        return partial(self._answered, outbox)

    def _send_all(self, outbox: list[tuple[str, Grant | Refusal]]) -> None:
        for ticket_id, grant in outbox:
            self._grant(ticket_id, grant)

    def _answered(self, outbox: list[tuple[str, Grant | Refusal]]) -> None:
        """The poll's answer reaches the ingress: its grants go, and it polls again if tickets wait."""
        self._polling = False
        self._send_all(outbox)
        self.poll()


@dataclass
class ShardPlane:
    """How the simulated ingress and replicas reach one controller (shard): its actor loop's inbox, its
    batch window, the ingress's park batcher for it, and the grants its batch in flight got at once."""

    inbox: ControlInbox
    window: BatchWindow
    batcher: ParkBatcher[Ticket]
    immediate: list[tuple[str, Grant | Refusal]] = field(default_factory=list)


def shard_loop_figures(loops: list[dict[str, float | bool]]) -> dict[str, float | bool]:
    """The shards' loops as one `control_plane`: the busiest one's busy share (and the quietest's),
    its most inputs per turn, the longest mean input latency, and the inputs, parks and calls a second
    summed over them."""
    if not all(f.get("controller_loop_modelled") for f in loops):
        return {"controller_loop_modelled": False}
    figures: dict[str, float | bool] = {"controller_loop_modelled": True}
    busy = [float(f["controller_busy_share"]) for f in loops]
    figures["controller_busy_share"] = max(busy)  # the busiest shard's
    figures["quietest_shard_busy_share"] = min(busy)
    figures["inputs_per_turn"] = max(float(f["inputs_per_turn"]) for f in loops)
    figures["input_latency_s_mean"] = max(float(f["input_latency_s_mean"]) for f in loops)
    for key in ("inputs_per_s", "parks_per_s", "park_calls_per_s", "report_inputs_per_s", "poll_calls_per_s"):
        figures[key] = sum(float(f[key]) for f in loops)
    return figures

"""The controller actor's event loop on the simulated clock: busy for what each input costs, the inputs
that reach it while it is busy taken together in its next turn.

Live (`serve.controller_actor`), the controller is one Serve replica with one event loop. A call that
reaches it while it runs others waits; the calls waiting when it is free run in one turn, and the
batch window (`cluster.batch_window`; at `controller_batch_window_s` 0, sent with `call_soon`) is
sent at the end of that turn, so they share one dispatch of the queue. Its answers (grants, report
replies) leave when the turn ends. Under load the actor is busy most of the time, so its batches
grow with the load and its cost per input falls; a simulator that runs every input alone at the
instant it arrives overstates that cost and understates the latency of the control plane.

Model. Each input costs `ControlCost.input_s(kind, count)`: the Serve call's own overhead (`call_s`:
deserialising, the request wrapper, the reply) plus the controller's work for that kind, once per item
it carries (`count`: a batch of parks, `cluster.park_batch`, is one call of several parks); a turn also
costs one dispatch of the queue (`dispatch_s`, its mean: what a dispatch grants varies). The
constants are measured (`benchmarks/profile_controller.py`, committed in
`docs/profile_controller.json`). A turn starts when an input waits and the loop is free: at the
input's arrival if the loop is idle, else when the previous turn ends. Its inputs act on the
controller at its start, in arrival order, then the turn's end (the window's send) runs; its outputs
are delivered when it ends. The cost is a model, not the simulating machine's clock, so a run's
decisions do not depend on that machine (the controller's CPU is still measured and reported beside
it).

Invariants: at most one turn is scheduled at a time; an input never acts before the turn that
takes it starts, and an output never leaves before its turn ends; `busy_s` is the sum of the turns'
costs. Pure: the caller injects the clock and the timer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Act = Callable[[], "Callable[[], None] | None"]  # acts at the turn's start; may return its output
Timer = Callable[[float, Callable[[], None]], None]  # timer(when, fn): run fn at simulated time `when`
# a grants poll (an ingress's one call in flight that its grants answer: `sim.control_inbox`) has no
# work of its own beyond the call; a model without it counts none
KINDS = ("park", "report", "tick", "cancel", "placement", "poll")
OPTIONAL_KINDS = ("poll",)
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "profile_controller.json"


@dataclass(frozen=True)
class ControlCost:
    """Seconds of the controller actor's loop per input, by kind, and per turn's dispatch."""

    call_s: float  # one Serve call's own overhead, whatever it asks
    work_s: dict[str, float]  # the controller's own work per input of each kind (KINDS)
    dispatch_s: float  # one dispatch of the queue (once per turn), its grants included

    def __post_init__(self) -> None:
        values = [self.call_s, self.dispatch_s, *self.work_s.values()]
        if any(v < 0 for v in values) or set(self.work_s) != set(KINDS):
            raise ValueError(f"a controller cost needs a cost >= 0 for each of {KINDS}, got {self}")

    def input_s(self, kind: str, count: int = 1) -> float:
        return self.call_s + count * self.work_s[kind]

    def turn_s(self, inputs: list[tuple[str, int]]) -> float:
        return sum(self.input_s(k, n) for k, n in inputs) + self.dispatch_s

    @classmethod
    def zero(cls) -> ControlCost:
        """No cost: every input acts, and is answered, at the instant it arrives."""
        return cls(0.0, dict.fromkeys(KINDS, 0.0), 0.0)

    @classmethod
    def load(cls, path: Path = DEFAULT_PATH) -> ControlCost:
        """The measured constants (`benchmarks/profile_controller.py`'s output)."""
        return cls.load_dict(json.loads(path.read_text()))

    @classmethod
    def load_dict(cls, data: dict[str, Any]) -> ControlCost:
        try:
            work = data["work_s"]
            return cls(float(data["call_s"]),
                       {k: float(work.get(k, 0.0) if k in OPTIONAL_KINDS else work[k]) for k in KINDS},
                       float(data["dispatch_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a controller cost model needs call_s, work_s.<{'|'.join(KINDS)}> and "
                             f"dispatch_s, in seconds: {e}") from None

    @classmethod
    def named(cls, name: str) -> ControlCost | None:
        """`measured`: the committed model (`docs/profile_controller.json`); `none`: no loop is modelled
        (each input acts, and is answered, at the instant it arrives, as before the model); otherwise
        the path of a model's JSON."""
        if name == "none":
            return None
        return cls.load(DEFAULT_PATH if name == "measured" else Path(name))


class ControlLoop:
    """One controller actor's loop (see the module docstring). `end_turn()` runs after a turn's
    inputs acted (the batch window's send, its dispatch) and returns its output, if any."""

    def __init__(self, cost: ControlCost, clock: Callable[[], float], timer: Timer,
                 end_turn: Callable[[], Callable[[], None] | None]):
        self.cost, self._clock, self._timer, self._end_turn = cost, clock, timer, end_turn
        self._waiting: list[tuple[str, int, Act, float]] = []  # (kind, items, act, when it arrived)
        self._scheduled = False
        self.free_at = 0.0  # when the current turn ends
        self.busy_s = 0.0
        self.turns = 0
        self.inputs = 0
        self.latency_s = 0.0  # summed over inputs: from arrival to the end of the turn that took it
        self.by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)  # inputs (calls) of each kind
        self.items: dict[str, int] = dict.fromkeys(KINDS, 0)  # what they carried (parks in batches)

    def submit(self, kind: str, act: Act, count: int = 1) -> None:
        """An input of `kind` carrying `count` items reaches the actor now: `act` runs at the start of
        the turn that takes it, and the output it returns is delivered at that turn's end."""
        if kind not in KINDS:
            raise ValueError(f"unknown controller input {kind!r}: one of {KINDS}")
        self._waiting.append((kind, count, act, self._clock()))
        if not self._scheduled:
            self._scheduled = True
            self._timer(max(self._clock(), self.free_at), self._turn)

    def _turn(self) -> None:
        taken, self._waiting = self._waiting, []  # `_scheduled` stays set: input submitted now waits
        outputs = [out for _, _, act, _ in taken if (out := act()) is not None]
        last = self._end_turn()
        if last is not None:
            outputs.append(last)
        spent = self.cost.turn_s([(k, n) for k, n, _, _ in taken])
        self.free_at = self._clock() + spent
        for k, n, _, at in taken:
            self.by_kind[k] += 1
            self.items[k] += n
            self.latency_s += self.free_at - at
        self.busy_s += spent
        self.turns += 1
        self.inputs += len(taken)
        for out in outputs:
            self._timer(self.free_at, out)
        self._scheduled = bool(self._waiting)
        if self._scheduled:  # an act submitted more input: it waits for this turn to end
            self._timer(self.free_at, self._turn)

"""The ingress's refusals at the edge in the simulator, and their replay against the controller's decisions.

`SimEdge` is what the live ingress runs (`cluster.edge.EdgeView`), fed as the live one is fed: the
controller's `edge_state` after every park batch and every delivery of grants (the live actor sends it
with its `admit` replies, refusals and grants alike) and, with the adapters the replicas hold, at
every placement fetch (the live `ingress_view`). A request
that would park is refused there when `edge_refusal` says so; the controller never sees it.

Replay (`python -m lora_cluster.sim [options] --edge-replay 0,0.25,1,4`: `sim.edge_replay`): the
same run with the edge deciding but not refusing, so that every park reaches the controller; for
each park and each age d, the edge's decision from the latest state published at least d seconds
earlier (its bound lifted) is set against the controller's decision on that park: both refuse (the
same error class or not), the edge refuses what the controller admits (the cost of staleness the
bound limits), the edge parks what the controller refuses (a park the edge could have saved), both
admit.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.edge import EdgeState, EdgeView, edge_refusal
from lora_cluster.errors import ClusterOverloadedError

OUTCOMES = ("both refuse, same error", "both refuse, other error", "edge refuses, controller admits",
            "edge parks, controller refuses", "both admit")


class SimEdge:
    """The simulated ingress's edge (see the module docstring). `refused`: its refusals by reason."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.view = EdgeView(clock)
        self.refused: Counter[str] = Counter()
        self.decided, self.age_sum_s, self.age_max_s = 0, 0.0, 0.0  # decisions, and their state's age
        self.ages: tuple[float, ...] = ()  # replay: the ages judged (empty: the edge refuses)
        self._times: list[float] = []  # replay: when each state arrived, and the states
        self._states: list[EdgeState] = []
        self.replay: dict[float, Counter[str]] = {}
        self._pending: dict[str, list[ClusterOverloadedError | None]] = {}  # replay: decisions per age

    def start_replay(self, ages: tuple[float, ...]) -> None:
        """Decide without refusing from now on, and judge each park's decision at each age."""
        self.ages = ages
        self.replay = {d: Counter() for d in ages}

    def offer(self, state: EdgeState) -> None:
        self.view.offer(state)
        if self.ages and self.view.state is not None:
            now = self._clock()
            self._times.append(now)
            self._states.append(self.view.state)
            keep = bisect.bisect_left(self._times, now - max(self.ages) - 1.0)
            if keep > 1024:  # bounded: the states no age can ask for go
                del self._times[:keep], self._states[:keep]

    def refusal(self, ticket: Ticket) -> ClusterOverloadedError | None:
        """The edge's refusal of `ticket`, counted (None: park it; always None in a replay)."""
        if self.ages:
            self._pending[ticket.ticket_id] = [self._decide(ticket, d) for d in self.ages]
            return None
        state = self.view.state
        if state is not None:
            age = self._clock() - state.published_at  # one clock in the simulator
            self.decided += 1
            self.age_sum_s += age
            self.age_max_s = max(self.age_max_s, age)
        found = self.view.refusal(ticket, ticket.enqueued_at)
        if found is None:
            return None
        self.refused[found[0]] += 1
        return found[1]

    def _decide(self, ticket: Ticket, age_s: float) -> ClusterOverloadedError | None:
        """The edge's decision now from the latest state published `age_s` or more ago, its bound lifted."""
        now = self._clock()
        k = bisect.bisect_right(self._times, now - age_s) - 1
        if k < 0:
            return None
        unbounded = self._states[k]._replace(max_age_s=math.inf, held_max_age_s=math.inf)
        found = edge_refusal(unbounded, ticket, now)
        return None if found is None else found[1]

    def judged(self, ticket: Ticket, outcome: object) -> None:
        """Replay: the controller decided `outcome` for `ticket` (an error: refused), after the edge
        decided at its arrival."""
        decisions = self._pending.pop(ticket.ticket_id, None)
        if decisions is None:
            return
        for d, edge in zip(self.ages, decisions, strict=True):
            judged = _outcome(edge, outcome)
            self.replay[d][judged] += 1
            if judged == OUTCOMES[2] and edge is not None:  # by the edge's error: which part was stale
                self.replay[d][f"{judged}: {type(edge).__name__}"] += 1


def _outcome(edge: ClusterOverloadedError | None, controller: object) -> str:
    refused = isinstance(controller, ClusterOverloadedError)
    if edge is None:
        return OUTCOMES[3] if refused else OUTCOMES[4]
    if not refused:
        return OUTCOMES[2]
    return OUTCOMES[0] if type(edge) is type(controller) else OUTCOMES[1]


def edge_figures(edge: SimEdge | None) -> dict[str, Any]:
    """An edge's refusals by reason and the age of the states it decided from (None: no edge)."""
    if edge is None or not edge.decided:
        return {"edge_refused": {} if edge is None else dict(edge.refused), "edge_state_age_s": None}
    return {"edge_refused": dict(edge.refused),
            "edge_state_age_s": {"mean": edge.age_sum_s / edge.decided, "max": edge.age_max_s}}

"""Which requests a class over capacity sheds first: those whose adapter is on no replica.

When a class is over capacity, the cluster queue refuses some of its requests
(`DeadlineOutOfReachError`: the predicted wait would miss its TTFT target; `WaitBoundError`, for a
class without a TTFT target: its queued requests already wait half of `cluster_queue_max_wait_s`).
Which ones it refuses decides
what the cluster spends its capacity on. A request whose adapter no replica holds (resident or
loading) costs more than its tokens: a fetch, a device slot taken from an idle adapter that a later
request of another adapter would have found (a miss later), and on a replica whose slots are all
pinned by running requests, a wait for one. A request whose adapter some replica holds costs its
tokens only. So while a class sheds load (one of its requests was refused for its deadline or its
wait bound within the last `window_s` seconds), a new request of that class whose adapter no
replica holds is refused at once (429 with Retry-After), and the class's share of the capacity
goes to requests that find their adapter: more of them are served, and each replica's idle
adapters stay for the requests that want them.

A class sheds load when either holds:
- one of its requests was refused (its deadline or its wait bound) within the last `window_s`;
- under pressure (`pressure` > 0): a request of the class parked now would wait more than `pressure`
  times its bound (the class's TTFT target; for a class without one, half of
  `cluster_queue_max_wait_s`, where its refusals begin), by the queue's own prediction. The first
  rule alone sees overload only in the second after a refusal; between refusals the queue still
  stands near the target, and each cold request admitted then costs a load and pins a slot for its
  whole run, so the warm requests behind it are refused next. The queue's state says so at once.

Exempt: the most urgent class (its requests preempt less urgent work rather than being refused) and
the base model (every replica holds it). Nothing changes while no class sheds: under load the cluster
can carry, every request is queued as before. `window_s` 0 and `pressure` 0 turn the rule off.

Trade-off (measured in docs/scale.md): under sustained overload the adapters that are rarely used
(the tail of the popularity curve) get more of their class's 429s than the popular ones, as with a
cost-aware admission; their requests of the most urgent class are still served.
Pure: injected clock; O(classes) state, O(1) per checked ticket (the view's holders index).
"""

from __future__ import annotations

from collections.abc import Callable

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.errors import ColdAdapterShedError


class ColdShedding:
    """Remembers when each class last shed a request (deadline or wait bound); refuses cold requests of a
    class while it sheds or is under pressure (`refuses`, then `error`)."""

    def __init__(self, window_s: float, clock: Callable[[], float], pressure: float = 0.0,
                 no_target_bound_s: float | None = None):
        self.window_s, self._clock = window_s, clock
        self.pressure = pressure
        self.no_target_bound_s = no_target_bound_s  # the bound of a class without a TTFT target
        self._shed_at: dict[int, float] = {}  # priority -> last deadline refusal (one per SLA class)

    def record(self, priority: int) -> None:
        """A request of `priority` was refused because its deadline was out of reach, or (a class
        without a TTFT target) because its class is over its wait bound."""
        self._shed_at[priority] = self._clock()

    def shedding(self, priority: int) -> bool:
        """The class of `priority` refused a request for its deadline within the window."""
        at = self._shed_at.get(priority)
        return self.window_s > 0 and at is not None and self._clock() - at < self.window_s

    def shed_until(self, priority: int) -> float:
        """When the class of `priority` stops shedding unless it refuses again (-inf: not shedding)."""
        at = self._shed_at.get(priority)
        return at + self.window_s if self.window_s > 0 and at is not None else float("-inf")

    def under_pressure(self, ticket: Ticket, predicted_wait_s: float | None) -> bool:
        """A request of `ticket`'s class parked now would wait more than `pressure` times its bound."""
        bound = ticket.ttft_s if ticket.ttft_s is not None else self.no_target_bound_s
        return (self.pressure > 0 and bound is not None and predicted_wait_s is not None
                and predicted_wait_s > self.pressure * bound)

    def refuses(self, ticket: Ticket, view: ClusterView, top_priority: int | None,
                predicted_wait_s: Callable[[], float | None] = lambda: None) -> bool:
        """`ticket` should be refused now: no replica holds its adapter and its class sheds load (a
        recent refusal, or the queue's predicted wait for it under pressure: `predicted_wait_s()`,
        asked only for a cold adapter of a class not shedding already)."""
        if ticket.adapter_id is None or ticket.priority == top_priority or view.holders(ticket.adapter_id):
            return False
        return self.shedding(ticket.priority) or self.under_pressure(ticket, predicted_wait_s())

    def error(self, ticket: Ticket, retry_after_s: float | None) -> ColdAdapterShedError:
        """The refusal of a ticket that `refuses` names: which class, which adapter, which setting."""
        return ColdAdapterShedError(
            f"the {ticket.sla_class} class is over capacity and adapter {ticket.adapter_id!r} is loaded on "
            f"no replica: while a class sheds load, its requests that need their adapter loaded are refused "
            f"first (cold_shed_window_s, cold_shed_pressure)",
            retry_after_s=max(1.0, self.window_s, retry_after_s or 0.0),
        )


__all__ = ["ColdShedding"]

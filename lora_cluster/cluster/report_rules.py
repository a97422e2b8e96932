"""What a replica reports to the cluster controller, and when (pure rules, shared by the live replica
and the simulator).

* When (`ReportPacer`): a report period after the previous report, and at once when a request
  finishes while the controller said tickets are queued or while the replica was full
  (`report_on_finish`), unless a report went out within the coalescing window: then at the window's
  end, one report for every finish inside it. Two reports are at least min(window, period) apart,
  so a replica reports at most 1 / min(window, period) times a second however fast its requests end.
* As the cluster grows (`ReportPacer.pace`): every replica's reports reach one controller (each
  shard takes every round), whose event loop pays a call's overhead per report. With a budget of
  `budget_per_s` reports a second (`controller_report_budget_per_s`) and `replicas` replicas (the
  controller's last reply says how many it sees), the window and the period are each at least
  `replicas / budget_per_s` (`report_spacing_s`), so the reports a controller takes stay under the
  budget however many replicas report; under that size the configured window and period hold. A
  freed slot still reaches the queue within one window, and the admission window
  (`AdmissionWindow`) grows to cover the longer round trip.
* What, beyond the engine's counts: requests per adapter since the last report (`AdapterDemand`,
  bounded to `MAX_TRACKED_ADAPTERS` ids), the mean time a request held the replica (`ServiceTime`,
  an exponentially weighted average), and the batch per priority once the engine has admitted and
  preempted for its waiting requests (`projected_batch`): the controller reads it as the work a
  preemption there can still free.
* Prefetches: a replica runs at most `MAX_PREFETCHES` adapter prefetches (placement) at once.
* How much it takes: its admission capacity plus its `AdmissionWindow`, the requests it is given
  beyond its batch slots while the cluster queue holds tickets, sized at run time to the round trip
  of a freed slot's grant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import ClassVar

from lora_cluster.cluster.reports import MAX_REPORTED_ADAPTERS

MAX_PREFETCHES = 4  # adapter prefetches (placement) in flight at once on one replica
MAX_TRACKED_ADAPTERS = 4 * MAX_REPORTED_ADAPTERS


def report_on_finish(queue_depth: int, ongoing_before: int, capacity: int) -> bool:
    """Whether a replica reports at once when one of its requests finishes: the controller's last
    reply said tickets were queued (`queue_depth`), or the replica was full before it finished
    (`ongoing_before` >= `capacity`), so that a ticket parked since that reply is granted the freed
    slot now rather than a report period later. A replica with room reports on its period only."""
    return queue_depth > 0 or ongoing_before >= capacity


def report_spacing_s(replicas: int, budget_per_s: float) -> float:
    """The shortest time between two reports of one replica that keeps `replicas` replicas within
    `budget_per_s` reports a second to one controller (0: no budget, no spacing)."""
    return max(0, replicas) / budget_per_s if budget_per_s > 0 else 0.0


class ReportPacer:
    """When a replica sends its next report (see the module docstring): `periodic_at` on its period,
    `finish_at` for a finish `report_on_finish` tells. `sent` records each report; `pace` the
    controller's count of replicas. Invariants: two reports of which the later was due to a finish are
    at least `coalesce_s` apart; `coalesce_s` and `period_s` are the configured ones or
    `report_spacing_s(replicas, budget_per_s)`, whichever is longer."""

    def __init__(self, *, period_s: float, coalesce_s: float, clock: Callable[[], float],
                 budget_per_s: float = 0.0):
        self.base_period_s, self.base_coalesce_s, self._clock = period_s, coalesce_s, clock
        self.period_s, self.coalesce_s = period_s, coalesce_s
        self.budget_per_s = budget_per_s
        self.last = -float("inf")

    def pace(self, replicas: int) -> None:
        """The controller sees `replicas` replicas: stretch the window and the period to the budget."""
        spacing = report_spacing_s(replicas, self.budget_per_s)
        self.period_s = max(self.base_period_s, spacing)
        self.coalesce_s = max(self.base_coalesce_s, spacing)

    def sent(self) -> None:
        self.last = self._clock()

    def periodic_at(self) -> float:
        """When the next report is due if no finish asks for one sooner."""
        return self.last + self.period_s

    def finish_at(self) -> float:
        """When to report a finish: now, or at the end of the window the last report opened (finishes
        until then share that report)."""
        return max(self._clock(), self.last + self.coalesce_s)


class AdapterDemand:
    """Requests per adapter since the last report, bounded (ids beyond the bound are not counted)."""

    def __init__(self, max_adapters: int = MAX_TRACKED_ADAPTERS):
        self.max_adapters = max_adapters
        self._counts: Counter[str] = Counter()

    def record(self, adapter_id: str | None) -> None:
        if adapter_id is not None and (adapter_id in self._counts or len(self._counts) < self.max_adapters):
            self._counts[adapter_id] += 1

    def forget(self, adapter_id: str | None) -> None:
        """Take back one request `record` counted for `adapter_id` (one no source has: counted, it would
        draw prefetches and placement to a name, and take a place under the bound from a real adapter)."""
        if adapter_id is not None and adapter_id in self._counts:
            self._counts[adapter_id] -= 1
            if self._counts[adapter_id] <= 0:
                del self._counts[adapter_id]

    def take(self) -> dict[str, int]:
        """The busiest adapters since the last call; resets the counts."""
        counts, self._counts = self._counts, Counter()
        return dict(counts.most_common(MAX_REPORTED_ADAPTERS))


class ServiceTime:
    """Mean seconds a request holds the replica (EWMA over recent requests)."""

    def __init__(self, weight: float = 0.05):
        self.weight = weight
        self.mean: float | None = None

    def record(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else (1 - self.weight) * self.mean + self.weight * seconds


def projected_batch(running: dict[int, int], waiting: dict[int, int], slots: int) -> dict[int, int]:
    """Priority -> requests among the `slots` most urgent of the running and waiting ones (running
    first within a priority): the batch once the engine has admitted and preempted for the waiting."""
    batch: dict[int, int] = {}
    left = slots
    for priority in sorted(running.keys() | waiting.keys()):
        n = min(left, running.get(priority, 0) + waiting.get(priority, 0))
        if n:
            batch[priority] = n
        left -= n
    return batch


def window_limit(configured: int | None, max_ongoing_requests: int, capacity: int) -> int:
    """The largest admission window: `configured` (None: no bound of its own), never beyond what the
    replica accepts at once (`max_ongoing_requests`) less its admission capacity."""
    room = max(0, max_ongoing_requests - capacity)
    return room if configured is None else min(configured, room)


class AdmissionWindow:
    """Requests a replica is given beyond its admission capacity while the cluster queue holds
    tickets, so that a slot a finishing request frees finds the next request already waiting in the
    engine instead of idling through the report -> grant -> send round trip.

    The window is that round trip's bandwidth-delay product, found by feedback rather than by clocks
    (one rule on both sides, the live replica per engine step and the simulator per planned step):

    * a step that runs with a free batch seat, nothing waiting in the engine and tickets queued in the
      cluster, after `IDLE_STEPS` - 1 such steps in a row, grows the window by one: a seat idled for
      want of a request that was waiting elsewhere, longer than the two steps that even a prompt
      grant can cost (the finish is reported after the step that ends it, and the granted request
      joins the batch at a step boundary);
    * a step with no free seat and at least `SURPLUS` requests waiting in the engine shrinks it by
      one, at most once every `SHRINK_EVERY` such steps (the window outgrew the round trip);
    * steps without queued tickets change nothing (a replica with room takes requests by the fast
      path, whatever the window).

    Invariant: 0 <= `extra` <= `limit` (`limit` 0: no window). The engine still runs its requests in
    priority order, so a request waiting in the window is overtaken by a more urgent one that arrives.
    `observe` runs on the engine's thread, `extra` is read from the event loop: one int, replaced whole.
    """

    IDLE_STEPS: ClassVar[int] = 3  # class constants (ClassVar: compiled, still read on the class)
    SURPLUS: ClassVar[int] = 2
    SHRINK_EVERY: ClassVar[int] = 8

    def __init__(self, limit: int):
        self.limit = max(0, limit)
        self.extra = 0
        self._idle_steps = self._surplus_steps = 0

    def observe(self, *, free_seats: int, waiting: int, tickets_queued: bool) -> None:
        """One engine step: `free_seats` batch seats left free after admission, `waiting` requests
        the engine holds unadmitted, `tickets_queued` whether the controller last said the cluster
        queue holds tickets."""
        if not tickets_queued:
            self._idle_steps = 0
            return
        if free_seats > 0 and waiting == 0:
            self._idle_steps += 1
            self._surplus_steps = 0
            if self._idle_steps >= self.IDLE_STEPS:
                self.extra = min(self.limit, self.extra + 1)
            return
        self._idle_steps = 0
        if free_seats == 0 and waiting >= self.SURPLUS:
            self._surplus_steps += 1
            if self._surplus_steps >= self.SHRINK_EVERY:
                self._surplus_steps = 0
                self.extra = max(0, self.extra - 1)

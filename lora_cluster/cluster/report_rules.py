"""What a replica reports to the cluster controller, and when (pure rules, shared by the live replica
and the simulator).

* When: every report period, and at once when a request finishes while the controller said tickets
  are queued or while the replica was full (`report_on_finish`), at most every `MIN_GAP_S`.
* What, beyond the engine's counts: requests per adapter since the last report (`AdapterDemand`,
  bounded to `MAX_TRACKED_ADAPTERS` ids), the mean time a request held the replica (`ServiceTime`,
  an exponentially weighted average), and the batch per priority once the engine has admitted and
  preempted for its waiting requests (`projected_batch`): the controller reads it as the work a
  preemption there can still free.
* Prefetches: a replica runs at most `MAX_PREFETCHES` adapter prefetches (placement) at once.
"""

from __future__ import annotations

from collections import Counter

from lora_cluster.cluster.reports import MAX_REPORTED_ADAPTERS

MAX_PREFETCHES = 4  # adapter prefetches (placement) in flight at once on one replica
MIN_GAP_S = 0.02  # reports triggered by finishing requests are at least this far apart
MAX_TRACKED_ADAPTERS = 4 * MAX_REPORTED_ADAPTERS


def report_on_finish(queue_depth: int, ongoing_before: int, capacity: int) -> bool:
    """Whether a replica reports at once when one of its requests finishes: the controller's last
    reply said tickets were queued (`queue_depth`), or the replica was full before it finished
    (`ongoing_before` >= `capacity`), so that a ticket parked since that reply is granted the freed
    slot now rather than a report period later. A replica with room reports on its period only."""
    return queue_depth > 0 or ongoing_before >= capacity


class AdapterDemand:
    """Requests per adapter since the last report, bounded (ids beyond the bound are not counted)."""

    def __init__(self, max_adapters: int = MAX_TRACKED_ADAPTERS):
        self.max_adapters = max_adapters
        self._counts: Counter[str] = Counter()

    def record(self, adapter_id: str | None) -> None:
        if adapter_id is not None and (adapter_id in self._counts or len(self._counts) < self.max_adapters):
            self._counts[adapter_id] += 1

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

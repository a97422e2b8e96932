"""The cluster-wide priority queue: requests that no replica can take now, as tickets.

A ticket stands for one request parked by an ingress (the request's body stays with the ingress).
Order: tickets of the most urgent class (`top_priority`) first, then the others by *urgency* =
priority - waited / aging_s (lower first: `standard` before `batch`), then by deadline, then by
arrival. Aging makes a ticket one priority level more urgent per `aging_s` seconds of waiting, so
`batch` does not starve behind `standard`: a `batch` ticket that waited aging_s ranks with a fresh
`standard` one. Aging never lifts a ticket above the most urgent class, so under sustained overload
an old `batch` request never delays a fresh `interactive` one (the other classes absorb the delay;
they wait only as long as the most urgent class alone fills the cluster, which the deadline check
below keeps to what the replicas can serve). Because every ticket ages at the same rate, the order
never changes while tickets wait: the key (tier, `priority + enqueued_at / aging_s`) is fixed at
park time and a heap keeps the order; a sorted list of the same keys counts the tickets ahead of a
new one in O(log n).

Admission: a full queue (`max_size`) refuses a ticket, unless its least urgent ticket is strictly
less urgent than the new one: that one is bumped (its request refused) to make room. A deadline
that cannot be met is refused too, when the predicted wait (tickets at least as urgent ahead of
it, divided by the drain rate) would end past it and the caller says nothing else can serve it in
time (`deadline_at_risk`: the controller passes False when the ticket could preempt less urgent
running work, or that work is claimed by preempting grants ahead of it: `scheduling.will_preempt`).
The drain rate is the larger
of the measured one (grants over a window) and the one the caller expects from capacity (replicas'
batch slots over their service time). Both refusals carry a retry-after estimate.

Bounded wait for classes without a TTFT target (`batch`): aging lets them pass fresh requests of
the classes above, but not the most urgent one, and under a load the replicas do not carry (the
rated load already: adapter loads and recomputes make the real capacity short of it) their backlog
grows and so does their wait. Two rules bound it by `wait_bound_s` (`cluster_queue_max_wait_s`):

* admission: a new ticket of such a class is refused at once (`WaitBoundError`, 429 with
  Retry-After) when the oldest queued ticket of its class has already waited `ADMIT_WAIT_SHARE`
  of the bound, or when its class's queued tickets would take that long to leave at the rate its
  tickets were granted over the drain window (`class_granted`); the class's tickets leave in
  about arrival order, so the admitted ones stay under the bound;
* starvation guard: a ticket of such a class that has waited `OVERDUE_SHARE` of the bound is
  `overdue` and takes the next room before any other ticket (the most urgent class still preempts
  it on its replica); the rest of the bound is the wait for a slot to free somewhere.

Above the load the replicas carry, the class is thus refused early with a retry-after rather than
queued for minutes; below it, nothing is refused and its wait stays under the bound. Pure:
injected clock, no Ray.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lora_cluster.errors import (
    ClusterOverloadedError,
    DeadlineOutOfReachError,
    QueueFullError,
    RequestError,
    WaitBoundError,
)

ADMIT_WAIT_SHARE = 0.5  # of the wait bound: a class without a TTFT target admits while its backlog waits less
OVERDUE_SHARE = 0.75  # of the wait bound: such a ticket then goes first (the rest is left for a slot to free)


@dataclass(frozen=True)
class Ticket:
    ticket_id: str
    ingress_id: str
    sla_class: str
    priority: int
    adapter_id: str | None
    enqueued_at: float
    deadline: float | None = None  # latest start that meets the class's TTFT target (None: no target)
    ttft_s: float | None = None  # the class's TTFT target
    prefix: tuple[str, ...] = ()  # routing keys of its prompt's prefix (`prefix_keys.routing_keys`)

    def __reduce__(self) -> tuple[type[Ticket], tuple[Any, ...]]:
        """Pickled as a call of the class with its fields: compiled, a frozen class cannot be unpickled
        field by field (`lora_cluster.compiled`), and a ticket crosses from the ingress to the controller."""
        return (Ticket, (self.ticket_id, self.ingress_id, self.sla_class, self.priority, self.adapter_id,
                         self.enqueued_at, self.deadline, self.ttft_s, self.prefix))


Key = tuple[int, float, float, float, int]  # tier, priority + enqueued / aging, deadline, arrival, seq


class _Entry:
    """A queued ticket, its key, and whether it left (heap order: the key's tier, urgency, then the rest)."""

    def __init__(self, key: Key, ticket: Ticket):
        self.key, self.ticket, self.removed, self.tier, self.urgency = key, ticket, False, key[0], key[1]

    def __lt__(self, other: _Entry) -> bool:  # the key's head compared as plain numbers, compiled
        if self.tier != other.tier:
            return self.tier < other.tier
        return self.urgency < other.urgency if self.urgency != other.urgency else self.key < other.key


DRAIN_HEAD = 32  # the oldest drain events an edge state carries (`DrainMeter.head`)


def drain_rate(count: int, first: float, now: float, window_s: float) -> float:
    """The drain meter's rate: `count` events in the window, the oldest at `first`, over the time
    since then but at least a quarter of the window. One formula for the controller and the edge."""
    return count / max(now - first, window_s / 4)


def full_retry_after_s(queued: int, rate: float | None) -> float:
    """The retry-after of a refusal by the full queue of `queued` tickets at drain `rate` (None: no
    drain measured): the time the queue takes to drain, at least 1 s. One formula for the
    controller and the edge."""
    return 1.0 if not rate else max(1.0, queued / rate)


class DrainMeter:
    """Requests that left the queue's way per second (grants, or capacity freed), over a window."""

    def __init__(self, window_s: float, clock: Callable[[], float]):
        self.window_s, self._clock = window_s, clock
        self._times: deque[float] = deque(maxlen=100_000)  # bounded whatever the rate: the oldest go

    def record(self, n: int = 1) -> None:
        self._times.extend([now := self._clock()] * n)
        self._prune(now)

    def rate(self) -> float | None:
        """Events per second over the window; None until the window has seen any."""
        self._prune(now := self._clock())
        if not self._times:
            return None
        return drain_rate(len(self._times), self._times[0], now, self.window_s)

    def head(self, horizon_s: float, limit: int = DRAIN_HEAD) -> tuple[int, tuple[float, ...]]:
        """(the events in the window now, the oldest event times): those that leave the window within
        `horizon_s` from now, then the first that stays, at most `limit` of them. With them a reader
        computes `rate` at any moment of the next `horizon_s` as this meter would, while no event is
        recorded (`cluster.edge.DrainEdge`). O(limit)."""
        now = self._clock()
        self._prune(now)
        cut = now + horizon_s - self.window_s  # an event before it leaves the window within horizon_s
        head: list[float] = []
        for t in self._times:
            if len(head) >= limit:
                break
            head.append(t)
            if t >= cut:
                break
        return len(self._times), tuple(head)

    def _prune(self, now: float) -> None:
        """Drop the events older than the window: O(dropped), from the left."""
        times, window = self._times, self.window_s
        while times and now - times[0] > window:
            times.popleft()


class ClusterQueue:
    """Tickets by urgency (see the module docstring). Bounded by `max_size`."""

    def __init__(self, *, max_size: int, aging_s: float, clock: Callable[[], float],
                 drain_window_s: float = 10.0, top_priority: int | None = None,
                 wait_bound_s: float | None = None):
        """`top_priority`: the most urgent class's priority; its tickets are never overtaken by aged
        ones (None: plain aging across every class). `wait_bound_s`: the longest wait of a ticket
        without a TTFT target (None: unbounded; see the module docstring)."""
        if max_size < 1 or aging_s <= 0 or (wait_bound_s is not None and wait_bound_s <= 0):
            raise RequestError(f"cluster queue: max_size {max_size}, aging_s {aging_s} and wait_bound_s "
                               f"{wait_bound_s} must be positive")
        self.max_size, self.aging_s, self._clock = max_size, aging_s, clock
        self.top_priority, self.wait_bound_s = top_priority, wait_bound_s
        # priority -> heap of (enqueued_at, seq, entry) of the classes without a TTFT target (lazy removal)
        self._untargeted: dict[int, list[tuple[float, int, _Entry]]] = {}
        self._untargeted_count: dict[int, int] = {}  # queued tickets of those classes
        self._class_drain: dict[int, DrainMeter] = {}  # their grants per second
        self._heap: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}
        self._ranks: list[tuple[int, float, int, str]] = []  # (tier, urgency key, seq, id), sorted
        # (adapter, priority) -> heap of its entries, removed ones dropped lazily (see `best_for`)
        self._by_adapter: dict[tuple[str | None, int], list[_Entry]] = {}
        self._indexed = 0  # entries in `_by_adapter`, removed ones included
        # priority -> the adapters with a queued ticket of it (exact), from the queued count of each
        self._adapters: dict[int, set[str | None]] = {}
        self._queued: dict[tuple[str | None, int], int] = {}  # queued tickets per (adapter, priority)
        self._seq = itertools.count()
        self.drain = DrainMeter(drain_window_s, clock)

    def _rank(self, ticket: Ticket) -> tuple[int, float]:
        return self.rank_of(ticket.priority, ticket.enqueued_at)

    def rank_of(self, priority: int, enqueued_at: float) -> tuple[int, float]:
        """A ticket's rank from its priority and enqueue time: (tier, priority + enqueued / aging_s)."""
        tier = 0 if self.top_priority is not None and priority <= self.top_priority else 1
        return tier, priority + enqueued_at / self.aging_s

    def key(self, ticket: Ticket) -> Key:
        deadline = ticket.deadline if ticket.deadline is not None else math.inf
        return (*self._rank(ticket), deadline, ticket.enqueued_at, next(self._seq))

    def sort_key(self, ticket_id: str) -> Key | None:
        """The queue's order of a queued ticket (None: not queued): sort by it to go most urgent first."""
        entry = self._entries.get(ticket_id)
        return None if entry is None else entry.key

    def urgency(self, ticket: Ticket, now: float | None = None) -> float:
        """priority - waited / aging_s (lower is more urgent)."""
        now = self._clock() if now is None else now
        return ticket.priority - (now - ticket.enqueued_at) / self.aging_s

    def predicted_wait_s(self, ticket: Ticket, expected_rate: float | None = None) -> float | None:
        """Seconds until `ticket` would leave the queue, if it were parked now (None: no estimate yet).
        `expected_rate`: requests per second the replicas should complete (their slots / service time)."""
        rates = [r for r in (self.drain.rate(), expected_rate) if r]
        return self.wait_at(self._rank(ticket), max(rates)) if rates else None

    def wait_at(self, rank: tuple[int, float], rate: float) -> float:
        """Seconds until a ticket of queue rank `rank` would leave, at `rate` (> 0) requests per second."""
        ahead = bisect.bisect_right(self._ranks, (*rank, math.inf))
        return (ahead + 1) / rate

    def park(self, ticket: Ticket, *, deadline_at_risk: bool | Callable[[], bool] = True,
             expected_rate: float | None = None, max_wait_s: float | None = None) -> Ticket | None:
        """Queue `ticket`. A full queue makes room by bumping its least urgent ticket when that one
        is strictly less urgent than `ticket` (returned: its request is refused, so that an urgent
        request never waits behind a full queue of less urgent ones); otherwise raises
        ClusterOverloadedError, as it does when the deadline cannot be met and `deadline_at_risk`
        (see the module docstring; a callable is asked only past the full queue's refusal, where
        the answer is needed). `max_wait_s` (the ingress's queue timeout): a ticket without a
        deadline is refused at once when its predicted wait is longer, rather than timing out later."""
        if ticket.ticket_id in self._entries:
            raise RequestError(f"ticket {ticket.ticket_id!r} is already queued")
        bump = None
        if len(self._entries) >= self.max_size:
            if self._ranks and self._ranks[-1][:2] > self._rank(ticket):
                bump = self._entries[self._ranks[-1][3]].ticket
            else:
                raise QueueFullError(
                    f"the cluster queue is full ({self.max_size} requests wait; cluster_queue_size)",
                    retry_after_s=self._retry_after(len(self._entries)),
                )
        now = self._clock()
        at_risk = deadline_at_risk() if callable(deadline_at_risk) else deadline_at_risk
        wait = self.predicted_wait_s(ticket, expected_rate) if at_risk else None
        if ticket.deadline is not None and wait is not None and now + wait > ticket.deadline:
            raise DeadlineOutOfReachError(
                f"the {ticket.sla_class} class's time-to-first-token target of {ticket.ttft_s:g} s cannot be "
                f"met: about {wait:.1f} s of queued work is ahead",
                retry_after_s=wait,
            )
        if ticket.ttft_s is None and self.wait_bound_s is not None:
            self._check_wait_bound(ticket, now)
        if ticket.deadline is None and wait is not None and max_wait_s is not None and wait > max_wait_s:
            raise ClusterOverloadedError(
                f"about {wait:.0f} s of queued work is ahead of this {ticket.sla_class} request, more than "
                f"the queue timeout of {max_wait_s:g} s (cluster_queue_timeout_s)",
                retry_after_s=wait - max_wait_s,
            )
        if bump is not None:
            self.remove(bump.ticket_id)
        entry = _Entry(self.key(ticket), ticket)
        self._entries[ticket.ticket_id] = entry
        heapq.heappush(self._heap, entry)
        heapq.heappush(self._by_adapter.setdefault((ticket.adapter_id, ticket.priority), []), entry)
        self._indexed += 1
        self._count(ticket, 1)
        bisect.insort(self._ranks, (*entry.key[:2], entry.key[4], ticket.ticket_id))
        if ticket.ttft_s is None:
            heapq.heappush(self._untargeted.setdefault(ticket.priority, []),
                           (ticket.enqueued_at, entry.key[4], entry))
            self._untargeted_count[ticket.priority] = self._untargeted_count.get(ticket.priority, 0) + 1
        return bump

    def class_granted(self, ticket: Ticket) -> None:
        """`ticket` left the queue for a replica: counts towards its class's drain rate (classes
        without a TTFT target only; see `_check_wait_bound`)."""
        if ticket.ttft_s is None:
            meter = self._class_drain.get(ticket.priority)
            if meter is None:  # one per SLA class: bounded
                meter = self._class_drain[ticket.priority] = DrainMeter(self.drain.window_s, self._clock)
            meter.record()

    def _check_wait_bound(self, ticket: Ticket, now: float) -> None:
        """Refuse `ticket` (no TTFT target) while its class's queued tickets already wait the admission
        share of the bound: the oldest has waited that long, or the class's backlog (with `ticket`)
        would take that long to leave at the class's grant rate over the drain window."""
        oldest = self.oldest(ticket.priority)
        bound = self.wait_bound_s
        if oldest is None or bound is None:
            return
        waited = now - oldest.enqueued_at
        meter = self._class_drain.get(ticket.priority)
        rate = meter.rate() if meter is not None else None
        backlog = (self._untargeted_count.get(ticket.priority, 0) + 1) / rate if rate else 0.0
        wait = max(waited, backlog)
        if wait >= ADMIT_WAIT_SHARE * bound:
            raise WaitBoundError(
                f"the {ticket.sla_class} class's queued requests already wait about {wait:.0f} s for a "
                f"replica; its wait is bounded at {bound:g} s (cluster_queue_max_wait_s), so more of them "
                f"are refused until the backlog drains",
                retry_after_s=max(1.0, min(wait, bound) - ADMIT_WAIT_SHARE * bound))

    def oldest(self, priority: int) -> Ticket | None:
        """The longest-waiting queued ticket of `priority`, a class without a TTFT target (None: none)."""
        heap = self._untargeted.get(priority)
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        if not heap:
            self._untargeted.pop(priority, None)
            return None
        return heap[0][2].ticket

    def overdue(self, now: float | None = None) -> Ticket | None:
        """The longest-waiting ticket without a TTFT target that has waited `OVERDUE_SHARE` of
        `wait_bound_s` or more: it goes before every other ticket (None: none, or no bound).
        O(classes) amortized."""
        if self.wait_bound_s is None:
            return None
        now = self._clock() if now is None else now
        found = [t for p in list(self._untargeted) if (t := self.oldest(p)) is not None
                 and now - t.enqueued_at >= OVERDUE_SHARE * self.wait_bound_s]
        return min(found, key=lambda t: (t.enqueued_at, t.priority), default=None)

    def bumped_error(self, ticket: Ticket) -> ClusterOverloadedError:
        """The refusal of a ticket bumped out of the full queue by a more urgent one."""
        return ClusterOverloadedError(
            f"the cluster queue is full ({self.max_size} requests wait; cluster_queue_size) and more "
            f"urgent requests than this {ticket.sla_class} one took its place",
            retry_after_s=self._retry_after(len(self._entries)))

    def least_rank(self) -> tuple[int, float] | None:
        """The least urgent queued ticket's rank (None: empty): a full queue bumps it for a ticket
        that ranks strictly lower (published for refusals at the edge, `cluster.edge`)."""
        return (self._ranks[-1][0], self._ranks[-1][1]) if self._ranks else None

    def _retry_after(self, ahead: int) -> float:
        return full_retry_after_s(ahead, self.drain.rate())

    def remove(self, ticket_id: str) -> Ticket | None:
        """Take a ticket out (granted elsewhere, or its request went away)."""
        entry = self._entries.pop(ticket_id, None)
        if entry is None:
            return None
        entry.removed = True
        ticket = entry.ticket
        if ticket.ttft_s is None:
            self._untargeted_count[ticket.priority] = self._untargeted_count.get(ticket.priority, 0) - 1
        self._count(ticket, -1)
        key = (ticket.adapter_id, ticket.priority)
        heap = self._by_adapter.get(key)
        if heap and heap[0] is entry:  # mostly the adapter's most urgent one goes: drop it now
            while heap and heap[0].removed:
                heapq.heappop(heap)
                self._indexed -= 1
            if not heap:
                del self._by_adapter[key]
        i = bisect.bisect_left(self._ranks, (*entry.key[:2], entry.key[4], ticket_id))
        del self._ranks[i]
        self._compact()
        return entry.ticket

    def peek(self) -> Ticket | None:
        """The most urgent ticket (None: empty)."""
        while self._heap and self._heap[0].removed:
            heapq.heappop(self._heap)
        return self._heap[0].ticket if self._heap else None

    def pop(self) -> Ticket | None:
        """Take the most urgent ticket."""
        ticket = self.peek()
        return None if ticket is None else self.remove(ticket.ticket_id)

    def _count(self, ticket: Ticket, n: int) -> None:
        """`queued_adapters` follows a ticket parked (n = 1) or gone (n = -1)."""
        key = (ticket.adapter_id, ticket.priority)
        left = self._queued[key] = self._queued.get(key, 0) + n
        if left == 0:
            del self._queued[key]
            self._adapters[ticket.priority].discard(ticket.adapter_id)
        elif left == n:
            self._adapters.setdefault(ticket.priority, set()).add(ticket.adapter_id)

    def queued_adapters(self, priority: int) -> set[str | None]:
        """The adapters with a queued ticket of `priority` (read-only; kept with every park and
        removal), so that a look for the tickets some replica's adapters could take costs O(the
        adapters in both), not a `best_for` per adapter."""
        return self._adapters.get(priority) or set()

    def best_for(self, adapter_id: str | None, priority: int) -> Ticket | None:
        """The most urgent queued ticket of `priority` for `adapter_id` (None: none), in O(log n)
        amortized: each (adapter, priority) keeps a heap of its entries."""
        key = (adapter_id, priority)
        heap = self._by_adapter.get(key)
        while heap and heap[0].removed:
            heapq.heappop(heap)
            self._indexed -= 1
        if not heap:
            self._by_adapter.pop(key, None)
            return None
        return heap[0].ticket

    def first(self, n: int) -> list[Ticket]:
        """The `n` most urgent tickets, most urgent first: a best-first walk down the heap's tree,
        O((n + removed entries met) log n), not O(size)."""
        heap = self._heap
        out: list[Ticket] = []
        frontier = [(heap[0], 0)] if heap else []
        while frontier and len(out) < n:
            entry, i = heapq.heappop(frontier)
            if not entry.removed:
                out.append(entry.ticket)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return out

    def in_order(self) -> Iterator[Ticket]:
        """Tickets from the most urgent (a sorted copy: O(n log n); for grants across replicas)."""
        for entry in sorted(e for e in self._heap if not e.removed):
            yield entry.ticket

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [e for e in self._heap if not e.removed]
            heapq.heapify(self._heap)
        if self._indexed > 2 * len(self._entries) + 64:  # bounded: rebuilt from the live entries
            self._by_adapter = {}
            for entry in self._entries.values():
                t = entry.ticket
                self._by_adapter.setdefault((t.adapter_id, t.priority), []).append(entry)
            for heap in self._by_adapter.values():
                heapq.heapify(heap)
            self._indexed = len(self._entries)
        for fifo in self._untargeted.values():  # bounded: removed entries dropped
            if len(fifo) > 2 * len(self._entries) + 64:
                fifo[:] = [e for e in fifo if not e[2].removed]
                heapq.heapify(fifo)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ticket_id: object) -> bool:
        return ticket_id in self._entries

    def depth_by_class(self) -> dict[str, int]:
        return dict(Counter(e.ticket.sla_class for e in self._entries.values()))

    def oldest_wait_s(self) -> float:
        return max((self._clock() - e.ticket.enqueued_at for e in self._entries.values()), default=0.0)

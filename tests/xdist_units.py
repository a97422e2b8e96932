"""How pytest-xdist hands this suite to its workers (conftest's `pytest_xdist_make_scheduler`, under
pyproject's `-n 2 --dist loadfile`): each module is one unit of work, sent whole to one worker (its
module-scoped fixtures built once), and the modules that start Ray are one unit together, queued
first: one worker runs them one after the other on one Ray, as without xdist (their order is
conftest's), while the other runs the other modules; the first to finish takes what is left. (Ray
last took longer: the Ray unit, the longest, then starts only once the rest is nearly done.)

A unit is a list of collection indices, not node ids: schemathesis's items (one per API operation)
share one node id on pytest 9, and xdist's own loadfile schedulers, which key work by node id, run
only the first of them. (xdist's `xdist_group` mark does not take on pytest 9 either: xdist 3.8
writes the group into `Item._nodeid`, which pytest 9 no longer reads.) This module implements
xdist's `Scheduling` protocol (`xdist/scheduler/protocol.py`) with the semantics of its
`LoadScopeScheduling`; tests/test_xdist_units.py drives it with fake workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any


class ModuleUnits:
    """Units of `unit_of(node_id)`, `first` (if collected) then the others in collection order; a
    worker gets the next unit whenever it has at most two tests left (as `LoadScopeScheduling`),
    and is told to shut down once none is left."""

    def __init__(self, numnodes: int, log: Any, unit_of: Callable[[str], str], first: str | None = None):
        self.numnodes = numnodes  # the workers whose collections schedule waits for
        self._first = first
        self.log = log
        self.collection: list[str] | None = None
        self._unit_of = unit_of
        self._queue: deque[list[int]] = deque()
        self._pending: dict[Any, list[int]] = {}  # worker -> indices sent to it, not yet complete
        self._collections: dict[Any, list[str]] = {}

    @property
    def nodes(self) -> list[Any]:
        return list(self._pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self._collections) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        """A worker keeps its last test until it is told to shut down (it needs the next item)."""
        return (self.collection_is_completed and not self._queue
                and all(len(left) < 2 for left in self._pending.values()))

    @property
    def has_pending(self) -> bool:
        return bool(self._queue) or any(self._pending.values())

    def add_node(self, node: Any) -> None:
        self._pending[node] = []

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            from xdist.report import report_collection_diff

            first = next(iter(self._collections))
            self.log(report_collection_diff(self.collection, list(collection), first.gateway.id,
                                            node.gateway.id))
            return
        self._collections[node] = list(collection)

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        self._pending[node].remove(item_index)
        self._reschedule(node)

    def mark_test_pending(self, item: str) -> None:
        raise NotImplementedError

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        raise NotImplementedError

    def remove_node(self, node: Any) -> str | None:
        """A worker went down: the test it was running is the crashed one (returned); the tests sent
        after it go back to the front of the queue, for the other workers."""
        left = self._pending.pop(node)
        if not left:
            return None
        assert self.collection is not None
        if left[1:]:
            self._queue.appendleft(left[1:])
        for other in self._pending:
            self._reschedule(other)
        return self.collection[left[0]]

    def schedule(self) -> None:
        if self.collection is not None:  # a worker added later
            for node in self.nodes:
                self._reschedule(node)
            return
        collections = list(self._collections.values())
        if any(c != collections[0] for c in collections[1:]):
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = collections[0]
        units: dict[str, list[int]] = {}
        for index, node_id in enumerate(self.collection):
            units.setdefault(self._unit_of(node_id), []).append(index)
        if self._first in units:
            self._queue.append(units.pop(self._first))
        self._queue.extend(units.values())
        for node in self.nodes[len(self._queue):]:  # more workers than units
            del self._pending[node]
            node.shutdown()
        for node in self.nodes:
            self._assign(node)
        for node in self.nodes:
            self._reschedule(node)

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if not self._queue:
            node.shutdown()
        elif len(self._pending[node]) <= 2:
            self._assign(node)

    def _assign(self, node: Any) -> None:
        if self._queue:
            unit = self._queue.popleft()
            self._pending[node].extend(unit)
            node.send_runtest_some(unit)

"""Recent demand per adapter: which adapters are worth keeping on the device (pure; injected clock).

An adapter has *repeated demand* when at least `REPEATED` of its requests arrived within the last
`window_s` seconds; a *one-off* has fewer. Adapter protection (`residency`) uses it to choose:
idle one-offs are evicted before adapters with repeated demand, a one-off's cold load queues behind
repeated adapters' loads of the same priority, and a one-off does not evict an adapter with repeated
demand while a slot frees anyway within its class's hold bound.

Bounded: at most `max_adapters` adapters are tracked (the least recently requested is forgotten
first: its demand is the oldest anyway); each keeps at most `REPEATED` arrival times.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

REPEATED = 2  # requests within the window that make demand "repeated"


class DemandTracker:
    """Arrival times of each adapter's last requests (see the module docstring)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 max_adapters: int = 4096):
        self.window_s, self._clock, self.max_adapters = window_s, clock, max_adapters
        self._times: OrderedDict[str, deque[float]] = OrderedDict()  # least recently requested first

    def record(self, adapter_id: str) -> None:
        """A request for `adapter_id` arrived now."""
        times = self._times.get(adapter_id)
        if times is None:
            times = self._times[adapter_id] = deque(maxlen=REPEATED)
            while len(self._times) > self.max_adapters:
                self._times.popitem(last=False)
        else:
            self._times.move_to_end(adapter_id)
        times.append(self._clock())

    def recent(self, adapter_id: str) -> int:
        """Requests of the adapter within the window (counted up to `REPEATED`)."""
        times = self._times.get(adapter_id)
        if not times:
            return 0
        horizon = self._clock() - self.window_s
        return sum(1 for t in times if t > horizon)

    def repeated(self, adapter_id: str) -> bool:
        return self.recent(adapter_id) >= REPEATED

    def __len__(self) -> int:
        return len(self._times)


__all__ = ["REPEATED", "DemandTracker"]

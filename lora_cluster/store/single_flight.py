"""Single flight: concurrent calls for the same key share one execution and its outcome.

The first caller of `do(key, fn)` runs `fn`; callers arriving while it runs wait and receive the
same result or the same exception (`joined=True`). Once the flight lands, the key is free again,
so a failed load is retried by the next caller (failures are not cached).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[str, Future[T]] = {}
        self._lock = threading.Lock()

    def in_flight(self, key: str) -> bool:
        with self._lock:
            return key in self._flights

    def do(self, key: str, fn: Callable[[], T]) -> tuple[T, bool]:
        """(result, joined): joined is True when this call waited for another caller's flight."""
        with self._lock:
            future = self._flights.get(key)
            leader = future is None
            if leader:
                future = self._flights[key] = Future()
        if not leader:
            return future.result(), True
        try:
            result = fn()
        except BaseException as e:
            future.set_exception(e)
            raise
        else:
            future.set_result(result)
            return result, False
        finally:
            with self._lock:
                del self._flights[key]

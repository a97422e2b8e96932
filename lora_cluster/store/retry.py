"""Retries with exponential backoff and jitter for transient source errors.

Policy: `attempts = retries + 1`; before retry n (1-based) sleep `backoff_s * 2**(n-1)` times a
random factor in [0.5, 1.5). Only errors the caller classifies as transient are retried; anything
else propagates at once. After the last attempt the caller's `give_up(error, attempts)` builds the
domain error (naming the adapter and the last cause).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_delay(attempt: int, backoff_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1-based)."""
    return backoff_s * 2 ** (attempt - 1) * (0.5 + (rng or random).random())


def with_retries(
    fn: Callable[[], T],
    *,
    retries: int,
    backoff_s: float,
    is_transient: Callable[[BaseException], bool],
    give_up: Callable[[BaseException, int], Exception],
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[BaseException, int], None] = lambda error, attempt: None,
) -> T:
    attempts = retries + 1
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            if attempt == attempts:
                raise give_up(e, attempts) from e
            on_retry(e, attempt)
            sleep(backoff_delay(attempt, backoff_s))
    raise AssertionError("unreachable")

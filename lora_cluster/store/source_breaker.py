"""A circuit breaker around each remote adapter source (S3, hub): when it is down, fail fast.

Every network call of the store to a remote source (locating an adapter, downloading it) goes
through the source's `SourceBreaker`. The level it watches is the number of calls in a row that
failed for the source's sake: `AdapterLoadError` (network errors, 5xx and timeouts after the
source's own retries, refused credentials). A missing adapter or a refused file is an answer, so it
counts as a success.

* CLOSED / WARN (one failure or more): calls go through.
* OPEN after `breaker_source_failures` failures in a row: cold loads from this source fail at once
  with `AdapterSourceUnavailableError` (503 with Retry-After, naming the source by scheme and bucket
  or repository only: never credentials, endpoints or paths). Adapters already in the host or disk
  tier, or on the device, keep serving: they do not touch the source.
* HALF_OPEN after `breaker_source_cooldown_s`: one load probes the source (the others still fail
  fast); its success closes the breaker, its failure opens it again for another cool-down.

Thread-safe: the store's loader threads share a breaker (one lock per source).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from lora_cluster.breaker import Breaker, BreakerState, BreakerThresholds
from lora_cluster.errors import AdapterLoadError, AdapterSourceUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")


def public_name(uri: str) -> str:
    """A source's name fit for an error body: scheme and bucket (S3) or repository (hub), no
    prefix, revision, endpoint or credentials."""
    scheme, _, rest = uri.partition("://")
    parts = [p for p in rest.split("/") if p]
    keep = 2 if scheme == "hf" else 1
    name = "/".join(parts[:keep]).split("@")[0]
    return f"{scheme}://{name}"


class SourceBreaker:
    """The breaker of one remote source (see the module docstring)."""

    def __init__(self, uri: str, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.name = public_name(uri)
        self._breaker = Breaker(f"source {self.name}", BreakerThresholds(
            warn=1, trip=failures, recover_below=1, recover_samples=1, cooldown_s=cooldown_s), clock)
        self._failures = 0
        self._lock = threading.Lock()

    def call(self, adapter_id: str, fn: Callable[[], T]) -> T:
        """`fn()` if the breaker lets it through; raises AdapterSourceUnavailableError when open."""
        with self._lock:
            allowed = self._breaker.allow()
            retry_after = self._breaker.retry_after_s()
        if not allowed:
            raise AdapterSourceUnavailableError(adapter_id, self.name, max(1.0, retry_after))
        try:
            result = fn()
        except AdapterLoadError:
            self._settle(failed=True)
            raise
        except BaseException:
            self._settle(failed=False)  # the source answered (not found, refused file, ...)
            raise
        self._settle(failed=False)
        return result

    def _settle(self, *, failed: bool) -> None:
        with self._lock:
            before = self._breaker.state
            self._failures = self._failures + 1 if failed else 0
            after = self._breaker.record(self._failures)
        if after is not before:
            log.warning("adapter source %s: breaker %s -> %s (%d failures in a row)", self.name,
                        before.value, after.value, self._failures)

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._breaker.state

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return self._breaker.snapshot()

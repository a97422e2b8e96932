"""Circuit breakers: one pure state machine, and the signals that feed it.

A `Breaker` watches one measured *level* (a rate, a latency, an error ratio, a count of failures in
a row) against thresholds from the config, and is in one of four states:

* CLOSED: level below `warn`; everything passes.
* WARN: `warn` <= level < `trip`; everything still passes (the state is reported, so that an
  operator sees the pressure before the breaker acts).
* OPEN: the level reached `trip`; the protected action is refused (each user of a breaker decides
  what refusing means and documents it). A measurement at or above `trip` while open re-arms it.
  After `cooldown_s` the breaker turns HALF_OPEN.
* HALF_OPEN: probing. `allow()` lets at most `probes` calls through at once; each `record()` is a
  probe's result and frees its place. A result that meets the recovery condition
  (level < `recover_below`) extends a streak; when the streak has lasted `recover_samples`
  measurements and `recover_for_s` seconds the breaker closes. A result at or above `reopen_at`
  opens the breaker again (a new cool-down); one between `recover_below` and `reopen_at` only
  restarts the streak. `reopen_at` defaults to `recover_below` (any failed probe reopens); the
  switch-rate and load-latency alerts (`engine.adapters.guard`, alerts only: they refuse nothing) set
  it to `trip`, so that a replica whose switch rate stays under the trip level does not flap
  between open and half-open (measured: with `reopen_at = recover_below`, 16 Zipf adapters on 8
  slots reopened it 132 times in 10 minutes and never closed it, docs/soak.md).

The seed's recovery conditions map onto the streak: "< 2 switches/s for 30 s" is
`recover_below=2, recover_for_s=30`; "< 30 ms for 10 loads" is `recover_below=30, recover_samples=10`;
"100 requests without error" is an error ratio over the last requests (reset when the breaker opens)
with `recover_below` = one error in that window and `recover_samples=100`.

Everything here is plain Python with an injected clock; no locks (each user serialises its calls).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lora_cluster.errors import ConfigError


class BreakerState(enum.Enum):
    CLOSED = "closed"
    WARN = "warn"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerThresholds:
    """When a breaker warns, trips and recovers (see the module docstring)."""

    warn: float
    trip: float
    recover_below: float
    recover_for_s: float = 0.0
    recover_samples: int = 1
    cooldown_s: float = 5.0
    probes: int = 1
    reopen_at: float | None = None  # None: recover_below

    def __post_init__(self) -> None:
        if self.reopen_at is not None and not self.recover_below <= self.reopen_at <= self.trip:
            raise ConfigError(f"breaker thresholds: reopen_at={self.reopen_at} must be between "
                              f"recover_below={self.recover_below} and trip={self.trip}")
        if not self.warn <= self.trip:
            raise ConfigError(f"breaker thresholds: warn={self.warn} must be <= trip={self.trip}")
        if self.recover_below > self.trip:
            raise ConfigError(
                f"breaker thresholds: recover_below={self.recover_below} must be <= trip={self.trip}")
        if self.recover_for_s < 0 or self.recover_samples < 1 or self.cooldown_s < 0 or self.probes < 1:
            raise ConfigError("breaker thresholds: recover_for_s and cooldown_s must be >= 0, "
                              "recover_samples and probes >= 1")


class Breaker:
    """The state machine of the module docstring. `name` appears in logs and reports."""

    def __init__(self, name: str, thresholds: BreakerThresholds, clock: Callable[[], float] = time.monotonic):
        self.name, self.thresholds, self._clock = name, thresholds, clock
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._streak = 0
        self._streak_since = 0.0
        self._probing = 0
        self.level = 0.0  # the last measurement
        self.trips = 0  # times the breaker opened, since start

    @property
    def state(self) -> BreakerState:
        """The current state (an OPEN breaker whose cool-down has passed is HALF_OPEN)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.thresholds.cooldown_s:
            self._state, self._streak, self._probing = BreakerState.HALF_OPEN, 0, 0
        return self._state

    def record(self, level: float) -> BreakerState:
        """A measurement (in HALF_OPEN: a probe's result, which frees its place); the new state."""
        t = self.thresholds
        self.level = level
        state = self.state
        if state in (BreakerState.CLOSED, BreakerState.WARN):
            if level >= t.trip:
                self._open()
            else:
                self._state = BreakerState.WARN if level >= t.warn else BreakerState.CLOSED
        elif state is BreakerState.OPEN:
            if level >= t.trip:
                self._opened_at = self._clock()  # still failing: the cool-down starts again
        else:
            self._probing = max(0, self._probing - 1)
            if level >= (t.recover_below if t.reopen_at is None else t.reopen_at):
                self._open()
            elif level >= t.recover_below:
                self._streak = 0  # not recovered yet: the streak starts again
            else:
                now = self._clock()
                if self._streak == 0:
                    self._streak_since = now
                self._streak += 1
                if self._streak >= t.recover_samples and now - self._streak_since >= t.recover_for_s:
                    self._state = BreakerState.CLOSED
        return self._state

    def allow(self) -> bool:
        """Whether the protected action may run now: always when CLOSED or WARN, never when OPEN,
        and in HALF_OPEN while fewer than `probes` probes are out (this call takes a place; the
        caller gives it back with `record`, or `release` when the probe ended without a result)."""
        state = self.state
        if state is BreakerState.OPEN:
            return False
        if state is BreakerState.HALF_OPEN:
            if self._probing >= self.thresholds.probes:
                return False
            self._probing += 1
        return True

    def release(self) -> None:
        """A probe that `allow` let through ended without a measurement."""
        self._probing = max(0, self._probing - 1)

    def retry_after_s(self) -> float:
        """Seconds until an OPEN breaker lets a probe through (0 when it is not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.thresholds.cooldown_s - self._clock())

    def _open(self) -> None:
        self._state, self._opened_at, self._streak, self._probing = BreakerState.OPEN, self._clock(), 0, 0
        self.trips += 1

    def snapshot(self) -> dict[str, object]:
        """State, last level and trips, for reports and /v1/cluster."""
        return {"state": self.state.value, "level": round(self.level, 4), "trips": self.trips}


class EventRate:
    """Events per second over the last `window_s` seconds (bounded: at most `max_events` kept)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_events: int = 10_000):
        if window_s <= 0:
            raise ConfigError(f"rate window must be positive, got {window_s}")
        self.window_s, self._clock = window_s, clock
        self._times: deque[float] = deque(maxlen=max_events)

    def add(self) -> None:
        self._times.append(self._clock())

    def rate(self) -> float:
        horizon = self._clock() - self.window_s
        while self._times and self._times[0] <= horizon:
            self._times.popleft()
        return len(self._times) / self.window_s


class ErrorRatio:
    """Share of errors among the last `size` outcomes, counting missing outcomes as successes (so a
    few early errors do not read as a high ratio). `reset()` forgets every outcome."""

    def __init__(self, size: int = 100):
        if size < 1:
            raise ConfigError(f"error ratio window must hold at least 1 outcome, got {size}")
        self.size = size
        self._outcomes: deque[bool] = deque(maxlen=size)
        self._errors = 0

    def add(self, error: bool) -> float:
        """Record one outcome; the ratio afterwards."""
        if len(self._outcomes) == self.size and self._outcomes[0]:
            self._errors -= 1
        self._outcomes.append(error)
        self._errors += int(error)
        return self.ratio()

    def ratio(self) -> float:
        return self._errors / self.size

    def reset(self) -> None:
        self._outcomes.clear()
        self._errors = 0

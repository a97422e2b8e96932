"""The engine's two adapter breakers (seed 001): adapter switch rate and device-load latency.

* Switch rate: a *switch* is a cold adapter placed into a device slot that held another adapter
  (an eviction; filling an empty slot is no switch). Measured as switches per second over
  `breaker_switch_window_s`; warns at `breaker_switch_warn_per_s` (3/s), opens at
  `breaker_switch_trip_per_s` (5/s). Open: the engine makes no switch: a request whose adapter would
  need one waits in the engine's queue (requests of resident adapters and of empty slots go on), and
  the replica reports `takes_cold: false`, so the router sends misses to other replicas. After
  `breaker_cooldown_s` it probes (one switch at a time); it closes once the rate stayed below
  `breaker_switch_recover_per_s` (2/s) for `breaker_switch_recover_s` (30 s); a probe that pushes the
  rate back to 2/s opens it again.
* Load latency: the wall time of copying one adapter's weights into its device slot (on CUDA this
  includes staging from host memory; fetching from a source is guarded by the sources' breakers).
  Warns at `breaker_load_warn_ms` (50 ms), opens at `breaker_load_trip_ms` (100 ms). Open: the
  engine places no cold adapter at all (the same waiting and routing as above). After the cool-down
  one probe load at a time; `breaker_load_recover_loads` (10) probes in a row under
  `breaker_load_recover_ms` (30 ms) close it, a slower probe opens it again.

Called from the step loop only (no locks); pure apart from the injected clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lora_cluster.breaker import Breaker, BreakerState, BreakerThresholds, EventRate
from lora_cluster.config import EngineConfig

log = logging.getLogger(__name__)


class AdapterGuard:
    """May the engine place a cold adapter now? (see the module docstring)"""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.enabled = config.breakers
        self.rate = EventRate(config.breaker_switch_window_s, clock)
        self.switches = Breaker("adapter_switch_rate", BreakerThresholds(
            warn=config.breaker_switch_warn_per_s, trip=config.breaker_switch_trip_per_s,
            recover_below=config.breaker_switch_recover_per_s, recover_for_s=config.breaker_switch_recover_s,
            cooldown_s=config.breaker_cooldown_s, reopen_at=config.breaker_switch_trip_per_s), clock)
        self.loads = Breaker("adapter_load_latency", BreakerThresholds(
            warn=config.breaker_load_warn_ms, trip=config.breaker_load_trip_ms,
            recover_below=config.breaker_load_recover_ms, recover_samples=config.breaker_load_recover_loads,
            cooldown_s=config.breaker_cooldown_s, reopen_at=config.breaker_load_trip_ms), clock)
        self._last = {b.name: BreakerState.CLOSED for b in (self.switches, self.loads)}

    def may_place(self, evicts: bool) -> bool:
        """Whether a cold adapter may be placed now (`evicts`: it takes another adapter's slot). A
        True answer may take a half-open probe: follow it with `placed` or `not_placed`."""
        if not self.enabled:
            return True
        if not self.loads.allow():
            return False
        if not evicts:
            return True
        self._observe_rate()
        if not self.switches.allow():
            self._release(self.loads)
            return False
        return True

    def placed(self, seconds: float, evicted: bool) -> None:
        """A cold adapter went into a slot in `seconds` (`evicted`: it replaced another adapter)."""
        if not self.enabled:
            return
        self._record(self.loads, seconds * 1000.0)
        if evicted:
            self.rate.add()
            self._observe_rate()

    def not_placed(self, evicts: bool) -> None:
        """`may_place` said yes but the placement did not happen (its probes are given back)."""
        if self.enabled:
            self._release(self.loads)
            if evicts:
                self._release(self.switches)

    def takes_cold(self) -> bool:
        """Whether cold adapters are placed here now (for the router; takes no probe)."""
        if not self.enabled:
            return True
        self._observe_rate()
        return self.switches.state is not BreakerState.OPEN and self.loads.state is not BreakerState.OPEN

    def snapshot(self) -> dict[str, Any]:
        return {b.name: b.snapshot() for b in (self.switches, self.loads)}

    def _observe_rate(self) -> None:
        """Feed the current switch rate (so that a quiet replica recovers). In half-open a feed is a
        probe result: it needs no place of its own."""
        breaker = self.switches
        if breaker.state is BreakerState.HALF_OPEN:
            breaker.allow()  # the measurement below settles it at once
        self._record(breaker, self.rate.rate())

    @staticmethod
    def _release(breaker: Breaker) -> None:
        if breaker.state is BreakerState.HALF_OPEN:
            breaker.release()

    def _record(self, breaker: Breaker, level: float) -> None:
        state = breaker.record(level)
        if state is not self._last[breaker.name]:
            log.warning("breaker %s: %s -> %s (level %.3g)", breaker.name, self._last[breaker.name].value,
                        state.value, level)
            self._last[breaker.name] = state

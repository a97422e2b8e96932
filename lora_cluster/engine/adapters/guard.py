"""The engine's adapter protection: the switch-rate and load-latency alerts, and the cost of thrash
that protection acts on.

Protection never idles the batch (docs/serving.md#adapter-protection): a cold adapter is placed as
soon as a slot is free or held by an adapter no request wants. What protection does, it does by
choosing (`residency`: which adapter to evict, which cold loads run first and how many at
once; the router: which replica a miss goes to). This object measures; it refuses nothing.

* The switch rate and the load latency are **alerts**: two `Breaker` state machines keep their
  names, levels and states (metrics, routing-stats `breakers`, a log line on every change, the
  PrometheusRule in deploy/k8s) and never hold work back.
  - `adapter_switch_rate`: a *switch* is a cold adapter placed into a device slot that held another
    adapter (filling an empty slot is no switch), per second over `breaker_switch_window_s`; warn
    at `breaker_switch_warn_per_s` (3/s), open (alerting) at `breaker_switch_trip_per_s` (5/s); back
    to closed once the rate stayed below `breaker_switch_recover_per_s` (2/s) for
    `breaker_switch_recover_s` (30 s) after the cool-down.
  - `adapter_load_latency`: the wall time of placing one adapter's weights into its device slot;
    warn at `breaker_load_warn_ms` (50 ms), open at `breaker_load_trip_ms` (100 ms); closed again
    after the cool-down by `breaker_load_recover_loads` (10) loads in a row under
    `breaker_load_recover_ms` (30 ms).
* Thrash is judged by its cost (`thrash.ThrashMeter`: the share of step time spent placing
  adapters and of loader time spent on switches, thresholds from this replica's measured load and
  step time). Its `miss_penalty` is reported to the router, a soft score: misses go to a replica
  that is not thrashing when one is as good otherwise, and come here when none is.

`breakers: false` turns the alerts and the protection choices off (plain LRU placement, every
cold load in arrival order). Called from the step loop only (no locks); pure apart from the
injected clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lora_cluster.breaker import Breaker, BreakerState, BreakerThresholds, EventRate
from lora_cluster.config import EngineConfig
from lora_cluster.engine.adapters.thrash import ThrashMeter

log = logging.getLogger(__name__)


class AdapterGuard:
    """The adapter alerts and the thrash meter (see the module docstring)."""

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
        self.thrash = ThrashMeter(config.adapter_load_workers, clock=clock)
        self._last = {b.name: BreakerState.CLOSED for b in (self.switches, self.loads)}

    def placed(self, seconds: float, evicted: bool, fetch_s: float = 0.0) -> None:
        """A cold adapter went into a slot in `seconds` (`evicted`: it replaced another adapter),
        after a host fetch of `fetch_s` seconds."""
        if not self.enabled:
            return
        self.thrash.loaded(fetch_s, seconds, evicted=evicted)
        self._record(self.loads, seconds * 1000.0)
        if evicted:
            self.rate.add()
        self._observe_rate()

    def stepped(self, seconds: float) -> None:
        """The engine ran a batch for `seconds` (the step time thrash is measured against)."""
        if self.enabled:
            self.thrash.step(seconds)

    def alerting(self) -> dict[str, BreakerState]:
        """The state of each adapter alert (OPEN: at or past its trip level)."""
        if self.enabled:
            self._observe_rate()
        return {b.name: b.state for b in (self.switches, self.loads)}

    def miss_penalty(self) -> float:
        """The router's soft score for sending a miss here: 0 (fine) .. 1 (in thrash, better elsewhere)."""
        return self.thrash.miss_penalty() if self.enabled else 0.0

    def snapshot(self) -> dict[str, Any]:
        if self.enabled:
            self._observe_rate()
        return {b.name: b.snapshot() for b in (self.switches, self.loads)}

    def thrash_snapshot(self) -> dict[str, Any]:
        return self.thrash.snapshot() if self.enabled else {}

    def _observe_rate(self) -> None:
        """Feed the current switch rate (so that a quiet replica's alert clears)."""
        self._record(self.switches, self.rate.rate())

    def _record(self, breaker: Breaker, level: float) -> None:
        state = breaker.record(level)
        if state is not self._last[breaker.name]:
            log.warning("adapter alert %s: %s -> %s (level %.3g)", breaker.name,
                        self._last[breaker.name].value, state.value, level)
            self._last[breaker.name] = state

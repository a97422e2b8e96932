"""The ingress's routing-error breaker (warn at 1%, break at 3%, recover after 100
requests without error) and which failures count as routing errors.

A *routing error* is a call the ingress sent to a replica that could not serve it for the
replica's sake, not the request's: the replica died or became unreachable (Ray's actor errors),
the deployment had no replica, or the replica ended the stream without any output. Errors the
replica answered (400, 404, 429, ...) are successes of routing. The dispatcher retries a routing
error on another replica when nothing of the response was sent yet (see `dispatch`), and tells
this guard about each request's outcome: `outcome(error)` once it started or finally failed to
start, and once more if its stream breaks on a dead replica.

The level is the share of routing errors among the last `WINDOW` (100) outcomes (`ErrorRatio`):
WARN at `breaker_routing_warn` (1%), OPEN at `breaker_routing_trip` (3%). While OPEN the ingress
sheds: every new generation request is answered 503 `routing_unavailable` with `Retry-After` = the
cool-down left (`breaker_cooldown_s`), at once, instead of being sent into a failing cluster.
HALF_OPEN after the cool-down: up to `PROBES` requests at a time go through (the others are still
shed); `breaker_routing_recover_requests` (100) calls in a row without a routing error close it, a
routing error opens it again. The window is emptied whenever the breaker opens, so recovery counts
only calls made after it opened. Pure apart from the injected clock (one event loop, no locks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lora_cluster.breaker import Breaker, BreakerState, BreakerThresholds, ErrorRatio
from lora_cluster.config import ServeConfig
from lora_cluster.errors import RoutingUnavailableError

log = logging.getLogger(__name__)
WINDOW = 100  # calls the error share is measured over
PROBES = 4  # requests let through at once while half-open


def is_routing_error(exc: BaseException) -> bool:
    """Whether a call's failure is the replica's (dead, unreachable, no replica), not the request's."""
    from ray import exceptions as ray_exc
    from ray.serve import exceptions as serve_exc

    from lora_cluster.serve.http_errors import NoReplicaError

    gone = (ray_exc.RayActorError, ray_exc.ActorUnschedulableError, serve_exc.DeploymentUnavailableError,
            NoReplicaError)
    if isinstance(exc, gone):
        return True
    if isinstance(exc, ray_exc.RayTaskError) and isinstance(exc.cause, BaseException):
        return is_routing_error(exc.cause)
    return False


class RoutingGuard:
    """Counts routing errors and sheds while they are too frequent (see the module docstring)."""

    def __init__(self, warn: float = 0.01, trip: float = 0.03, recover_requests: int = 100,
                 cooldown_s: float = 5.0, enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self.ratio = ErrorRatio(WINDOW)
        self.breaker = Breaker("routing_errors", BreakerThresholds(
            warn=warn, trip=trip, recover_below=1 / WINDOW, recover_samples=recover_requests,
            cooldown_s=cooldown_s, probes=PROBES), clock)

    @classmethod
    def from_config(cls, config: ServeConfig) -> RoutingGuard:
        router, engine = config.router, config.engine
        return cls(router.breaker_routing_warn, router.breaker_routing_trip,
                   router.breaker_routing_recover_requests, engine.breaker_cooldown_s, engine.breakers)

    def admit(self) -> None:
        """Let a new request through, or raise RoutingUnavailableError (shed: 503, Retry-After)."""
        if self.enabled and not self.breaker.allow():
            retry = max(1.0, self.breaker.retry_after_s())
            raise RoutingUnavailableError(
                f"requests are shed while replicas keep failing (routing errors reached "
                f"{self.breaker.thresholds.trip:.0%} of the last {WINDOW} requests); retry in {retry:.0f} s",
                retry)

    def outcome(self, error: bool) -> None:
        """One call's result (`error`: a routing error)."""
        if not self.enabled:
            return
        before = self.breaker.state
        after = self.breaker.record(self.ratio.add(error))
        if after is BreakerState.OPEN and before is not BreakerState.OPEN:
            self.ratio.reset()
        if after is not before:
            log.warning("breaker routing_errors: %s -> %s (%.1f%% of the last %d calls)", before.value,
                        after.value, 100 * self.breaker.level, WINDOW)

    def abandoned(self) -> None:
        """An admitted request ended before any call's outcome (cancelled, refused by admission)."""
        if self.enabled and self.breaker.state is BreakerState.HALF_OPEN:
            self.breaker.release()

    def snapshot(self) -> dict[str, object]:
        return self.breaker.snapshot()

"""The lifetime of a detached actor that belongs to a Serve application: it ends when the application does.

The cluster tier's actors (`serve.replica.cluster_tier`) are detached so that they outlive the replica
that created them: a replica that Serve replaces (it crashed, or `ray.kill`) must not take its node's
published copies with it. Nothing else then ends them, so each runs an `AppWatch`: every `period_s`
it asks whether its application still exists (`exists`: for the Ray edge, the application is listed
by `serve.status()`, which lists nothing once Serve is shut down), and after `strikes` answers in a
row that it does not (or that could not be had: the Serve controller is restarting or gone), it calls
`on_gone` (the actor kills itself, dropping its objects). One answer that it exists resets the count,
so a redeploy of the application or a brief controller restart ends nothing.

States: WATCHING -> GONE (once; `on_gone` runs once) or STOPPED (`stop`, for a clean shutdown).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class WatchState(enum.Enum):
    """Where an `AppWatch` is."""

    WATCHING = "watching"
    GONE = "gone"  # the application is gone: `on_gone` ran
    STOPPED = "stopped"


class AppWatch:
    """Ends an actor when its application is gone (see the module docstring)."""

    def __init__(self, app: str, exists: Callable[[str], bool], on_gone: Callable[[], None], *,
                 period_s: float = 5.0, strikes: int = 2):
        self.app, self._exists, self._on_gone = app, exists, on_gone
        self.period_s, self.strikes = period_s, strikes
        self.state, self.misses = WatchState.WATCHING, 0
        self._stop = threading.Event()

    def poll(self) -> WatchState:
        """One check: count a miss (or reset the count) and end the actor at `strikes` misses."""
        if self.state is not WatchState.WATCHING:
            return self.state
        try:
            found = self._exists(self.app)
        except Exception as e:  # the controller is restarting or gone: a miss, not a crash
            log.info("cannot tell whether application %r exists: %s", self.app, e)
            found = False
        self.misses = 0 if found else self.misses + 1
        if self.misses >= self.strikes:
            self.state = WatchState.GONE
            log.info("application %r is gone: ending its cluster-tier actor", self.app)
            self._on_gone()
        return self.state

    def start(self) -> threading.Thread:
        """Poll every `period_s` on a daemon thread until the application is gone or `stop` is called."""
        thread = threading.Thread(target=self._run, name=f"app-watch-{self.app}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if self.state is WatchState.WATCHING:
            self.state = WatchState.STOPPED
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.poll() is not WatchState.WATCHING:
                return


def serve_app_exists(app: str) -> bool:
    """Whether Serve lists the application `app` (False once Serve is shut down)."""
    from ray import serve

    return app in serve.status().applications

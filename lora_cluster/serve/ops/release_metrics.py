"""Per-version request, error and TTFT metrics of the adapters under release, with bounded labels.

A request counts here when its version is the stable or the candidate version of its name's running
release (`ReleaseBook.running`): labels `adapter` (the name), `version` (the number) and `role`
(`stable` or `candidate`), so a name has at most two label combinations at a time. A version outside
the running release (an older one pinned with `name@N`) and every version of a name with no running
release have no series. At most `max_names` names (`metrics_max_adapter_labels`) have series at
once; the requests of a name beyond them are not counted here (its release still judges them).
When a name's release ends or another starts, its series are dropped with the next request counted
here, so the series held are those of releases that were running at the last request.

The request counter counts what the release's gates count (`serve.http.release_traffic`): each
answered request, and each failure the version can cause, which also counts as an error. The metrics
are declared in `serve.ops.metrics`; `configure` sets the bound once, in the ingress (until then
ServeConfig's default holds). Not thread-safe: the ingress's event loop is its one caller.

Release gauges (`ReleaseGauges`, computed at each scrape from the ingress's release book, not summed
over the ingresses: every ingress follows the same shared release state, so any one answers for all):
the seconds each running release has spent in its current step and its candidate's share, and when
each name's latest release was rolled back and why (`eval`, `gate`, `manual`). Wall-clock times, as
the releases keep them, so every ingress computes the same figures. Bounded like the counters: at
most `max_names` names per family, the longest in their step first (the stuck ones an alert wants)
and the latest rollbacks first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client.core import Metric

from lora_cluster.config import MetricsConfig, ServeConfig
from lora_cluster.releases.release import Release, ReleaseState
from lora_cluster.serve.ops.metrics import (
    RELEASE_CANDIDATE_SHARE,
    RELEASE_ROLES,
    RELEASE_ROLLBACK_TIME,
    RELEASE_STEP_SECONDS,
    RELEASE_VERSION_ERRORS,
    RELEASE_VERSION_REQUESTS,
    RELEASE_VERSION_TTFT,
)

Pair = tuple[int, int]  # (stable, candidate) version numbers of a running release
_METRICS = (RELEASE_VERSION_REQUESTS, RELEASE_VERSION_ERRORS, RELEASE_VERSION_TTFT)


class ReleaseMetrics:
    """The names with series and the (stable, candidate) pair each one's series are labelled with."""

    def __init__(self, max_names: int):
        self.max_names = max_names
        self._series: dict[str, Pair] = {}

    def record(self, name: str, number: int, running: Callable[[str], Pair | None], ok: bool,
               ttft_s: float | None = None) -> None:
        """One request of `name@number`, answered (`ok`) or failed; `running` gives a name's
        running release's pair (None: none)."""
        self._prune(running)
        pair = running(name)
        if pair is None or number not in pair:
            return
        if name not in self._series and len(self._series) >= self.max_names:
            return
        self._series[name] = pair
        labels = (name, str(number), RELEASE_ROLES[pair.index(number)])
        RELEASE_VERSION_REQUESTS.labels(*labels).inc()
        if not ok:
            RELEASE_VERSION_ERRORS.labels(*labels).inc()
        elif ttft_s is not None:
            RELEASE_VERSION_TTFT.labels(*labels).observe(ttft_s)

    def names(self) -> list[str]:
        """The names that have series now."""
        return sorted(self._series)

    def _prune(self, running: Callable[[str], Pair | None]) -> None:
        for name, pair in list(self._series.items()):
            if running(name) != pair:
                del self._series[name]
                for number, role in zip(pair, RELEASE_ROLES, strict=True):
                    for metric in _METRICS:
                        with contextlib.suppress(KeyError):
                            metric.remove(name, str(number), role)


_metrics = ReleaseMetrics(MetricsConfig().metrics_max_adapter_labels)  # the default until `configure`


def configure(config: ServeConfig) -> None:
    """Bound the names with series as `config` says (the ingress calls this once)."""
    global _metrics
    _metrics = ReleaseMetrics(config.metrics.metrics_max_adapter_labels)
    for metric in _METRICS:
        metric.clear()  # series of an earlier configuration are not in the new index


def record(name: str, number: int, running: Callable[[str], Pair | None], ok: bool,
           ttft_s: float | None = None) -> None:
    """`ReleaseMetrics.record` on this process's metrics."""
    _metrics.record(name, number, running, ok, ttft_s)


def names() -> list[str]:
    """The names with series now in this process."""
    return _metrics.names()


class LatestReleases(Protocol):
    """What the gauges read: the latest release of every name (`ReleaseBook.latest`)."""

    def latest(self) -> list[Release]: ...


def rollback_cause(release: Release) -> str:
    """Why a rolled-back release was: `eval` (the eval gate), `gate` (a live gate) or `manual`."""
    last = release.events()[-1]  # a final release's last event is its final decision
    if last.kind == "eval_failed":
        return "eval"
    return "gate" if last.reason.startswith("automatic:") else "manual"


class ReleaseGauges:
    """The release gauges of one ingress's book, as a scrape collector (module docstring); `clock`:
    Unix seconds."""

    def __init__(self, book: LatestReleases, max_names: int, clock: Callable[[], float] = time.time):
        self._book, self.max_names, self._clock = book, max_names, clock

    def collect(self) -> Iterable[Metric]:
        now, latest = self._clock(), self._book.latest()
        step, share = RELEASE_STEP_SECONDS.family(), RELEASE_CANDIDATE_SHARE.family()
        running = sorted((r for r in latest if not r.final), key=lambda r: r.step_started_at)
        for release in running[:self.max_names]:
            step.add_metric([release.name, release.state.value], max(0.0, now - release.step_started_at))
            share.add_metric([release.name], release.percent / 100)
        rolled_back = sorted((r for r in latest if r.state is ReleaseState.ROLLED_BACK),
                             key=lambda r: r.events()[-1].at, reverse=True)
        rollbacks = RELEASE_ROLLBACK_TIME.family()
        for release in rolled_back[:self.max_names]:
            rollbacks.add_metric([release.name, rollback_cause(release)], release.events()[-1].at)
        yield from (step, share, rollbacks)

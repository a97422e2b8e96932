"""Per-SLA-class request statistics of one replica: latency percentiles, SLO attainment, requests now.

For each configured class, over a sliding window (the last `window_s` seconds and at most
`max_samples` finished requests per class, whichever is fewer):

* `finished`: requests that ended in the window (successes and errors);
* `ttft_p50_s`, `ttft_p99_s`: time to first token (as the engine measured it, from its arrival);
* `tpot_p50_s`, `tpot_p99_s`: time per output token after the first, i.e. (time of the last token -
  time of the first token) / (completion tokens - 1); requests with one token have none;
* `slo_attainment`: the fraction of `finished` that met the class's targets (`SlaClass.met`); a
  request that ended with an error did not meet them.

And now: `running` (requests that have produced their first token and not ended) and `waiting`
(requests accepted by the replica that have no token yet: queued in the engine or in prefill).
A statistic without a sample is None.

A request cancelled by its caller (client disconnect) leaves `running`/`waiting` and is not counted
as finished: it neither met nor missed its targets. A class this replica's configuration does not
know (configurations differ during a rollout) is not counted, so the statistics stay bounded by the
configured classes. Percentiles are nearest-rank. Pure: no Ray, no engine; the clock is injected. Not
thread-safe: one event loop (the replica's) calls it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.sla import SlaClass, SlaClasses
from lora_cluster.errors import ConfigError

DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_SAMPLES = 1024


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0 < q <= 100) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class _Sample:
    at: float  # when the request ended (clock time)
    ttft_s: float | None
    tpot_s: float | None
    met: bool


class _ClassWindow:
    """One class's samples (bounded deque) and its requests in flight."""

    def __init__(self, sla: SlaClass, window_s: float, max_samples: int, clock: Callable[[], float]):
        self.sla, self.window_s, self.clock = sla, window_s, clock
        self.samples: deque[_Sample] = deque(maxlen=max_samples)
        self.running = 0
        self.waiting = 0

    def expire(self, now: float) -> None:
        while self.samples and self.samples[0].at < now - self.window_s:
            self.samples.popleft()

    def record(self, ttft_s: float | None, tpot_s: float | None, *, error: bool) -> None:
        now = self.clock()
        met = not error and self.sla.met(ttft_s, tpot_s)
        self.samples.append(_Sample(now, ttft_s, tpot_s, met))
        self.expire(now)


class RequestTracker:
    """One request of one class, from acceptance to its end. Call `first_token()` when its first token
    arrives, then one of `finished`, `failed` or `cancelled`; calls after the end are ignored (so a
    `finally: tracker.cancelled()` is safe)."""

    def __init__(self, window: _ClassWindow | None):
        self._window = window  # None: a class this replica does not know, nothing is counted
        self._first_at: float | None = None
        self._ended = False

    def first_token(self) -> None:
        """The request produced its first token: it moves from waiting to running."""
        w = self._window
        if w is None or self._ended or self._first_at is not None:
            return
        self._first_at = w.clock()
        w.waiting -= 1
        w.running += 1

    def finished(self, ttft_s: float | None, completion_tokens: int) -> None:
        """The request ended normally with `completion_tokens` tokens; `ttft_s` as the engine measured."""
        w = self._window
        if w is None or self._ended:
            return
        self.first_token()  # a request that finished has produced its tokens
        first_at = w.clock() if self._first_at is None else self._first_at
        tpot = None
        if completion_tokens > 1:
            tpot = max(0.0, w.clock() - first_at) / (completion_tokens - 1)
        self._leave(w)
        w.record(ttft_s, tpot, error=False)

    def failed(self) -> None:
        """The request ended with an error: it counts as finished, its targets not met."""
        w = self._window
        if w is None or self._ended:
            return
        self._leave(w)
        w.record(None, None, error=True)

    def cancelled(self) -> None:
        """The caller went away: the request leaves the counts without a sample."""
        w = self._window
        if w is None or self._ended:
            return
        self._leave(w)

    def _leave(self, w: _ClassWindow) -> None:
        self._ended = True
        if self._first_at is None:
            w.waiting -= 1
        else:
            w.running -= 1


class ClassStats:
    """The per-class statistics of one replica (see the module docstring)."""

    def __init__(self, classes: SlaClasses, *, window_s: float = DEFAULT_WINDOW_S,
                 max_samples: int = DEFAULT_MAX_SAMPLES, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0 or max_samples < 1:
            raise ConfigError(f"window_s must be > 0 and max_samples >= 1, got {window_s}, {max_samples}")
        self._clock = clock
        self._classes = {c.name: _ClassWindow(c, window_s, max_samples, clock) for c in classes.classes}

    def start(self, class_name: str) -> RequestTracker:
        """A request of `class_name` was accepted: it is waiting until its first token."""
        window = self._classes.get(class_name)
        if window is not None:
            window.waiting += 1
        return RequestTracker(window)

    def running_by_priority(self) -> dict[int, int]:
        """{priority: running requests} over the classes with running requests (classes may share one)."""
        out: dict[int, int] = {}
        for window in self._classes.values():
            if window.running:
                out[window.sla.priority] = out.get(window.sla.priority, 0) + window.running
        return out

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """{class name: {running, waiting, finished, ttft_p50_s, ttft_p99_s, tpot_p50_s, tpot_p99_s,
        slo_attainment}}, every configured class, most urgent first."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        for name, window in self._classes.items():
            window.expire(now)
            samples = list(window.samples)
            ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
            tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
            out[name] = {
                "running": window.running,
                "waiting": window.waiting,
                "finished": len(samples),
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p99_s": percentile(ttfts, 99),
                "tpot_p50_s": percentile(tpots, 50),
                "tpot_p99_s": percentile(tpots, 99),
                "slo_attainment": (sum(s.met for s in samples) / len(samples)) if samples else None,
            }
        return out

"""What a release learns from live traffic: each answered request of a version under release, as
evidence for its gates (`releases.book.record`).

A request counts once, by its first job's adapter (a request's choices share one version; a merge
of adapters is no one version's evidence). It is an error when it failed for a reason the version
can cause (a failed adapter load, an engine error, an invalid adapter...), not when the client went
away or the cluster shed it for overload (`NOT_THE_VERSIONS`). On target: the first token came
within the SLA class's TTFT target (`SlaClass.met`). A streamed request counts when its first job's
last item is sent (answered, its TTFT the first one an item carried) or when its stream ends in an
error event (`StreamEvidence`); a client that leaves mid-stream records nothing. Recording is
synchronous, between two awaits; it goes into this ingress's book, and with a durable release state
its background sync (started here, on the first answered request) writes it to the shared state
(`release_state`). The same requests go into the per-version metrics of the running releases
(`serve.ops.release_metrics`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.errors import (
    ClusterOverloadedError,
    EngineOverloadedError,
    QuotaExceededError,
    RequestAbortedError,
)
from lora_cluster.releases.refs import parse_ref
from lora_cluster.serve.http.release_state import SharedReleases
from lora_cluster.serve.http_errors import ApiException
from lora_cluster.serve.ops import release_metrics

NOT_THE_VERSIONS = (asyncio.CancelledError, RequestAbortedError, ClusterOverloadedError,
                    EngineOverloadedError, QuotaExceededError)


def _version(job: Any) -> tuple[str, int] | None:
    if job.adapter_id is None or job.merge is not None:
        return None
    name, number = parse_ref(job.adapter_id)
    return name, number or 1


def _running(state: SharedReleases) -> Callable[[str], tuple[int, int] | None]:
    def pair(name: str) -> tuple[int, int] | None:
        release = state.book.running(name)
        return None if release is None else (release.stable, release.candidate)
    return pair


def record_answer(state: SharedReleases, job: Any, final: dict[str, Any], sla: SlaClass) -> None:
    """A request whose first job is `job` was answered; `final` is that job's last item."""
    version = _version(job)
    if version is not None:
        state.start()
        release_metrics.record(*version, _running(state), ok=True, ttft_s=final.get("ttft_s"))
        state.book.record(*version, ok=True, on_target=sla.met(final.get("ttft_s"), None))


def record_failure(state: SharedReleases, job: Any, exc: BaseException) -> None:
    """A request whose first job is `job` failed with `exc` (counted unless not the version's doing)."""
    version = _version(job)
    if version is None or isinstance(exc, NOT_THE_VERSIONS):
        return
    if isinstance(exc, ApiException) and exc.error.status in (429,):
        return
    state.start()
    release_metrics.record(*version, _running(state), ok=False)  # before a gate may end the release
    state.book.record(*version, ok=False)


class StreamEvidence:
    """A streamed request's evidence (module docstring): `item` for every item sent to the client
    (`index`: its job's place in the request), `failed` for the error that ended the stream. It
    records at most once."""

    def __init__(self, state: SharedReleases, job: Any, sla: SlaClass):
        self._state, self._job, self._sla = state, job, sla
        self._ttft_s: float | None = None
        self._recorded = False

    def item(self, index: int, item: dict[str, Any]) -> None:
        if index != 0 or self._recorded:
            return
        if self._ttft_s is None and item.get("ttft_s") is not None:
            self._ttft_s = float(item["ttft_s"])
        if item.get("finished"):
            self._recorded = True
            record_answer(self._state, self._job, {"ttft_s": self._ttft_s}, self._sla)

    def failed(self, exc: BaseException) -> None:
        if not self._recorded:
            self._recorded = True
            record_failure(self._state, self._job, exc)

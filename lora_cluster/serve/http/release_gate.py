"""The eval gate of one release, run by the ingress that holds its lease: the creating ingress
(`releases_api`), or one that took the gate over after that ingress died (`release_state`).

A run: load the candidate as its version if it is not registered yet (a takeover after the creating
ingress died before its load; the version number must still be the name's next, else the gate
fails). A takeover whose creator died in the middle of that load finds the version busy: it waits,
at most `BUSY_WAIT_S`, until the registry frees it (the dead ingress's reservation lapses once its
long poll has been silent for `SUBSCRIBER_TTL_S`) and loads it then; the creating ingress never
waits (a busy version there is another client's load, which the gate must not evaluate). Then run
the evaluation set (the one given at creation, else `eval.jsonl` beside the candidate) on both
versions (`release_eval`), and write the verdict (`ReleaseBook.settle_eval`: only while this
ingress holds the lease). A run that fails or is cancelled (its client went away) rolls the release
back with the reason, never leaves it evaluating; the write of that verdict is shielded from the
cancellation. The lease is renewed by the sync while the run lasts (`SharedReleases.gate`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.eval_gate import EvalCase
from lora_cluster.releases.release import ReleaseState
from lora_cluster.serve.http.adapter_loads import AdapterLoads
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.registrations import SUBSCRIBER_TTL_S
from lora_cluster.serve.http.release_eval import ReleaseEvaluation, eval_set
from lora_cluster.serve.http_errors import ApiException, conflict

BUSY_WAIT_S = 2 * SUBSCRIBER_TTL_S  # a takeover's wait for a dead creator's reservation to lapse
BUSY_RETRY_S = 1.0


class ReleaseGate:
    """Runs releases' eval gates through one ingress's context (module docstring)."""

    def __init__(self, ctx: ApiContext, loads: AdapterLoads):
        self.ctx, self.loads = ctx, loads
        self.evaluation = ReleaseEvaluation(ctx)

    async def run(self, name: str, release_id: str, cases: list[EvalCase] | None = None,
                  read_set: bool = True) -> dict[str, Any]:
        """Run the gate of release `release_id` of `name`; its status after the verdict. `cases`
        with `read_set=False`: the creating call's run, with the set it already read (checked before
        any load); otherwise a takeover's."""
        state = self.ctx.release_state
        release = self.ctx.releases.release(name, release_id)
        if release.state is not ReleaseState.EVALUATING:  # judged or commanded meanwhile: nothing to run
            return release.status()
        stable, number, gate = release.stable, release.candidate, release.gate or {}
        lora_path = str(gate.get("lora_path", ""))
        with state.gate(release_id):
            try:
                await self._load_candidate(name, number, lora_path, BUSY_WAIT_S if read_set else 0.0)
                if read_set:
                    cases = await eval_set(gate.get("eval_set"), lora_path)
                verdict = None if cases is None else await self.evaluation.judge(cases, name, stable, number)
            except BaseException as exc:  # a failed load or evaluation, or the client went away
                reason = f"the candidate was not evaluated ({type(exc).__name__})"
                await asyncio.shield(state.transact(
                    lambda book: book.settle_eval(name, release_id, state.owner, False, reason, {})))
                raise
            if verdict is None:
                evidence: dict[str, Any] = {"eval_set": None, "note": "no evaluation set was given or found"}
                passed, reason = True, ""
            else:
                evidence, passed, reason = verdict.evidence, verdict.passed, verdict.reason

            def judged(book: ReleaseBook) -> dict[str, Any]:
                return book.settle_eval(name, release_id, state.owner, passed, reason, evidence).status()

            return await state.transact(judged)

    async def _load_candidate(self, name: str, number: int, lora_path: str, busy_wait_s: float) -> None:
        """Load `lora_path` as version `number` of `name` unless it is registered; a version busy
        (being loaded elsewhere) is tried again every BUSY_RETRY_S for `busy_wait_s` (module docstring)."""
        deadline = time.monotonic() + busy_wait_s
        while number not in self.ctx.models.versions.versions(name):
            if self.loads.next_version(name, inplace=True) != number:
                raise conflict(f"version {number} of {name!r} cannot be loaded again: another "
                               "version was loaded meanwhile", code="release_conflict")
            try:
                await self.loads.load(name, lora_path, inplace=True)
            except ApiException as exc:
                if exc.error.code != "being_loaded" or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(BUSY_RETRY_S)

"""The eval gate of a release, run through the engine: an evaluation set's cases on the stable and
the candidate version, at the least urgent SLA class, before the candidate gets any traffic.

The set comes with the release request (`eval_set`), or is `eval.jsonl` beside the candidate's
weights when its path is a local folder; none: no evaluation is run (the release's `eval_passed`
event says so). Cases with an expected answer are run here, greedily (temperature 0, at most
`EVAL_MAX_TOKENS` tokens); the other kinds (`choices`, `schema`) are scored by `releases.eval_gate`
but not run through the engine yet, so a set holding one is a 400 before anything is loaded. At most
`MAX_EVAL_CASES` cases, one at a time per version (bounded work on the replicas).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from lora_cluster.errors import RequestError
from lora_cluster.releases.eval_gate import (
    EVAL_FILE,
    CaseResult,
    EvalCase,
    EvalVerdict,
    compare,
    parse_eval_set,
    score,
)
from lora_cluster.request.sampling_params import SamplingParams
from lora_cluster.serve.http.adapter_versions import replica_id_of
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.protocol import GenerateJob

MAX_EVAL_CASES = 100
EVAL_MAX_TOKENS = 32


def _no_schema_check(schema: dict[str, Any], document: Any) -> bool:
    raise RequestError("schema cases are not run through the engine yet")


async def eval_set(given: list[dict[str, Any]] | None, lora_path: str) -> list[EvalCase] | None:
    """The release's evaluation set: the request's, else `eval.jsonl` beside a local candidate, else
    None. RequestError (400) naming the line of a bad case, or a kind not run here."""
    if given is not None:
        lines = [json.dumps(case) for case in given]
    else:
        path = Path(lora_path) / EVAL_FILE
        if not await asyncio.to_thread(path.is_file):
            return None
        lines = (await asyncio.to_thread(path.read_text)).splitlines()
    cases = parse_eval_set(lines, MAX_EVAL_CASES)
    other = sorted({case.kind for case in cases} - {"expected"})
    if other:
        raise RequestError(f"evaluation cases of kind {', '.join(other)} are not run through the engine "
                           "yet; give cases with an `expected` answer")
    return cases


class ReleaseEvaluation:
    """Runs an evaluation set on two versions of a name and judges them (`eval_gate.compare`)."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        classes = ctx.policy.sla.by_name.values()
        self.batch = max(classes, key=lambda c: c.priority)  # the least urgent class

    async def judge(self, cases: list[EvalCase], name: str, stable: int, candidate: int) -> EvalVerdict:
        stable_results = await self._run(cases, replica_id_of(name, stable))
        candidate_results = await self._run(cases, replica_id_of(name, candidate))
        margin = self.ctx.releases.settings.eval_margin
        return compare(score(cases, stable_results, _no_schema_check),
                       score(cases, candidate_results, _no_schema_check), margin, len(cases))

    async def _run(self, cases: list[EvalCase], adapter_id: str) -> list[CaseResult]:
        results = []
        for case in cases:
            prompt = await self.ctx.tokens.encode(case.prompt)
            job = GenerateJob(request_id=self.ctx.new_id("eval"), prompt=prompt.ids, adapter_id=adapter_id,
                              sampling=SamplingParams(max_new_tokens=EVAL_MAX_TOKENS, temperature=0.0),
                              stream=False, adapter_path=self.ctx.models.adapter_path(adapter_id),
                              priority_class=self.batch.name, priority=self.batch.priority)
            generation = await self.ctx.dispatcher.start(job, "/v1/adapters/releases/eval")
            try:
                final = await generation.final()
            except BaseException:
                generation.cancel()
                raise
            results.append(CaseResult(text=final["text"]))
        return results

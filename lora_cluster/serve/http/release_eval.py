"""The eval gate of a release, run through the engine: an evaluation set's cases on the stable and
the candidate version, at the least urgent SLA class, before the candidate gets any traffic.

The set comes with the release request (`eval_set`), or is `eval.jsonl` beside the candidate's
weights when its path is a local folder; none: no evaluation is run (the release's `eval_passed`
event says so). Each kind of case runs through the engine as a client's request would:
* `expected`: a greedy completion (temperature 0) of at most `EVAL_MAX_TOKENS` tokens;
* `choices`: one prefill per choice of the prompt followed by the choice's text (written as it
  continues the prompt, leading space included), asking for the prompt tokens' logprobs (the
  completions API's `echo` with `logprobs`); a choice's loglikelihood is the sum of the logprobs of
  its tokens (the tokens of `prompt + choice` past those of `prompt`, as lm-evaluation-harness
  counts them). A choice the prompt limit cuts away entirely scores minus infinity;
* `schema`: a greedy completion of at most `EVAL_SCHEMA_MAX_TOKENS` tokens constrained by the
  schema (the `response_format` path, as a client with that schema gets it), unless the case says
  `"constrained": false`; it passes when the text is a complete JSON document valid for the schema
  (`jsonschema`), so a constrained version fails it by not finishing within the budget.
A schema that is not a valid JSON schema is a 400 before anything is loaded. At most
`MAX_EVAL_CASES` cases, one request at a time per version (bounded work on the replicas).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import jsonschema

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
from lora_cluster.request.guided_spec import GuidedSpec
from lora_cluster.request.sampling_params import SamplingParams
from lora_cluster.serve.http.adapter_versions import replica_id_of
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.protocol import GenerateJob

MAX_EVAL_CASES = 100
EVAL_MAX_TOKENS = 32
EVAL_SCHEMA_MAX_TOKENS = 128  # a schema case's document must be complete within this many tokens
ROUTE = "/v1/adapters/releases/eval"
DRAFT = jsonschema.Draft202012Validator  # a schema without `$schema` is read as 2020-12


def schema_valid(schema: dict[str, Any], document: Any) -> bool:
    """Whether a parsed JSON document is valid for a JSON schema (its own `$schema` draft, else
    2020-12)."""
    validator = jsonschema.validators.validator_for(schema, default=DRAFT)
    return bool(validator(schema).is_valid(document))


def _checked_schemas(cases: list[EvalCase]) -> None:
    """A 400 naming the case whose schema is not a JSON schema (or too large to constrain with)."""
    for number, case in enumerate(cases, 1):
        if case.schema is None:
            continue
        try:
            GuidedSpec.json_schema(case.schema)
            jsonschema.validators.validator_for(case.schema, default=DRAFT).check_schema(case.schema)
        except jsonschema.SchemaError as exc:
            raise RequestError(f"evaluation case {number}: `schema` is not a valid JSON schema: "
                               f"{exc.message}") from None
        except RequestError as exc:
            raise RequestError(f"evaluation case {number}: {exc}") from None


async def eval_set(given: list[dict[str, Any]] | None, lora_path: str) -> list[EvalCase] | None:
    """The release's evaluation set: the request's, else `eval.jsonl` beside a local candidate, else
    None. RequestError (400) naming the line of a bad case."""
    if given is not None:
        lines = [json.dumps(case) for case in given]
    else:
        path = Path(lora_path) / EVAL_FILE
        if not await asyncio.to_thread(path.is_file):
            return None
        lines = (await asyncio.to_thread(path.read_text)).splitlines()
    cases = parse_eval_set(lines, MAX_EVAL_CASES)
    _checked_schemas(cases)
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
        verdict = compare(score(cases, stable_results, schema_valid),
                          score(cases, candidate_results, schema_valid), margin, len(cases))
        kinds = sorted({case.kind for case in cases})
        return EvalVerdict(verdict.passed, verdict.reason, {**verdict.evidence, "kinds": kinds})

    async def _run(self, cases: list[EvalCase], adapter_id: str) -> list[CaseResult]:
        return [await self._case(case, adapter_id) for case in cases]

    async def _case(self, case: EvalCase, adapter_id: str) -> CaseResult:
        if case.choices:
            scores = [await self._loglikelihood(case.prompt, choice, adapter_id) for choice in case.choices]
            return CaseResult(choice_logprobs=tuple(scores))
        if case.schema is not None:
            guided = GuidedSpec.json_schema(case.schema) if case.constrained else None
            sampling = SamplingParams(max_new_tokens=EVAL_SCHEMA_MAX_TOKENS, temperature=0.0, guided=guided)
        else:
            sampling = SamplingParams(max_new_tokens=EVAL_MAX_TOKENS, temperature=0.0)
        prompt = await self.ctx.tokens.encode(case.prompt)
        final = await self._final(prompt.ids, adapter_id, sampling)
        return CaseResult(text=final["text"])

    async def _loglikelihood(self, prompt: str, choice: str, adapter_id: str) -> float:
        """The sum of the logprobs of `choice`'s tokens after `prompt` (module docstring)."""
        context = await self.ctx.tokens.encode(prompt)
        whole = await self.ctx.tokens.encode(prompt + choice)
        tokens = len(whole.ids) + whole.truncated - len(context.ids) - context.truncated
        if not 0 < tokens < len(whole.ids):  # no token of its own, or none left after the cut
            return -math.inf
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
        final = await self._final(whole.ids, adapter_id, sampling)
        logprobs = (final.get("prompt_logprobs") or [])[-tokens:]
        if len(logprobs) != tokens or any(lp is None for lp in logprobs):
            return -math.inf
        return float(sum(lp.logprob for lp in logprobs))

    async def _final(self, prompt: list[int], adapter_id: str, sampling: SamplingParams) -> dict[str, Any]:
        path = self.ctx.models.adapter_path(adapter_id)
        job = GenerateJob(request_id=self.ctx.new_id("eval"), prompt=prompt, adapter_id=adapter_id,
                          sampling=sampling, stream=False, adapter_path=path,
                          priority_class=self.batch.name, priority=self.batch.priority)
        generation = await self.ctx.dispatcher.start(job, ROUTE)
        try:
            return await generation.final()
        except BaseException:
            generation.cancel()
            raise

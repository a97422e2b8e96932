"""The eval gate: an evaluation set, the score of one version on it, and whether a candidate stays
within the margin of the stable version before any client sees it.

An evaluation set is JSONL (one case a line; `eval.jsonl` beside the adapter in its source, or given
in the release request), at most `MAX_CASES` cases, each one of:
* `{"prompt": ..., "expected": ...}`: the greedy completion, stripped, must start with `expected`
  stripped (exact match of the expected answer);
* `{"prompt": ..., "choices": [...], "answer": i}`: the choice with the highest loglikelihood after
  the prompt must be choice `i` (choice accuracy);
* `{"prompt": ..., "schema": {...}}`: the completion must be a JSON document valid for the schema
  (schema-valid rate); it is generated under the schema's constraint unless the case adds
  `"constrained": false` (then the version must write a valid document by itself).

A version's score is the share of cases it passes (`score`). The candidate passes the gate when
its score is at least the stable version's minus `margin` (`compare`). Running the cases through
the engine (at `batch` priority) is the caller's; this module only reads the set and judges.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lora_cluster.errors import RequestError

MAX_CASES = 1000
MAX_CHOICES = 16
EVAL_FILE = "eval.jsonl"  # an adapter's evaluation set, beside its weights in its source


@dataclass(frozen=True)
class EvalCase:
    """One case of an evaluation set (module docstring); exactly one of `expected`, `choices`
    (with `answer`) and `schema` is set."""

    prompt: str
    expected: str | None = None
    choices: tuple[str, ...] = ()
    answer: int = 0
    schema: dict[str, Any] | None = None
    constrained: bool = True  # a schema case's completion is generated under the schema's constraint

    @property
    def kind(self) -> str:
        return "expected" if self.expected is not None else "choices" if self.choices else "schema"


@dataclass(frozen=True)
class CaseResult:
    """What a version produced for one case: its completion, or the loglikelihood of each choice."""

    text: str = ""
    choice_logprobs: tuple[float, ...] = ()


def parse_eval_set(lines: Iterable[str], max_cases: int = MAX_CASES) -> list[EvalCase]:
    """The cases of a JSONL evaluation set; RequestError naming the line that is not a valid case."""
    cases: list[EvalCase] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(cases) >= max_cases:
            raise RequestError(f"the evaluation set has more than {max_cases} cases")
        try:
            cases.append(_case(json.loads(line)))
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestError(f"evaluation set line {number}: {exc}") from None
    if not cases:
        raise RequestError("the evaluation set has no case")
    return cases


def _case(d: Any) -> EvalCase:
    if not isinstance(d, dict) or not isinstance(d.get("prompt"), str):
        raise ValueError("a case is an object with a string `prompt`")
    kinds = [k for k in ("expected", "choices", "schema") if k in d]
    if len(kinds) != 1:
        raise ValueError("a case has exactly one of `expected`, `choices` and `schema`")
    if kinds[0] == "expected":
        return EvalCase(d["prompt"], expected=str(d["expected"]))
    if kinds[0] == "schema":
        if not isinstance(d["schema"], dict):
            raise ValueError("`schema` is a JSON schema object")
        constrained = d.get("constrained", True)
        if not isinstance(constrained, bool):
            raise ValueError("`constrained` is true or false")
        return EvalCase(d["prompt"], schema=d["schema"], constrained=constrained)
    choices, answer = d["choices"], d.get("answer")
    if (not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) for c in choices)):
        raise ValueError(f"`choices` is a list of 2 to {MAX_CHOICES} strings")
    if not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError("`answer` is the index of the right choice")
    return EvalCase(d["prompt"], choices=tuple(choices), answer=answer)


SchemaCheck = Callable[[dict[str, Any], Any], bool]  # (schema, parsed JSON document) -> valid


def passes(case: EvalCase, result: CaseResult, schema_valid: SchemaCheck) -> bool:
    """Whether one version's result passes one case."""
    if case.expected is not None:
        return result.text.strip().startswith(case.expected.strip())
    if case.choices:
        logprobs = result.choice_logprobs
        if len(logprobs) != len(case.choices):
            return False
        best = max(range(len(logprobs)), key=logprobs.__getitem__)
        return best == case.answer and math.isfinite(logprobs[best])
    try:
        document = json.loads(result.text)
    except ValueError:
        return False
    return case.schema is not None and schema_valid(case.schema, document)


def score(cases: Sequence[EvalCase], results: Sequence[CaseResult], schema_valid: SchemaCheck) -> float:
    """The share of cases a version passes (its results in the cases' order)."""
    if len(cases) != len(results):
        raise ValueError(f"{len(results)} results for {len(cases)} cases")
    return sum(passes(c, r, schema_valid) for c, r in zip(cases, results, strict=True)) / len(cases)


@dataclass(frozen=True)
class EvalVerdict:
    passed: bool
    reason: str
    evidence: dict[str, Any]


def compare(stable_score: float, candidate_score: float, margin: float, cases: int) -> EvalVerdict:
    """The eval gate: the candidate may score at most `margin` below the stable version."""
    evidence = {"stable_score": round(stable_score, 4), "candidate_score": round(candidate_score, 4),
                "margin": margin, "cases": cases}
    if candidate_score + margin < stable_score:
        return EvalVerdict(False, f"the candidate scores {candidate_score:.3f} on the evaluation set, more "
                           f"than {margin} below the stable version's {stable_score:.3f}", evidence)
    return EvalVerdict(True, "the candidate is within the eval margin", evidence)

"""The eval gate: an evaluation set of three kinds of cases is read with its errors named by line,
each version is scored on it, and a candidate more than the margin below the stable version is
refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lora_cluster.errors import RequestError
from lora_cluster.releases.eval_gate import CaseResult, compare, parse_eval_set, passes, score


def schema_valid(schema, document) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(document)


EVAL_SET = [
    json.dumps({"prompt": "2+2=", "expected": "4"}),
    json.dumps({"prompt": "The sky is", "choices": ["green", "blue"], "answer": 1}),
    json.dumps({"prompt": "Rate it", "schema": {"type": "object", "required": ["score"],
                                                 "properties": {"score": {"type": "integer"}}}}),
    "",
]


def test_an_evaluation_set_has_three_kinds_of_cases():
    cases = parse_eval_set(EVAL_SET)
    assert [c.kind for c in cases] == ["expected", "choices", "schema"], "each line is one case; blanks skip"


@pytest.mark.parametrize("line, error", [
    ("not json", "line 1"),
    (json.dumps({"expected": "4"}), "string `prompt`"),
    (json.dumps({"prompt": "p", "expected": "4", "schema": {}}), "exactly one"),
    (json.dumps({"prompt": "p", "choices": ["a"], "answer": 0}), "2 to 16 strings"),
    (json.dumps({"prompt": "p", "choices": ["a", "b"], "answer": 2}), "index of the right choice"),
])
def test_a_bad_case_is_refused_with_its_line(line, error):
    with pytest.raises(RequestError, match=error):
        parse_eval_set([line])


def test_an_evaluation_set_is_bounded_and_not_empty():
    with pytest.raises(RequestError, match="more than 2 cases"):
        parse_eval_set([EVAL_SET[0]] * 3, max_cases=2)
    with pytest.raises(RequestError, match="no case"):
        parse_eval_set(["", " "])


def test_each_kind_of_case_is_judged():
    expected, choices, schema = parse_eval_set(EVAL_SET)
    assert passes(expected, CaseResult(text=" 4, of course"), schema_valid), "the answer first passes"
    assert not passes(expected, CaseResult(text="5"), schema_valid), "another answer fails"
    assert passes(choices, CaseResult(choice_logprobs=(-3.0, -0.5)), schema_valid), "the likeliest is right"
    assert not passes(choices, CaseResult(choice_logprobs=(-0.1, -0.5)), schema_valid), "else it fails"
    assert passes(schema, CaseResult(text='{"score": 3}'), schema_valid), "a valid document passes"
    assert not passes(schema, CaseResult(text='{"score": "x"}'), schema_valid), "an invalid one fails"
    assert not passes(schema, CaseResult(text="{oops"), schema_valid), "and so does text that is not JSON"


def test_a_candidate_below_the_margin_is_refused():
    cases = parse_eval_set(EVAL_SET)
    good = [CaseResult(text="4"), CaseResult(choice_logprobs=(-3.0, -0.5)), CaseResult(text='{"score": 1}')]
    random_weights = [CaseResult(text="zq"), CaseResult(choice_logprobs=(-0.2, -0.5)), CaseResult(text="{")]
    stable = score(cases, good, schema_valid)
    assert stable == 1.0, "the stable version passes every case"
    assert compare(stable, score(cases, good, schema_valid), 0.05, 3).passed, "a close candidate passes"
    verdict = compare(stable, score(cases, random_weights, schema_valid), 0.05, 3)
    assert not verdict.passed, "a candidate that fails every case is refused"
    assert verdict.evidence["candidate_score"] == 0.0, "with its score as evidence"


def test_a_schema_case_is_constrained_unless_it_says_otherwise():
    schema = {"type": "object"}
    default, free = parse_eval_set([json.dumps({"prompt": "p", "schema": schema}),
                                    json.dumps({"prompt": "p", "schema": schema, "constrained": False})])
    assert default.constrained, "a schema case runs under its schema's constraint by default"
    assert not free.constrained, "`constrained: false` lets the version write the document by itself"
    with pytest.raises(RequestError, match="`constrained` is true or false"):
        parse_eval_set([json.dumps({"prompt": "p", "schema": schema, "constrained": "no"})])


def test_a_choice_no_version_could_score_never_passes():
    (choices,) = parse_eval_set([json.dumps({"prompt": "p", "choices": ["a", "b"], "answer": 0})])
    unscored = CaseResult(choice_logprobs=(float("-inf"), float("-inf")))
    assert not passes(choices, unscored, schema_valid), "a case whose choices all scored -inf fails"

"""200 seeded random JSON schemas (tests/random_schemas.py: nested objects, arrays with minItems/maxItems,
enums, bounded integers and numbers, strings, required fields, anyOf), decoded greedily by the engine in
continuous batches over five adapters and the base model.

- every output that the grammar ended validates against its schema with `jsonschema`; the outputs cut by
  `max_tokens` end with `length`, never an error, and are prefixes the grammar accepts; most complete;
- the mask changes nothing it need not: wherever the model's own greedy token after a constrained prefix
  is one the grammar allows, the constrained output holds it (teacher forcing, every STRIDE-th position).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

import jsonschema
import pytest
from random_schemas import random_schema

from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.request.guided_spec import GuidedSpec
from lora_cluster.request.output import RequestOutput

pytestmark = pytest.mark.usefixtures("torch_one_thread")

NUM_SCHEMAS = 200
MAX_TOKENS = 96  # the random model indents and fills strings: most outputs complete within this
STRIDE = 4  # teacher-forced probes: every STRIDE-th position of each output
ADAPTERS = [None, "a0", "a1", "a2", "a3"]
SCHEMAS = [random_schema(rng) for rng in [random.Random(23)] for _ in range(NUM_SCHEMAS)]
PROMPTS = [f"Record {i}:" for i in range(NUM_SCHEMAS)]


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Iterator[Engine]:
    engine = make_engine(max_num_seqs=32)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def outputs(engine: Engine) -> list[RequestOutput]:
    params = [SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0, guided=GuidedSpec.json_schema(s))
              for s in SCHEMAS]  # fmt: skip
    return engine.generate(PROMPTS, [ADAPTERS[i % len(ADAPTERS)] for i in range(NUM_SCHEMAS)], params)


def test_the_generated_schemas_are_valid_and_varied() -> None:
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    text = json.dumps(SCHEMAS)
    for construct in ('"anyOf"', '"enum"', '"minItems"', '"maximum"', '"required"', '"pattern"', '"number"'):
        assert text.count(construct) >= 10, f"the schemas use {construct} ({text.count(construct)} times)"


def test_every_output_the_grammar_ended_validates(outputs: list[RequestOutput]) -> None:
    for i, (schema, out) in enumerate(zip(SCHEMAS, outputs, strict=True)):
        assert out.error is None, f"schema {i}: no error, got {out.error!r}"
        if out.finish_reason == "length":
            continue
        assert out.finish_reason in ("stop", "eos"), f"schema {i}: ended by grammar, {out.finish_reason}"
        value = json.loads(out.text)
        errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
        assert not errors, f"schema {i}: {out.text!r} fails {json.dumps(schema)}: {errors}"


def test_most_outputs_complete_and_the_rest_are_valid_prefixes(
    engine: Engine, outputs: list[RequestOutput]
) -> None:
    cut = [i for i, out in enumerate(outputs) if out.finish_reason == "length"]
    assert len(cut) <= NUM_SCHEMAS // 5, f"at least 80% complete within {MAX_TOKENS} tokens; cut: {len(cut)}"
    for i in cut:
        matcher = engine.grammars.compile(GuidedSpec.json_schema(SCHEMAS[i])).future.result().matcher()
        assert matcher.consume_tokens(outputs[i].token_ids), f"schema {i}: a cut output is a valid prefix"
        assert len(outputs[i].token_ids) == MAX_TOKENS, f"schema {i}: cut exactly at max_tokens"


def test_the_mask_changes_nothing_it_need_not(engine: Engine, outputs: list[RequestOutput]) -> None:
    """Teacher forcing at every `STRIDE`-th position of each output: wherever the model's free greedy
    token after the constrained prefix is one the grammar allows (and not a near tie of its top two),
    the constrained output holds that token."""
    probes = [(i, j) for i, out in enumerate(outputs) for j in range(0, len(out.token_ids), STRIDE)]
    prefixes = [engine.tokenize(PROMPTS[i]) + outputs[i].token_ids[:j] for i, j in probes]
    free = engine.generate(prefixes, [ADAPTERS[i % len(ADAPTERS)] for i, _ in probes],
                           SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=1))
    by_schema: dict[int, list[tuple[int, RequestOutput]]] = {}
    for (i, j), out in zip(probes, free, strict=True):
        by_schema.setdefault(i, []).append((j, out))
    fitted = 0
    for i, probed in by_schema.items():
        tokens = outputs[i].token_ids
        matcher = engine.grammars.compile(GuidedSpec.json_schema(SCHEMAS[i])).future.result().matcher()
        done = 0
        for j, out in probed:
            assert matcher.consume_tokens(tokens[done:j]), f"schema {i}: the output is allowed"
            done = j
            token, top = out.token_ids[0], (out.logprobs or [])[0].top
            near_tie = len(top) > 1 and top[0][1] - top[1][1] < 1e-4
            if near_tie or matcher.validate_tokens([token]) != 1:
                continue
            fitted += 1
            assert tokens[j] == token, f"schema {i}, position {j}: the model's own token {token} is allowed"
    assert fitted >= 30, f"precondition: the model's own token was allowed at {fitted} probed positions"

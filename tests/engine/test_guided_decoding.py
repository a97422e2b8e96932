"""Constrained decoding in the engine: JSON schema, JSON object, regex, choice and grammar constraints in
mixed continuous batches (constrained and free rows, several adapters) on the demo zoo's random model.

Its text is gibberish; the structure is what the tests check: a constrained output that ended by its
grammar (finish_reason stop or eos) matches the constraint in full, one cut by max_tokens is a prefix the
grammar accepts, and a free row is what it is alone."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
from helpers import greedy

from lora_cluster.config import EngineConfig
from lora_cluster.engine import AsyncEngine, Engine, SamplingParams
from lora_cluster.engine.sample.grammar_compiler import CompiledGrammar, GrammarCompiler, grammar_tokenizer
from lora_cluster.errors import RequestError
from lora_cluster.request.guided_spec import GuidedSpec
from lora_cluster.request.output import RequestOutput

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "score": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "tags", "score"],
    "additionalProperties": False,
}
INVOICE_REGEX = r"(INV|PO)-[0-9]{4,8}"
LARK = 'start: NUM "+" NUM "=" NUM\nNUM: /[0-9]{1,3}/'
LARK_TEXT = r"[0-9]{1,3}\+[0-9]{1,3}=[0-9]{1,3}"
GBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
GBNF_TEXT = r"(yes|no) [0-9][0-9]?"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Iterator[Engine]:
    engine = make_engine(max_num_seqs=16)
    yield engine
    engine.close()


def constrained(spec: GuidedSpec, max_new_tokens: int = 120, **params: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **{"temperature": 0.0, **params}, guided=spec)


def compiled(engine: Engine, spec: GuidedSpec) -> CompiledGrammar:
    """The engine's compiled grammar of `spec` (waits for the compile)."""
    entry = engine.grammars.compile(spec)
    return entry.future.result(timeout=60)


def accepts_prefix(engine: Engine, spec: GuidedSpec, token_ids: list[int]) -> bool:
    """Every token of `token_ids`, in order, is one the grammar allows."""
    matcher = compiled(engine, spec).matcher()
    return all(matcher.consume_token(t) for t in token_ids)


def matches(spec: GuidedSpec, text: str) -> bool:
    """`text` satisfies the constraint in full."""
    if spec.kind.value in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        schema = json.loads(spec.text) if spec.text else {"type": "object"}
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    if spec.kind.value == "choice":
        return text in spec.choices
    pattern = {INVOICE_REGEX: INVOICE_REGEX, LARK: LARK_TEXT, GBNF: GBNF_TEXT}.get(spec.text, spec.text)
    return re.fullmatch(pattern, text) is not None


def check_output(engine: Engine, spec: GuidedSpec, out: RequestOutput) -> None:
    """A finished constrained output: complete and valid, or cut by its length and a valid prefix."""
    assert out.error is None, f"{out.request_id}: no error, got {out.error}"
    if out.finish_reason == "length":
        assert accepts_prefix(engine, spec, out.token_ids), f"{out.request_id}: cut, and a valid prefix"
    else:
        assert out.finish_reason in ("stop", "eos"), f"{out.request_id}: ended: {out.finish_reason}"
        assert matches(spec, out.text), f"{out.request_id}: {out.text!r} satisfies {spec.kind.value}"


# ----- one mixed batch -----------------------------------------------------------------------------

MIXED: list[tuple[str, str | None, SamplingParams]] = [
    ("The person record", "a0", constrained(GuidedSpec.json_schema(PERSON))),
    ("Another person", "a1", constrained(GuidedSpec.json_schema(PERSON), temperature=0.9, seed=7)),
    ("Some object", "a2", constrained(GuidedSpec.json_object(), max_new_tokens=160)),
    ("The invoice number", "a3", constrained(GuidedSpec.regex(INVOICE_REGEX))),
    ("An order number", None, constrained(GuidedSpec.regex(INVOICE_REGEX), temperature=1.0, seed=3)),
    ("The sentiment", "a1", constrained(GuidedSpec.choice(CHOICES))),
    ("Add two numbers", "a0", constrained(GuidedSpec.grammar(LARK))),
    ("Yes or no", None, constrained(GuidedSpec.grammar(GBNF), temperature=0.8, seed=11)),
    ("Free text one", "a0", greedy(12)),
    ("Free text two", "a2", greedy(12)),
    ("Free text three", None, SamplingParams(max_new_tokens=12, temperature=0.7, seed=5, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def mixed(engine: Engine) -> list[RequestOutput]:
    prompts, adapters, params = zip(*MIXED, strict=True)
    return engine.generate(list(prompts), list(adapters), list(params))


@pytest.mark.parametrize("row", [i for i, (_, _, p) in enumerate(MIXED) if p.guided is not None])
def test_every_constrained_row_of_a_mixed_batch_matches_its_constraint(
    engine: Engine, mixed: list[RequestOutput], row: int
) -> None:
    spec = MIXED[row][2].guided
    assert spec is not None
    out = mixed[row]
    check_output(engine, spec, out)
    if spec.kind.value != "json_object":  # every other constraint here bounds its output's length
        assert out.finish_reason in ("stop", "eos"), f"row {row} ({spec.kind.value}) completed: {out.text!r}"


def test_free_rows_of_a_mixed_batch_are_what_they_are_alone(
    engine: Engine, mixed: list[RequestOutput]
) -> None:
    free = [i for i, (_, _, p) in enumerate(MIXED) if p.guided is None]
    prompts, adapters, params = zip(*(MIXED[i] for i in free), strict=True)
    alone = engine.generate(list(prompts), list(adapters), list(params))
    for i, out in zip(free, alone, strict=True):
        assert mixed[i].token_ids == out.token_ids, f"free row {i}: constrained neighbours change nothing"


def test_greedy_constrained_tokens_are_the_model_choice_where_the_grammar_allows_it(engine: Engine) -> None:
    """Teacher forcing: at each position of a greedy constrained output, the unconstrained greedy token
    for the same prefix is taken whenever the grammar allows it (the mask changes nothing it need not)."""
    cases = [("The person record", "a0", GuidedSpec.json_schema(PERSON)),
             ("Add two numbers", "a0", GuidedSpec.grammar(LARK)),
             ("The sentiment", "a1", GuidedSpec.choice(CHOICES)),
             ("Plain words", "a2", GuidedSpec.regex("[a-zA-Z ,.]{1,24}"))]
    allowed_positions = 0
    for prompt, adapter, spec in cases:
        out = engine.generate([prompt], [adapter], constrained(spec))[0]
        prefix = engine.tokenize(prompt)
        forced = engine.generate([prefix + out.token_ids[:i] for i in range(len(out.token_ids))],
                                 [adapter] * len(out.token_ids), greedy(1, logprobs=1))
        matcher = compiled(engine, spec).matcher()
        for i, (token, free) in enumerate(zip(out.token_ids, forced, strict=True)):
            top = free.logprobs[0].top
            tie = len(top) > 1 and top[0][1] - top[1][1] < 1e-4
            if not tie and matcher.validate_tokens([free.token_ids[0]]) == 1:
                allowed_positions += 1
                assert token == free.token_ids[0], (
                    f"{spec.kind.value} position {i}: the model's own token is allowed, so it is taken")
            assert matcher.consume_token(token), f"position {i}: the output is what the grammar allows"
    assert allowed_positions >= 5, f"precondition: the model's token was allowed {allowed_positions} times"


# ----- how a constrained request ends --------------------------------------------------------------


def test_max_tokens_before_the_grammar_completes_is_length_not_an_error(engine: Engine) -> None:
    spec = GuidedSpec.json_schema(PERSON)
    out = engine.generate(["Cut short"], ["a0"], constrained(spec, max_new_tokens=5))[0]
    assert (out.finish_reason, out.error) == ("length", None), "max_tokens ends it with length"
    assert accepts_prefix(engine, spec, out.token_ids), "what was generated is a prefix the grammar accepts"


def test_a_complete_grammar_stops_without_an_end_of_sequence_token(engine: Engine) -> None:
    out = engine.generate(["Pick one"], ["a2"], constrained(GuidedSpec.choice(["positive", "negative"])))[0]
    assert out.finish_reason == "stop", f"the grammar's completion is a stop: {out.finish_reason}"
    assert out.text in ("positive", "negative"), f"the text is one of the choices: {out.text!r}"
    assert not set(out.token_ids) & engine.eos_token_ids, "no end-of-sequence token was generated"


def test_end_of_sequence_is_allowed_only_where_the_grammar_accepts(engine: Engine) -> None:
    eos = min(engine.eos_token_ids)
    spec = GuidedSpec.regex("[a-z]{3,6}")
    out = engine.generate(["Short word"], ["a1"], constrained(spec, logit_bias={eos: 100.0}))[0]
    assert out.finish_reason == "eos", f"EOS, favoured by the bias, ends it once allowed: {out.finish_reason}"
    assert re.fullmatch("[a-z]{3,6}", out.text), f"it was not allowed before 3 letters: {out.text!r}"


def test_a_stop_string_inside_constrained_output_stops_it(engine: Engine) -> None:
    out = engine.generate(["Greet"], [None], constrained(GuidedSpec.regex("hello world"), stop=["world"]))[0]
    assert (out.finish_reason, out.text) == ("stop", "hello "), "the stop string cuts the constrained text"


def test_the_grammar_wins_when_the_controls_forbid_every_allowed_token(engine: Engine) -> None:
    (token_a,) = engine.tokenize([engine.tokenizer.convert_tokens_to_ids("a")])
    params = constrained(GuidedSpec.regex("a"), stop_token_ids=[token_a], min_tokens=3)
    out = engine.generate(["Letter"], ["a0"], params)[0]
    assert out.error is None and out.token_ids == [token_a], f"the only allowed token is taken: {out}"


def test_logprobs_are_those_of_the_masked_distribution(engine: Engine) -> None:
    spec = GuidedSpec.choice(CHOICES)
    out = engine.generate(["Sentiment"], ["a3"], constrained(spec, logprobs=20))[0]
    matcher = compiled(engine, spec).matcher()
    for lp in out.logprobs or []:
        finite = {tid: v for tid, v in lp.top if v != float("-inf")}
        allowed = {tid for tid, _ in lp.top if matcher.validate_tokens([tid]) == 1}
        assert set(finite) == allowed, "the alternatives with a probability are the tokens the grammar allows"
        if len(finite) < len(lp.top):  # every allowed token is listed: their probabilities sum to 1
            total = sum(2.718281828459045**v for v in finite.values())
            assert abs(total - 1) < 1e-4, f"the masked distribution sums to 1 over allowed tokens: {total}"
        matcher.consume_token(lp.token_id)
    assert out.logprobs, "logprobs were returned"


def test_seeded_sampling_gives_valid_outputs_whatever_shares_the_batch(engine: Engine) -> None:
    spec = GuidedSpec.json_schema(PERSON)
    params = [constrained(spec, temperature=1.0, top_p=0.9, top_k=40, seed=s) for s in range(4)]
    batch = engine.generate([f"Person {s}" for s in range(4)], ["a0", "a1", "a2", None], params)
    for out in batch:
        check_output(engine, spec, out)
    assert sum(o.finish_reason != "length" for o in batch) >= 3, "most seeded outputs complete"
    alone = engine.generate(["Person 2"], ["a2"], params[2])[0]
    assert alone.token_ids == batch[2].token_ids, "a seeded constrained request is reproducible"


def test_a_preempted_constrained_sequence_resumes_where_it_was(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_num_seqs=1)
    try:
        spec = GuidedSpec.json_schema(PERSON)
        reference = engine.generate(["Preempt me"], ["a1"], constrained(spec))[0]
        engine.add_request("low", "Preempt me", "a1", constrained(spec), priority=5)
        got: dict[str, RequestOutput] = {}
        for _ in range(200):
            got.update({o.request_id: o for o in engine.step()})
            if len(got.get("low", reference).token_ids or []) >= 4 and "low" in got:
                break
        assert 4 <= len(got["low"].token_ids) < len(reference.token_ids), "precondition: preempted mid-way"
        engine.add_request("urgent", "Urgent", "a2", greedy(4), priority=0)
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            got.update({o.request_id: o for o in engine.step()})
        low = got["low"]
        assert low.num_preemptions >= 1, "the constrained request was preempted by the urgent one"
        assert low.token_ids == reference.token_ids, "its output is the one it gives without preemption"
        check_output(engine, spec, low)
    finally:
        engine.close()


# ----- refusals, compile bound, waiting and abort --------------------------------------------------

REFUSED = [
    (GuidedSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (GuidedSpec.json_schema({"type": "string", "not": {"const": "x"}}), "not"),
    (GuidedSpec.json_schema({"type": "strong"}), "strong"),
    (GuidedSpec.json_schema({"type": "string", "format": "hostnamex"}), "hostnamex"),
    (GuidedSpec.regex("(ab"), "unclosed group"),
    (GuidedSpec.grammar("start: foo"), "foo"),
]


@pytest.mark.parametrize(("spec", "construct"), REFUSED, ids=[c for _, c in REFUSED])
def test_an_unsupported_or_invalid_constraint_is_a_request_error_naming_it(
    engine: Engine, spec: GuidedSpec, construct: str
) -> None:
    bad, good = engine.generate(["Bad", "Good"], ["a0", "a0"], [constrained(spec), greedy(4)])
    assert isinstance(bad.error, RequestError), f"a RequestError (400), got {bad.error!r}"
    assert construct in str(bad.error), f"the error names {construct!r}: {bad.error}"
    assert (bad.finish_reason, bad.token_ids) == ("error", []), "nothing was generated for it"
    assert (good.error, len(good.token_ids)) == (None, 4), "the other request of the batch is served"


def test_the_async_engine_raises_the_refusal_before_any_output(make_engine: Callable[..., Engine]) -> None:
    async def run() -> list[RequestOutput]:
        front = AsyncEngine(make_engine())  # its shutdown closes the engine
        try:
            return [o async for o in front.generate("Bad", "a0", constrained(REFUSED[0][0]))]
        finally:
            front.shutdown()

    with pytest.raises(RequestError, match="uniqueItems"):
        asyncio.run(run())


def test_a_compile_longer_than_the_bound_is_refused_naming_it(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(guided_compile_timeout_s=1e-6)
    try:
        out = engine.generate(["Slow"], ["a0"], constrained(GuidedSpec.json_schema(PERSON)))[0]
        again = engine.generate(["Slow"], ["a1"], constrained(GuidedSpec.json_schema(PERSON)))[0]
    finally:
        engine.close()
    assert isinstance(out.error, RequestError), f"a RequestError (400), got {out.error!r}"
    assert "guided_compile_timeout_s" in str(out.error), f"the error names the bound: {out.error}"
    assert str(again.error) == str(out.error), "the same constraint is refused again (cached refusal)"


def test_the_compile_bound_is_configurable_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORA_CLUSTER_GUIDED_COMPILE_TIMEOUT_S", "0.25")
    monkeypatch.setenv("LORA_CLUSTER_GUIDED_GRAMMAR_CACHE_SIZE", "7")
    config = EngineConfig(model="demo")
    assert (config.guided_compile_timeout_s, config.guided_grammar_cache_size) == (0.25, 7), "env overrides"


@pytest.fixture
def held(make_engine: Callable[..., Engine]) -> Iterator[tuple[Engine, threading.Event]]:
    """An engine whose grammar tokenizer is built only once the event is set (compiles wait for it)."""
    engine = make_engine(max_num_seqs=4)
    release = threading.Event()
    build = grammar_tokenizer(engine.tokenizer, engine.model.dims.vocab_size, engine.eos_token_ids)

    def gated() -> Any:
        release.wait(120)
        return build

    engine.grammars = GrammarCompiler(gated, cache_size=8, timeout_s=30)
    yield engine, release
    release.set()
    engine.close()


def test_a_request_waiting_for_its_grammar_holds_up_nobody(held: tuple[Engine, threading.Event]) -> None:
    engine, release = held
    spec = GuidedSpec.choice(CHOICES)
    engine.add_request("constrained", "Wait", "a0", constrained(spec))
    engine.add_request("free", "Go", "a1", greedy(6))
    got: dict[str, RequestOutput] = {}
    for _ in range(500):
        got.update({o.request_id: o for o in engine.step()})
        if got.get("free") and got["free"].finished:
            break
    assert got["free"].finished and len(got["free"].token_ids) == 6, "the free request ran to its end"
    assert "constrained" not in got and engine.stats().num_waiting == 1, "the constrained one still waits"
    release.set()
    for _ in range(500):
        got.update({o.request_id: o for o in engine.step()})
        if got.get("constrained") and got["constrained"].finished:
            break
    assert got["constrained"].text in CHOICES, "once compiled it runs: " + repr(got["constrained"].text)


def test_an_abort_while_compiling_gives_everything_back(held: tuple[Engine, threading.Event]) -> None:
    engine, release = held
    spec = GuidedSpec.json_schema(PERSON)
    engine.add_request("c", "Abort me", "a2", constrained(spec))
    engine.step()
    out = engine.abort("c")
    assert out is not None and out.finish_reason == "abort", "the waiting request ends as aborted"
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, engine.pool.refs("a2")) == (0, 0, 0), "nothing is held"
    assert not engine.has_unfinished(), "the engine has nothing left to run"
    release.set()
    after = engine.generate(["Abort me"], ["a2"], constrained(spec))[0]
    check_output(engine, spec, after)


def test_compiles_are_cached_per_spec_and_bounded(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(guided_grammar_cache_size=2)
    try:
        engine.generate(["Free"], [None], greedy(2))
        assert engine.grammars.tokenizer_build_s is None, "unconstrained requests never build its tokenizer"
        specs = [GuidedSpec.regex("[ab]{2}"), GuidedSpec.regex("[ab]{2}"), GuidedSpec.choice(["x", "y"])]
        engine.generate(["1", "2", "3"], ["a0", "a1", None], [constrained(s) for s in specs])
        assert engine.grammars.cached() == 2, "two distinct specs, two cache entries"
        engine.generate(["4"], ["a0"], constrained(GuidedSpec.regex("[cd]{2}")))
        assert engine.grammars.cached() == 2, "the cache holds at most guided_grammar_cache_size entries"
        assert engine.grammars.tokenizer_build_s is not None, "the first constrained request built it"
    finally:
        engine.close()


def test_properties_come_in_the_schema_order(engine: Engine) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}}
    out = engine.generate(["Order"], ["a3"], constrained(GuidedSpec.json_schema(schema)))[0]
    assert (out.error, out.finish_reason) == (None, "stop"), f"the output completes: {out}"
    keys = list(json.loads(out.text))
    assert keys == ["zeta", "alpha"], f"the output writes the properties in the client's order: {out.text!r}"

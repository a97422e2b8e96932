"""Constrained-decoding libraries compared on this machine: compile time, mask time, JSON-schema support.

Candidates: xgrammar, llguidance and outlines-core (whichever are installed; a missing one is named
in the output). Vocabularies: byte-level BPEs of `--vocab` sizes (default 32000 and 151936, Qwen2's
size), built offline: the demo zoo's trained BPE (`lora_cluster.demo.train_tokenizer("base")`, 8000
tokens of English-like words) extended with synthetic merges: JSON punctuation runs (`{"`, `":`,
`"},`), digit runs, and word continuations of the trained tokens, until the vocabulary has the
requested size. Every candidate gets the same transformers tokenizer.

Per library and vocabulary:
- setup: building the library's tokenizer view (once per vocabulary and process);
- compile: each realistic JSON schema (nested objects, arrays, enums, bounded numbers, anyOf,
  $ref/$defs, Optional), JSON-object mode, a regex and a choice list (best of `--repeats`, with the
  library's cache off or a fresh compiler, so every compile is a cold one);
- mask: the next-token bitmask (int32 words, the format every candidate writes, applied to the
  logits by the same kernel) per token while the document a valid instance tokenizes to is fed
  token by token: first token, p50 and p99 over all tokens. Each document token is checked to be in
  the mask, so a figure comes only from a grammar that accepts the valid document;
- support: JSON-schema constructs, each in a small schema, compiled: the error (`raises`), or, when
  it compiles, whether an instance that only this construct makes invalid is refused (`enforced`)
  or accepted to the end (`accepted, ignored`: the library silently drops the construct).

Single-threaded (the machine's cores are shared): torch, xgrammar's compiler (`max_threads=1`) and
llguidance (`RAYON_NUM_THREADS=1`).

Run: python benchmarks/bench_grammar.py [--vocab 32000 151936] [--repeats 2] [--out docs/bench_grammar.txt]
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import importlib.metadata
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import machine, percentile

from lora_cluster.demo import train_tokenizer

PUNCT = '{}[]":,. -0123456789'  # JSON structure, numbers and the byte-level space is mapped below
REGEX = r"(INV|PO)-[0-9]{4,8}( \((paid|open|void)\))?"
REGEX_DOC = "INV-20240917 (paid)"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]

SCHEMAS: dict[str, dict[str, Any]] = {
    "invoice (nested, array of objects, enum, bounds)": {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "maxLength": 32},
            "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                       "zip": {"type": "string", "minLength": 4, "maxLength": 10}},
                        "required": ["street", "city", "zip"],
                    },
                },
                "required": ["name", "address"],
            },
            "lines": {
                "type": "array", "minItems": 1, "maxItems": 50,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"},
                                   "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                                   "unit_price": {"type": "number", "minimum": 0}},
                    "required": ["sku", "quantity", "unit_price"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["invoice_id", "currency", "customer", "lines", "paid"],
    },
    "classification (enum, bounded number, maxLength)": {
        "type": "object",
        "properties": {
            "label": {"enum": ["billing", "shipping", "returns", "technical", "account", "fraud",
                               "feedback", "sales", "legal", "other"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "rationale": {"type": "string", "maxLength": 200},
        },
        "required": ["label", "confidence", "rationale"],
    },
    "event (anyOf of objects, const, array bounds)": {
        "type": "object",
        "properties": {
            "timestamp": {"type": "integer", "minimum": 0},
            "payload": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                                  "y": {"type": "integer"}}, "required": ["kind", "x", "y"]},
                {"type": "object", "properties": {"kind": {"const": "key"}, "key": {"type": "string"}},
                 "required": ["kind", "key"]},
            ]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        },
        "required": ["timestamp", "payload", "tags"],
    },
    "person (pydantic: $defs/$ref, Optional, list of refs)": {
        "$defs": {
            "Address": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "country": {"type": "string"}},
                        "required": ["city", "country"], "title": "Address"},
        },
        "type": "object", "title": "Person",
        "properties": {
            "name": {"type": "string", "title": "Name"},
            "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}]},
            "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "addresses": {"type": "array", "items": {"$ref": "#/$defs/Address"}},
        },
        "required": ["name", "age", "email", "addresses"],
    },
}

DOCUMENTS: dict[str, Any] = {
    "invoice (nested, array of objects, enum, bounds)": {
        "invoice_id": "INV-2024-0917", "currency": "EUR",
        "customer": {"name": "Acme Trading GmbH",
                     "address": {"street": "Hauptstrasse 12", "city": "Berlin", "zip": "10115"}},
        "lines": [{"sku": "A-100", "quantity": 3, "unit_price": 19.99},
                  {"sku": "B-220", "quantity": 12, "unit_price": 4.5},
                  {"sku": "C-7", "quantity": 1, "unit_price": 249.0}],
        "paid": False,
    },
    "classification (enum, bounded number, maxLength)": {
        "label": "shipping", "confidence": 0.87,
        "rationale": "The customer asks where the parcel is and when it will arrive.",
    },
    "event (anyOf of objects, const, array bounds)": {
        "timestamp": 1733068800, "payload": {"kind": "key", "key": "Enter"}, "tags": ["ui", "form", "submit"],
    },
    "person (pydantic: $defs/$ref, Optional, list of refs)": {
        "name": "Ada Lovelace", "age": 36, "email": None,
        "addresses": [{"city": "London", "country": "UK"}, {"city": "Paris", "country": "France"}],
    },
}
JSON_OBJECT_DOC = {"result": {"items": [1, 2.5, "three", None, True], "note": "free-form object"}}

CONSTRUCTS: dict[str, dict[str, Any]] = {
    "string pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
    "string minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "integer minimum/maximum": {"type": "integer", "minimum": -5, "maximum": 500},
    "exclusiveMinimum/Maximum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "enum (mixed types)": {"enum": ["a", 1, None, True]},
    "const": {"const": "fixed"},
    "type list": {"type": ["string", "null"]},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}},
    "$ref/$defs": {"$defs": {"X": {"type": "integer"}}, "type": "object",
                   "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"]},
    "recursive $ref": {"$defs": {"Node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/Node"},
    "array minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "string"}}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "minProperties/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentRequired": {"a": ["b"]}},
}

INVALID: dict[str, Any] = {  # one instance per construct that the construct (alone) makes invalid
    "string pattern": "abc", "string minLength/maxLength": "a", "format date-time": "yesterday",
    "format email": "not an email", "format uuid": "xyz", "integer minimum/maximum": 501,
    "exclusiveMinimum/Maximum": 0, "multipleOf": 7, "enum (mixed types)": "b", "const": "other",
    "type list": 5, "anyOf": True, "oneOf": True, "allOf": {"a": 1}, "not": "s", "if/then/else": {},
    "$ref/$defs": {"x": "s"}, "recursive $ref": {"value": "s"}, "array minItems/maxItems": [1, 2, 3, 4],
    "uniqueItems": [1, 1], "prefixItems": [1, "a"], "contains": ["a"],
    "additionalProperties schema": {"k": "s"}, "patternProperties": {"x_a": 1},
    "propertyNames": {"A1": 1}, "minProperties/maxProperties": {}, "dependentRequired": {"a": "x"},
}


# ----- vocabularies -----------------------------------------------------------------------------


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE of exactly `vocab_size` tokens: the demo's trained BPE plus synthetic merges."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = train_tokenizer("base")
    data = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    as_pair = (lambda a, b: [a, b]) if merges and isinstance(merges[0], list) else (lambda a, b: f"{a} {b}")

    def add(a: str, b: str) -> bool:
        if a + b in vocab or a not in vocab or b not in vocab or len(vocab) >= vocab_size:
            return False
        vocab[a + b] = len(vocab)
        merges.append(as_pair(a, b))
        return True

    punct = [("Ġ" if c == " " else c) for c in PUNCT]
    for a in punct:  # two- and three-character JSON punctuation and digit runs
        for b in punct:
            add(a, b)
    for a in punct:
        for b in punct:
            for c in punct:
                add(a + b, c)
    rng = random.Random(seed)
    trained = [t for t in list(vocab) if len(t) > 1 and not any(ch in t for ch in "<>")]
    words = [t for t in trained if t.isalpha() or t.startswith("Ġ")]
    pieces = [t for t in trained if not t.startswith("Ġ")] or trained
    while len(vocab) < vocab_size:  # word continuations: an existing token + a trained piece
        a = rng.choice(words)
        b = rng.choice(pieces)
        if len(a) + len(b) <= 18 and add(a, b):
            words.append(a + b)
    if len(vocab) != vocab_size:
        raise RuntimeError(f"built {len(vocab)} tokens, not {vocab_size}")
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level map: printable bytes stand for themselves, the others for chars from 256."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def token_bytes(tokenizer) -> list[bytes]:
    """Each id's bytes (byte-level BPE: the GPT-2 byte-to-unicode map inverted); specials as b""."""
    inverse = {v: k for k, v in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = []
    for i in range(len(tokenizer)):
        tok = tokenizer.convert_ids_to_tokens(i)
        out.append(b"" if i in special else bytes(inverse[c] for c in tok))
    return out


# ----- the libraries, behind one small interface ------------------------------------------------


class Candidate:
    """compile(kind, spec) -> a grammar object; matcher(grammar) -> (fill(bitmask), accept(token))."""

    name = ""

    def version(self) -> str:
        return importlib.metadata.version(self.dist)


class XGrammar(Candidate):
    name, dist = "xgrammar", "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    def compile(self, kind: str, spec: Any):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "schema":
            return compiler.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec)
        return compiler.compile_grammar(ebnf)

    def matcher(self, grammar) -> tuple[Callable, Callable]:
        m = self.xgr.GrammarMatcher(grammar)
        return (lambda mask: m.fill_next_token_bitmask(mask)), m.accept_token

    def accepts(self, grammar, ids: list[int]) -> bool:
        m = self.xgr.GrammarMatcher(grammar)
        return all(m.accept_token(t) for t in ids) and m.accept_token(self.info.stop_token_ids[0])


class LLGuidance(Candidate):
    name, dist = "llguidance", "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, spec: Any):
        M = self.llg.LLMatcher
        if kind == "schema":
            grammar = M.grammar_from_json_schema(json.dumps(spec))
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        matcher = M(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, grammar) -> tuple[Callable, Callable]:
        fill = self.llg.torch.fill_next_token_bitmask

        def accept(token: int) -> bool:
            return grammar.consume_token(token)

        return (lambda mask: fill(grammar, mask, 0)), accept

    def accepts(self, grammar, ids: list[int]) -> bool:
        return all(grammar.consume_token(t) for t in ids) and grammar.is_accepting()


class OutlinesCore(Candidate):
    name, dist = "outlines-core", "outlines_core"

    def __init__(self, tokenizer, vocab_size: int):
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(tokenizer)):
            if b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, kind: str, spec: Any):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "schema":
            regex = build_regex_from_schema(json.dumps(spec))
        elif kind == "json_object":
            regex = build_regex_from_schema(json.dumps({"type": "object"}))
        elif kind == "regex":
            regex = spec
        else:
            regex = "(" + "|".join(c.replace(" ", "\\ ") for c in spec) + ")"
        return Index(regex, self.vocabulary)

    def matcher(self, grammar) -> tuple[Callable, Callable]:
        from outlines_core import Guide

        guide = Guide(grammar)

        def fill(mask: torch.Tensor) -> None:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

        def accept(token: int) -> bool:
            guide.advance(token, return_tokens=False)
            return True

        return fill, accept

    def accepts(self, grammar, ids: list[int]) -> bool:
        from outlines_core import Guide

        guide = Guide(grammar)
        for t in ids:
            if not guide.accepts_tokens([t]):
                return False
            guide.advance(t, return_tokens=False)
        return guide.is_finished()


LIBRARIES = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


# ----- measurements -----------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def best_compile(lib: Candidate, kind: str, spec: Any, repeats: int) -> tuple[float, Any]:
    best, grammar = float("inf"), None
    for _ in range(repeats):
        took, grammar = timed(lambda: lib.compile(kind, spec))
        best = min(best, took)
        if took > 1.0:  # a compile of seconds is not a timer's noise: once is enough on shared cores
            break
    return best, grammar


def mask_times(lib: Candidate, grammar, ids: list[int], vocab_size: int) -> list[float]:
    """Seconds per mask while feeding `ids`; raises if a document token is outside its mask."""
    fill, accept = lib.matcher(grammar)
    mask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    times = []
    for pos, token in enumerate(ids):
        took, _ = timed(lambda: fill(mask))
        times.append(took)
        word = int(mask[0, token // 32])
        if not (word >> (token % 32)) & 1:
            raise ValueError(f"valid document token {pos} (id {token}) is masked out")
        if accept(token) is False:
            raise ValueError(f"valid document token {pos} (id {token}) refused")
    return times


def us(values: list[float], q: float) -> str:
    """Quantile `q` of `values` (seconds) in whole microseconds, at the nearest rank."""
    return f"{percentile(values, q, 'nearest') * 1e6:.0f}"


def short_error(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"raises ({type(e).__name__}: {text[:70]})"


def run_vocab(vocab_size: int, names: list[str], repeats: int, out: list[str]) -> None:
    built, tokenizer = timed(lambda: build_tokenizer(vocab_size))
    out.append(f"\n## vocabulary {vocab_size} (tokenizer built in {built:.1f} s)\n")
    tasks: list[tuple[str, str, Any, str]] = [
        ("schema", n, s, json.dumps(DOCUMENTS[n])) for n, s in SCHEMAS.items()
    ]
    tasks += [("json_object", "JSON-object mode", None, json.dumps(JSON_OBJECT_DOC)),
              ("regex", f"regex {REGEX}", REGEX, REGEX_DOC),
              ("choice", f"choice of {len(CHOICES)}", CHOICES, CHOICES[4])]
    docs = {name: tokenizer.encode(doc, add_special_tokens=False) for _, name, _, doc in tasks}
    rows: list[list[str]] = []
    support: dict[str, dict[str, str]] = {}
    for lib_name in names:
        cls = LIBRARIES[lib_name]
        try:
            setup, lib = timed(lambda c=cls: c(tokenizer, vocab_size))
        except ImportError as e:
            out.append(f"{lib_name}: not installed ({e})")
            continue
        rows.append([f"{lib.name} {lib.version()}", "tokenizer setup", f"{setup * 1e3:.0f} ms", "", "", ""])
        all_masks: list[float] = []
        for kind, name, spec, _ in tasks:
            try:
                took, grammar = best_compile(lib, kind, spec, repeats)
                times = mask_times(lib, grammar, docs[name], vocab_size)
            except Exception as e:
                rows.append([lib.name, name, short_error(e), "", "", ""])
                continue
            all_masks += times
            rows.append([lib.name, name, f"{took * 1e3:.1f} ms", f"{times[0] * 1e6:.0f}",
                         f"{us(times, 0.5)}", f"{us(times, 0.99)} ({len(times)} tok)"])
        if all_masks:
            rows.append([lib.name, "all documents", "", "", f"{us(all_masks, 0.5)}",
                         f"{us(all_masks, 0.99)} ({len(all_masks)} tok)"])
        support[lib.name] = {}
        for construct, schema in CONSTRUCTS.items():
            try:
                grammar = lib.compile("schema", schema)
            except Exception as e:
                support[lib.name][construct] = short_error(e)
                continue
            bad = tokenizer.encode(json.dumps(INVALID[construct]), add_special_tokens=False)
            try:
                enforced = not lib.accepts(grammar, bad)
            except Exception:  # a library may raise on a refused token instead of returning False
                enforced = True
            support[lib.name][construct] = "enforced" if enforced else "**accepted, ignored**"
    out.append(f"| library | grammar | compile (best of {repeats}, cold; once if > 1 s) | first mask µs "
               "| mask p50 µs | mask p99 µs |")
    out.append("|---|---|---|---|---|---|")
    out += ["| " + " | ".join(r) + " |" for r in rows]
    if support:
        libs = list(support)
        out.append("\n| JSON-schema construct | " + " | ".join(libs) + " |")
        out.append("|---|" + "---|" * len(libs))
        for construct in CONSTRUCTS:
            out.append(f"| {construct} | " + " | ".join(support[n][construct] for n in libs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    ap.add_argument("--repeats", type=int, default=2, help="compiles per grammar; the best is reported")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = [f"# bench_grammar: {' '.join(sys.argv)}",
           f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
           f"{machine()} (shared), single-threaded (RAYON_NUM_THREADS=1, xgrammar max_threads=1, "
           "torch 1 thread)"]
    for v in args.vocab:
        run_vocab(v, args.libraries, args.repeats, out)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

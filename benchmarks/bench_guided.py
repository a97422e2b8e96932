"""What constrained decoding costs the engine: step time with 8 of 32 rows constrained against none.

The engine runs its shipped defaults (max_num_seqs 32) on a demo zoo. A batch is 32 requests: 32
distinct prompts over adapters a0..a7 and the base model, free rows greedy with EOS ignored. Variants:
- `none`: no row constrained;
- `8 x invoice`: rows 0-7 constrained by the invoice schema of `bench_grammar.py` (nested objects, an
  array of objects, an enum, integer and number bounds), each with its own adapter;
- `8 x 4 schemas`: rows 0-7 constrained by bench_grammar's four realistic schemas, two rows each.
Each variant has its own engine (same zoo, same defaults), filled with its 32 requests and stepped
until every row has its first token (prefills done). Then the engines take `--steps` decode steps in
round-robin (each variant first in turn), so that the steps compared ran under the same load of the
shared machine: each step's wall time (`Engine.step`, which includes the masks: on a CPU engine
filled on the step thread after the forward pass, on an accelerator on the engine's worker thread
while it runs; then unpacked and applied) and process CPU time (all threads). Only rounds
where every engine sampled all 32 rows count (a constrained row that completes would shrink its
batch). Overhead: the median over rounds of each round's ratio to `none`.

Also measured: the grammar tokenizer build (once per engine, on the first constrained request), the
cold compile of each schema used (a fresh engine's compile cache), and the mask work of one step
(8 matchers along a valid invoice document, `TokenMasks` on the calling thread: what the worker does
while the forward runs).

Run: python benchmarks/bench_guided.py [--sizes tiny base] [--steps 48] [--out docs/bench_guided.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_grammar import DOCUMENTS, SCHEMAS
from common import emit, header, load_avg, percentile

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.engine.sample.token_mask import TokenMasks
from lora_cluster.request.guided_spec import GuidedSpec

INVOICE = next(name for name in SCHEMAS if name.startswith("invoice"))
ROWS, CONSTRAINED = 32, 8
ADAPTERS = [f"a{i}" for i in range(8)] + [None]
WORDS = ["order", "invoice", "customer", "shipping", "refund", "account", "payment", "delivery"]


def variants() -> dict[str, list[GuidedSpec | None]]:
    specs = [GuidedSpec.json_schema(s) for s in SCHEMAS.values()]
    free: list[GuidedSpec | None] = [None] * (ROWS - CONSTRAINED)
    return {
        "none": [None] * ROWS,
        "8 x invoice": [GuidedSpec.json_schema(SCHEMAS[INVOICE])] * CONSTRAINED + free,
        "8 x 4 schemas": [specs[i % len(specs)] for i in range(CONSTRAINED)] + free,
    }


def fill_batch(engine: Engine, guided: list[GuidedSpec | None], steps: int) -> None:
    """Add the 32 requests and step until every row has its first token (prefills done)."""
    for i, spec in enumerate(guided):
        prompt = f"The {WORDS[i % len(WORDS)]} number {i} for the {WORDS[(i * 3) % len(WORDS)]} team:"
        params = SamplingParams(max_new_tokens=steps + 64, temperature=0.0, ignore_eos=spec is None,
                                guided=spec)
        engine.add_request(f"row-{i}", prompt, ADAPTERS[i % len(ADAPTERS)], params)
    started: set[str] = set()
    for _ in range(2000):
        started.update(o.request_id for o in engine.step() if o.token_ids)
        if len(started) == ROWS:
            return
    raise RuntimeError("the batch did not start")


def timed_step(engine: Engine) -> tuple[float, float] | None:
    """(wall, process CPU) seconds of one step, or None when it did not sample all 32 rows."""
    t, cpu = time.perf_counter(), time.process_time()
    outs = engine.step()
    elapsed = (time.perf_counter() - t, time.process_time() - cpu)
    return elapsed if len(outs) == ROWS and not any(o.finished for o in outs) else None


def mask_work(engine: Engine) -> list[float]:
    """Seconds to fill and unpack the masks of 8 invoice matchers, at each token of a valid document."""
    spec = GuidedSpec.json_schema(SCHEMAS[INVOICE])
    grammar = engine.grammars.compile(spec).future.result()
    doc = engine.tokenizer.encode(json.dumps(DOCUMENTS[INVOICE]), add_special_tokens=False)
    rows = [SimpleNamespace(guided=SimpleNamespace(matcher=grammar.matcher())) for _ in range(CONSTRAINED)]
    vocab = engine.model.dims.vocab_size
    times = []
    with ThreadPoolExecutor(1) as pool:
        for token in doc:
            t = time.perf_counter()
            TokenMasks.start(rows, vocab, pool).wait()
            times.append(time.perf_counter() - t)
            for row in rows:
                if not row.guided.matcher.consume_token(token):
                    raise RuntimeError(f"the invoice document is refused at token {token}")
    return times


def step_thread_work(engine: Engine, reps: int = 200) -> float:
    """Least seconds the step thread spends on 8 constrained rows of a 32-row step: start the masks
    (a worker hand-off), wait for and apply them to [32, V] logits, advance 8 matchers by one token
    (the fill itself runs on the worker; here it has nothing to overlap, so it is included)."""
    spec = GuidedSpec.json_schema(SCHEMAS[INVOICE])
    grammar = engine.grammars.compile(spec).future.result()
    token = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    vocab = engine.model.dims.vocab_size
    logits = torch.randn(ROWS, vocab)
    best = float("inf")
    with ThreadPoolExecutor(1) as pool:
        for _ in range(reps):
            guided = [SimpleNamespace(matcher=grammar.matcher()) for _ in range(CONSTRAINED)]
            rows = [SimpleNamespace(guided=g) for g in guided + [None] * (ROWS - CONSTRAINED)]
            t = time.perf_counter()
            masks = TokenMasks.start(rows, vocab, pool)
            if masks is None:
                raise RuntimeError("the constrained rows were not found")
            masks.apply(logits)
            for g in guided:
                g.matcher.consume_token(token)
            best = min(best, time.perf_counter() - t)
    return best


def compile_times(engine: Engine) -> tuple[float, dict[str, float]]:
    """The tokenizer build and the cold compile of each schema (the engine's cache must be empty)."""
    out = {}
    for name, schema in SCHEMAS.items():
        entry = engine.grammars.compile(GuidedSpec.json_schema(schema))
        out[name] = entry.future.result(timeout=600).compile_s
    return engine.grammars.tokenizer_build_s or 0.0, out


def run_size(size: str, steps: int, folder: Path) -> list[str]:
    zoo = build_demo_zoo(folder / f"guided-{size}", num_adapters=8, size=size, seed=0)
    engines = {name: build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir))
               for name in variants()}
    try:
        probe = engines["8 x invoice"]
        tokenizer_s, compiles = compile_times(probe)
        masks = mask_work(probe)
        critical = step_thread_work(probe)
        for name, guided in variants().items():
            fill_batch(engines[name], guided, steps)
        kept: dict[str, list[tuple[float, float]]] = {name: [] for name in variants()}
        ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in variants()}
        order = list(variants())
        for step in range(steps):  # round-robin, each variant first in turn: the same load for all
            rotated = order[step % len(order):] + order[: step % len(order)]
            got = {name: timed_step(engines[name]) for name in rotated}
            if any(t is None for t in got.values()):
                continue
            for name, t in got.items():
                kept[name].append(t)
                ratios[name].append((t[0] / got["none"][0], t[1] / got["none"][1]))
    finally:
        for engine in engines.values():
            engine.close()
    vocab = probe.model.dims.vocab_size
    lines = ["", f"## demo size {size} (vocabulary {vocab}, {ROWS} rows, {steps} decode steps each)", "",
             f"- grammar tokenizer build (once per engine, on the first constrained request): "
             f"{tokenizer_s * 1e3:.1f} ms",
             "- cold compile (spec -> validated matcher with its first mask): "
             + "; ".join(f"{name.split(' (')[0]} {s * 1e3:.2f} ms" for name, s in compiles.items()),
             f"- mask work of one step (8 invoice matchers filled, along a valid document of "
             f"{len(masks)} tokens, on the calling thread): p50 {percentile(masks, 0.5) * 1e3:.3f} ms, "
             f"p99 {percentile(masks, 0.99) * 1e3:.3f} ms",
             f"- step-thread work for 8 constrained rows (mask hand-off, fill, unpack and apply to "
             f"[32, {vocab}] "
             f"logits, advance 8 matchers; least of 200): {critical * 1e3:.3f} ms", "",
             "| variant | wall p50 (ms) | CPU p50 (ms) | wall vs none (p50 of rounds) | CPU vs none "
             "(p50 of rounds) "
             "| steps kept |", "|---|---|---|---|---|---|"]
    for name in variants():
        wall = statistics.median(t for t, _ in kept[name])
        cpu = statistics.median(c for _, c in kept[name])
        rw = statistics.median(r for r, _ in ratios[name])
        rc = statistics.median(c for _, c in ratios[name])
        lines.append(f"| {name} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | {(rw - 1) * 100:+.1f}% | "
                     f"{(rc - 1) * 100:+.1f}% | {len(kept[name])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "base"], choices=["tiny", "base"])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the machine's cores)")
    parser.add_argument("--zoo-dir", type=Path, default=Path(".demo"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_guided.py " + " ".join(sys.argv[1:])
    lines = header("bench_guided: step time with 8 of 32 rows constrained", command, level=2,
                   changed={}, machine_note=f", load average at start {load_avg()}")
    for size in args.sizes:
        lines += run_size(size, args.steps, args.zoo_dir)
    emit("\n".join(lines), args.out, title="Constrained decoding: engine step overhead", doc=__doc__)


if __name__ == "__main__":
    main()

"""Step-thread work of constrained rows, two versions of engine/sample/token_mask.py in one process.

Both versions run in the same process, alternating pass by pass, so that they meet the same load of
a shared machine (whole-step ratios need a quiet one: bench_guided.py). Per step: `TokenMasks.start`
over 32 rows of which 8 (every other one) hold an invoice matcher of bench_grammar, fill and apply to
inference-mode [32, V] logits of the tiny demo, `keep_allowed`, advance the 8 matchers by the next
token of the valid invoice document. Figure: each position's least over the passes, then the mean over
the document's positions.

Run: python benchmarks/bench_token_mask_ab.py OLD_TOKEN_MASK_PY [--new PATH] [--passes 6]
(e.g. OLD from `git show <commit>:lora_cluster/engine/sample/token_mask.py > /tmp/old_token_mask.py`)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_grammar import DOCUMENTS, SCHEMAS
from common import load_avg

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import build_engine
from lora_cluster.request.guided_spec import GuidedSpec

REPO = Path(__file__).resolve().parent.parent


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("--new", type=Path, default=REPO / "lora_cluster/engine/sample/token_mask.py")
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--zoo-dir", type=Path, default=Path(".demo"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    mods = {"old": load(args.old, "token_mask_old"), "new": load(args.new, "token_mask_new")}
    zoo = build_demo_zoo(args.zoo_dir / "guided-tiny", num_adapters=8, size="tiny", seed=0)
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir))
    invoice = next(n for n in SCHEMAS if n.startswith("invoice"))
    grammar = engine.grammars.compile(GuidedSpec.json_schema(SCHEMAS[invoice])).future.result()
    doc = engine.tokenizer.encode(json.dumps(DOCUMENTS[invoice]), add_special_tokens=False)
    vocab = engine.model.dims.vocab_size
    engine.close()
    with torch.inference_mode():
        base = torch.randn(32, vocab)
    best = {k: [float("inf")] * len(doc) for k in mods}
    for _ in range(args.passes):
        for name, tm in mods.items():
            matchers = [grammar.matcher() for _ in range(8)]
            rows = [SimpleNamespace(guided=SimpleNamespace(matcher=m)) for m in matchers]
            rows += [SimpleNamespace(guided=None) for _ in range(24)]
            rows = rows[::2] + rows[1::2]
            for i, token in enumerate(doc):
                with torch.inference_mode():
                    logits = base.clone()
                t = time.perf_counter_ns()
                masks = tm.TokenMasks.start(rows, vocab, None)
                masked = masks.apply(logits)
                masks.keep_allowed(masked, masked)
                for m in matchers:
                    m.consume_token(token)
                    m.is_stopped()
                best[name][i] = min(best[name][i], time.perf_counter_ns() - t)
    print(f"load average {load_avg()}; {len(doc)} positions, least of {args.passes} passes each")
    for name in mods:
        mean_us = sum(best[name]) / len(doc) / 1e3
        print(f"{name}: step-thread work of 8 constrained rows per step {mean_us:.1f} us")


if __name__ == "__main__":
    main()

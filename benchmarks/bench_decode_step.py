"""One decode step of the distinct-decode scenario, timed per LoRA path: where the LoRA overhead is.

The engine benchmark (`bench_engine.py --scenario distinct-decode`) times whole generations, whose
wall and process CPU time on a shared 2-core machine swing by 2-5x with the other jobs' load. This
script times the forward pass of one decode step instead: the same 32 requests (32 distinct
rank-8 adapters of the demo zoo, a0, a3, ..., a93) are run for a few tokens, one decode batch of 32
tokens is kept (and the same batch on the base model), and then `LlamaRunner.forward` runs that
batch again and again, alternating the variants, keeping each one's least wall time and least
process CPU time over `--reps` (on a shared machine, the run other jobs disturbed least).
Variants: `base` (the base-model batch), and for the adapter batch the LoRA layer fused (one shrink
for q/k/v and for gate/up) or unfused, with the CPU ops' segment loop (`loop`), their slot-batched
path (`batched`, lora_kernels.slot_batch) or their own choice (`auto`, the engine's default).

`--qv-only` adds the same measurement on 32 rank-8 adapters that target q_proj and v_proj only
(PEFT's default target_modules for Llama): the demo zoo has just 7 such rank-8 adapters in 96, so
the script writes 32 of them next to the zoo (random weights drawn as the demo draws them, PEFT's
file format).

Run: python benchmarks/bench_decode_step.py [--zoo .demo/base96] [--threads 2] [--reps 15] [--qv-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from lora_kernels import LoraOps, cpu
from safetensors.torch import save_file

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.batch import StepBatch
from lora_cluster.engine.lora_layer import LoraLayer

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import WORDS

ADAPTERS = [f"a{i}" for i in range(0, 96, 3)]  # the demo zoo's 32 rank-8 adapters


def forced(ops: LoraOps, batched: bool | None) -> LoraOps:
    """The CPU ops with the slot-batched path forced on (True), off (False) or left to them (None)."""
    return dataclasses.replace(
        ops, sgmv_shrink=functools.partial(cpu.sgmv_shrink, batched=batched),
        sgmv_expand=functools.partial(cpu.sgmv_expand, batched=batched),
        add_lora=functools.partial(cpu.add_lora, batched=batched),
    )  # fmt: skip


def write_qv_adapters(zoo_adapters: Path, out: Path) -> None:
    """32 rank-8 q_proj/v_proj adapters (a0 ... a93's configs, their weights redrawn for q and v)."""
    if (out / ADAPTERS[-1] / "adapter_model.safetensors").exists():
        return
    gen = torch.Generator().manual_seed(12)
    for aid in ADAPTERS:
        config = json.loads((zoo_adapters / aid / "adapter_config.json").read_text())
        config.update(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16, use_rslora=False)
        weights = {}
        for layer in range(12):
            for name, n_out in (("q_proj", 768), ("v_proj", 256)):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
                weights[f"{prefix}.lora_A.weight"] = torch.randn(8, 768, generator=gen) / 768**0.5
                weights[f"{prefix}.lora_B.weight"] = torch.randn(n_out, 8, generator=gen) * 0.08
        (out / aid).mkdir(parents=True, exist_ok=True)
        (out / aid / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(weights, out / aid / "adapter_model.safetensors", metadata={"format": "pt"})


def decode_batches(engine: Engine, prompts: list[str]) -> dict[str, StepBatch]:
    """A 32-token decode batch with the adapters and one without, from short generations."""
    batches: dict[str, StepBatch] = {}
    forward = engine.runner.forward
    for key, adapters in (("lora", ADAPTERS), ("base", None)):
        def keep(batch: StepBatch, key: str = key) -> torch.Tensor:
            if batch.num_tokens == len(prompts) and batch.num_decodes == len(prompts):
                batches.setdefault(key, batch)
            return forward(batch)

        engine.runner.forward = keep
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, adapter_ids=adapters, sampling=params)
    engine.runner.forward = forward
    return batches


def measure(engine: Engine, reps: int) -> dict[str, tuple[float, float]]:
    """Least (wall, process CPU) seconds of one forward of the kept decode batch per variant."""
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in ADAPTERS]
    batches = decode_batches(engine, prompts)
    dims = engine.model.dims
    kv = dims.q_dim + dims.kv_dim
    splits = {"q_proj": ("qkv", 0, dims.q_dim), "k_proj": ("qkv", dims.q_dim, kv),
              "v_proj": ("qkv", kv, kv + dims.kv_dim), "gate_proj": ("gate_up", 0, dims.intermediate),
              "up_proj": ("gate_up", dims.intermediate, 2 * dims.intermediate)}  # fmt: skip
    runner, default = engine.runner, engine.runner.lora
    variants: dict[str, tuple[str, LoraLayer]] = {"base": ("base", default)}
    for fused in (True, False):
        for path, batched in (("auto", None), ("loop", False), ("batched", True)):
            layer = LoraLayer(engine.pool, forced(runner.ops, batched), splits, fused)
            variants[f"{'fused' if fused else 'unfused'}, {path}"] = ("lora", layer)
    best = dict.fromkeys(variants, (float("inf"), float("inf")))
    for _ in range(reps):
        for name, (batch, layer) in variants.items():
            runner.lora = layer
            wall, cpu_s = time.perf_counter(), time.process_time()
            runner.forward(batches[batch])
            wall, cpu_s = time.perf_counter() - wall, time.process_time() - cpu_s
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu_s))
    runner.lora = default
    return best


def table(title: str, best: dict[str, tuple[float, float]]) -> list[str]:
    (bw, bc) = best["base"]
    lines = [f"**{title}**", "", "| variant | wall ms per step | base / variant, wall | CPU ms per step | "
             "base / variant, CPU | LoRA CPU ms over base |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, (w, c) in best.items():
        lines.append(f"| {name} | {w * 1e3:.1f} | {bw / w:.3f} | {c * 1e3:.1f} | {bc / c:.3f} | "
                     f"{(c - bc) * 1e3:.1f} |")  # fmt: skip
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, default=Path(".demo/base96"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--qv-only", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    zoo = build_demo_zoo(args.zoo, num_adapters=96, size="base", seed=0)
    common = {"model": str(zoo.model_dir), "max_loras": 32, "max_lora_rank": 8, "max_num_seqs": 32}
    sources = {"32 distinct rank-8 adapters of the demo zoo (targets vary, see docs/bench_decode.md)":
               zoo.adapters_dir}  # fmt: skip
    if args.qv_only:
        qv = args.zoo.parent / f"{args.zoo.name}-qv-adapters"
        write_qv_adapters(zoo.adapters_dir, qv)
        sources["32 distinct rank-8 adapters on q_proj and v_proj only"] = qv
    lines = [
        f"- machine: {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads; "
        f"command: `python benchmarks/bench_decode_step.py {' '.join(sys.argv[1:])}`",
    ]
    for title, source in sources.items():
        best = measure(Engine(**common, adapter_source=str(source)), args.reps)
        lines += ["", *table(title, best)]
    lines.append(f"- 1-minute load average at the end: {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

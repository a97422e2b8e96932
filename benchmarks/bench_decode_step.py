"""One decode step of the distinct-decode scenario, timed per LoRA path: where the LoRA overhead is.

The engine benchmark (`bench_engine.py --scenario distinct-decode`) times whole generations, whose
wall and process CPU time on a shared 2-core machine swing by 2-5x with the other jobs' load. This
script times the forward pass of one decode step instead: the same 32 requests (32 distinct
rank-8 adapters of the demo zoo, a0, a3, ..., a93) are run for a few tokens, one decode batch of 32
tokens is kept (and the same batch on the base model), and then `ModelRunner.forward` runs that
batch again and again, alternating the variants, keeping each one's least wall time and least
process CPU time over `--reps` (on a shared machine, the run other jobs disturbed least).
Variants: `base` (the base-model batch), and for the adapter batch the LoRA layer fused (one shrink
for q/k/v and for gate/up) or unfused, with the CPU ops' segment loop (`loop`), their slot-batched
torch path (`batched`, lora_kernels.slot_batch), their own choice (`auto`, the engine's default:
decode-like batches of the unfused layer through the C++ kernel of lora_kernels.native) or that
choice without the C++ kernel (`torch`, as with `lora_cpu_native: false`).

On CUDA the LoRA path is the Triton kernels', and the variants are fused or unfused with the decode
tokens through gathered BGMV (`bgmv`, the engine's choice for distinct adapters) or one SGMV
segment per adapter (`sgmv`); each timing is `--iters` forwards between two device synchronizations,
divided by `--iters`. `--size 1b` serves a ~1.0B model of Llama-3.2-1B's dims instead of the ~88M
demo model (the overhead of a LoRA path depends on the base model's size: a GPU needs that one),
with 32 rank-8 adapters on all seven projections written next to it.

`--qv-only` adds the same measurement on 32 rank-8 adapters that target q_proj and v_proj only
(PEFT's default target_modules for Llama): the demo zoo has just 7 such rank-8 adapters in 96, so
the script writes 32 of them next to the zoo (random weights drawn as the demo draws them, PEFT's
file format).

Run: python benchmarks/bench_decode_step.py [--zoo .demo/base96] [--threads 2] [--reps 15] [--qv-only]
     python benchmarks/bench_decode_step.py --size 1b --zoo .demo/1b --iters 20   (on a GPU)
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

from lora_cluster.demo import DemoZoo, build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.engine.model.base_model import fused_splits
from lora_cluster.engine.model.batch import StepBatch
from lora_cluster.engine.model.lora_layer import LoraLayer

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import WORDS
from common import machine

ADAPTERS = [f"a{i}" for i in range(0, 96, 3)]  # the demo zoo's 32 rank-8 adapters
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def forced(ops: LoraOps, batched: bool | None, native: bool) -> LoraOps:
    """The CPU ops with the slot-batched path forced on (True), off (False) or left to them (None),
    and `add_lora`'s C++ kernel allowed or not."""
    return dataclasses.replace(
        ops, sgmv_shrink=functools.partial(cpu.sgmv_shrink, batched=batched),
        sgmv_expand=functools.partial(cpu.sgmv_expand, batched=batched),
        add_lora=functools.partial(cpu.add_lora, batched=batched, native=native),
    )  # fmt: skip


def write_adapters(model_dir: Path, out: Path, targets: tuple[str, ...], seed: int) -> None:
    """32 rank-8 PEFT adapters named as ADAPTERS on `targets` of the model at `model_dir`, with random
    weights drawn as the demo draws them (A ~ N(0, 1/in), B ~ N(0, 0.08^2))."""
    if (out / ADAPTERS[-1] / "adapter_model.safetensors").exists():
        return
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": 8, "lora_alpha": 16, "use_rslora": False, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(targets)}  # fmt: skip
    for aid in ADAPTERS:
        weights = {}
        for layer in range(layers):
            for name in targets:
                kind = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix, (n_out, n_in) = f"base_model.model.model.layers.{layer}.{kind}.{name}", shapes[name]
                weights[f"{prefix}.lora_A.weight"] = torch.randn(8, n_in, generator=gen) / n_in**0.5
                weights[f"{prefix}.lora_B.weight"] = torch.randn(n_out, 8, generator=gen) * 0.08
        (out / aid).mkdir(parents=True, exist_ok=True)
        (out / aid / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(weights, out / aid / "adapter_model.safetensors", metadata={"format": "pt"})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_batch(engine: Engine, prompts: list[str], adapters: list[str] | None, layer: LoraLayer,
                 kernel: str) -> StepBatch:  # fmt: skip
    """A 32-token decode batch of a short generation, planned for `layer` (its fused groups) with the
    decode tokens' path `kernel` (engine.model.lora_layer.use_bgmv)."""
    kept: list[StepBatch] = []
    runner = engine.runner
    forward, default, default_kernel = runner.forward, runner.lora, runner.decode_kernel

    def keep(batch: StepBatch) -> torch.Tensor:
        if not kept and batch.num_tokens == len(prompts) and batch.num_decodes == len(prompts):
            kept.append(batch)
        return forward(batch)

    runner.forward, runner.lora, runner.decode_kernel = keep, layer, kernel
    try:
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, adapter_ids=adapters, sampling=params)
    finally:
        runner.forward, runner.lora, runner.decode_kernel = forward, default, default_kernel
    return kept[0]


def measure(engine: Engine, reps: int, iters: int) -> dict[str, tuple[float, float]]:
    """Least (wall, process CPU) seconds of one forward of the kept decode batch per variant (the mean
    over `iters` forwards between two device synchronizations)."""
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in ADAPTERS]
    splits = fused_splits(engine.model.dims)
    runner, default = engine.runner, engine.runner.lora
    variants = {"base": (default, decode_batch(engine, prompts, None, default, "auto"))}
    for fused in (True, False):
        prefix = "fused" if fused else "unfused"
        if runner.ops.name == "triton":
            for kernel in ("bgmv", "sgmv"):
                layer = LoraLayer(engine.pool, runner.ops, splits, fused)
                batch = decode_batch(engine, prompts, ADAPTERS, layer, kernel)
                variants[f"{prefix}, {kernel}"] = (layer, batch)
            continue
        for path, batched, native in (("auto", None, True), ("torch", None, False), ("loop", False, False),
                                      ("batched", True, False)):  # fmt: skip
            layer = LoraLayer(engine.pool, forced(runner.ops, batched, native), splits, fused)
            variants[f"{prefix}, {path}"] = (layer, decode_batch(engine, prompts, ADAPTERS, layer, "auto"))
    best = dict.fromkeys(variants, (float("inf"), float("inf")))
    device = engine.device
    for _ in range(reps):
        for name, (layer, batch) in variants.items():
            runner.lora = layer
            synchronize(device)
            wall, cpu_s = time.perf_counter(), time.process_time()
            for _ in range(iters):
                runner.forward(batch)
            synchronize(device)
            wall, cpu_s = (time.perf_counter() - wall) / iters, (time.process_time() - cpu_s) / iters
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu_s))
    runner.lora = default
    return best


def adapter_sources(zoo: DemoZoo, folder: Path, size: str, qv_only: bool) -> dict[str, Path]:
    """Title -> adapter folder of each measurement (writing the adapters the zoo lacks)."""
    if size == "base":
        sources = {"32 distinct rank-8 adapters of the demo zoo (targets vary, see docs/bench_decode.md)":
                   zoo.adapters_dir}  # fmt: skip
    else:
        full = folder.parent / f"{folder.name}-adapters"
        write_adapters(zoo.model_dir, full, ALL_PROJECTIONS, seed=11)
        sources = {"~1.0B model (Llama-3.2-1B's dims), 32 distinct rank-8 adapters on all projections": full}
    if qv_only:
        qv = folder.parent / f"{folder.name}-qv-adapters"
        write_adapters(zoo.model_dir, qv, ("q_proj", "v_proj"), seed=12)
        sources["32 distinct rank-8 adapters on q_proj and v_proj only"] = qv
    return sources


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
    ap.add_argument("--iters", type=int, default=1, help="forwards per timing (use 10-20 on a GPU)")
    ap.add_argument("--size", choices=("base", "1b"), default="base", help="base: the ~88M demo model "
                    "and its adapters; 1b: ~1.0B parameters and 32 all-projection rank-8 adapters")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    zoo = build_demo_zoo(args.zoo, num_adapters=96 if args.size == "base" else 0, size=args.size, seed=0)
    common = {"model": str(zoo.model_dir), "max_loras": 32, "max_lora_rank": 8, "max_num_seqs": 32,
              "num_kv_blocks": 256}  # fmt: skip
    sources = adapter_sources(zoo, args.zoo, args.size, args.qv_only)
    lines = [
        f"- machine: {machine()}, torch {torch.__version__}, {args.threads} threads; "
        f"command: `python benchmarks/bench_decode_step.py {' '.join(sys.argv[1:])}`",
    ]
    for title, source in sources.items():
        best = measure(build_engine(**common, adapter_source=str(source)), args.reps, args.iters)
        lines += ["", *table(title, best)]
    lines.append(f"- 1-minute load average at the end: {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

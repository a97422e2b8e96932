"""Many adapters behind one engine: throughput over 1,000 adapters, TTFT when adapters outnumber slots.

Two scenarios on the base demo model (`lora-cluster demo --size base`), CPU or GPU:

`--scenario zipf` (throughput): `--requests` requests (short prompts, `--max-tokens` greedy tokens,
EOS ignored) all queued at once, adapters drawn Zipf(1.0) over 1,000 adapter ids vs over 8, with
`max_loras` 32. The 1,000 ids are symlinks to the zoo's 64 adapters (cheap to make; the store and
the engine load, cache and place every id separately). Rounds alternate between the two engines
and the best time of each is kept (the first round fills the host tier; later rounds run on it).

`--scenario ttft` (no eviction cliff): large adapters (rank 64 on all seven projections, ~43 MB in
float32 on the base model; `--big` distinct weight files, symlinked to as many ids as needed),
`max_loras` `--slots`. Requests arrive open-loop (Poisson) at `--load` (0.8) times the capacity
measured first with `--slots` adapters; the same arrival times are replayed with `4 x --slots`
active adapters and with `--slots` active adapters. Reported: median and p99 time to first token
of each, and their ratio. Rounds alternate, best median kept.

`--scenario cycle` (churn at a steady rate): the tiny demo model with the engine's default 8 slots;
requests arrive every 1 / `--rate` (10/s) seconds for `--duration` seconds, their adapters cycling
round robin over 32 adapter ids (every request needs a placement: 4x the slots) vs over 8 (all
resident). Median and p99 TTFT of each and their ratios (targets <= 2x and <= 3x). Rounds alternate,
best median kept.

Every scenario runs the shipped `EngineConfig` defaults (protection on) and prints the settings it
changes and why (the scenario's shape: slots, batch, rank).

Run: python benchmarks/bench_adapter_scale.py --scenario zipf [--requests 96] [--rounds 2]
     python benchmarks/bench_adapter_scale.py --scenario ttft [--requests 48] [--slots 4] [--rounds 2]
     python benchmarks/bench_adapter_scale.py --scenario cycle [--rate 10] [--duration 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import load_avg, machine, open_loop, percentile, symlink_farm
from safetensors.torch import save_file

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.sim.popularity import ZipfSampler

PROMPTS = ["the river runs past a quiet town", "a farmer sells bread at the market", "the old bridge"]
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def zipf_draws(n: int, num_adapters: int, seed: int, s: float = 1.0) -> list[int]:
    return ZipfSampler(num_adapters, s).draws(random.Random(seed), n)


def big_adapters(model_dir: Path, out: Path, count: int, rank: int = 64) -> list[Path]:
    """`count` PEFT adapters of rank `rank` on every projection (random weights, seeded)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    folders = []
    for i in range(count):
        folder = out / f"big{i}"
        folders.append(folder)
        if (folder / "adapter_model.safetensors").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1000 + i)
        weights = {}
        for layer in range(layers):
            for name, kind in PROJECTIONS.items():
                n_out, n_in = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{kind}.{name}"
                weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * n_in**-0.5
                weights[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 1e-3
        save_file(weights, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                  "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(PROJECTIONS),
                  "base_model_name_or_path": str(model_dir), "use_rslora": False}
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folders


def engine_for(model_dir: Path, source: Path, max_loras: int, max_rank: int) -> Engine:
    """The scenario's engine: defaults, except the slots and the rank the scenario is about."""
    print(f"settings: EngineConfig defaults except max_loras={max_loras} and max_lora_rank={max_rank} "
          "(the scenario's slots and adapters)", flush=True)
    return build_engine(model=str(model_dir), adapter_source=str(source), max_loras=max_loras,
                        max_lora_rank=max_rank, max_num_seqs=32)


def closed_run(engine: Engine, adapters: list[str], max_tokens: int, tag: str) -> float:
    """All requests queued at once; returns seconds to finish them all."""
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, aid in enumerate(adapters):
        engine.add_request(f"{tag}-{i}", PROMPTS[i % len(PROMPTS)], aid, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def open_run(engine: Engine, arrivals: list[tuple[float, str]], max_tokens: int, tag: str) -> list[float]:
    """Requests added at their arrival offsets (seconds) while the engine steps; returns each TTFT."""
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(open_loop(engine, arrivals, params, tag=tag, prompts=PROMPTS).ttft.values())


def scenario_zipf(args: argparse.Namespace, zoo) -> None:
    real = sorted(p for p in zoo.adapters_dir.iterdir() if p.is_dir())
    farm = symlink_farm(args.work / "farm1000", real, 1000)
    engines = {n: engine_for(zoo.model_dir, farm, 32, 32) for n in (1000, 8)}
    best: dict[int, float] = {}
    for r in range(args.rounds):
        for n, engine in engines.items():
            ids = [f"x{k}" for k in zipf_draws(args.requests, n, seed=r)]
            seconds = closed_run(engine, ids, args.max_tokens, f"z{n}-{r}")
            best[n] = min(best.get(n, float("inf")), seconds)
            print(f"round {r}: Zipf over {n} adapters ({len(set(ids))} distinct): {seconds:.1f} s, "
                  f"{args.requests * args.max_tokens / seconds:.1f} tokens/s", flush=True)
    for engine in engines.values():
        engine.close()
    tokens = args.requests * args.max_tokens
    print("\n| adapters (Zipf 1.0) | best seconds | tokens/s |\n|---:|---:|---:|")
    for n in (8, 1000):
        print(f"| {n} | {best[n]:.1f} | {tokens / best[n]:.1f} |")
    print(f"\nthroughput 1,000 / 8 adapters: {best[8] / best[1000]:.3f}x")


def scenario_ttft(args: argparse.Namespace, zoo) -> None:
    bigs = big_adapters(zoo.model_dir, args.work / "big", args.big)
    nbytes = (bigs[0] / "adapter_model.safetensors").stat().st_size
    active = {"4x": 4 * args.slots, "1x": args.slots}
    farm = symlink_farm(args.work / "bigfarm", bigs, 4 * args.slots)
    engine = engine_for(zoo.model_dir, farm, args.slots, 64)
    warm = [f"x{k}" for k in range(4 * args.slots)]
    closed_run(engine, warm, 2, "warm")  # every adapter through disk -> host once
    capacity = args.requests / closed_run(engine, [f"x{k % args.slots}" for k in range(args.requests)],
                                          args.max_tokens, "cap")
    rate = args.load * capacity
    rng = random.Random(7)
    offsets, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(rate)
        offsets.append(t)
    print(f"adapters: {nbytes / 1e6:.1f} MB each; capacity {capacity:.2f} req/s with {args.slots} adapters; "
          f"arrivals at {rate:.2f} req/s", flush=True)
    results: dict[str, tuple[float, float]] = {}
    for r in range(args.rounds):
        for name, n in active.items():
            order = random.Random(r).sample(range(n), n)
            arrivals = [(o, f"x{order[i % n]}") for i, o in enumerate(offsets)]
            ttft = open_run(engine, arrivals, args.max_tokens, f"{name}-{r}")
            med, p99 = statistics.median(ttft), percentile(ttft, 0.99)
            print(f"round {r}: {n} active adapters over {args.slots} slots: TTFT median {med * 1e3:.0f} ms, "
                  f"p99 {p99 * 1e3:.0f} ms", flush=True)
            if name not in results or med < results[name][0]:
                results[name] = (med, p99)
    engine.close()
    print(f"\n| active adapters ({args.slots} slots, {nbytes / 1e6:.0f} MB each) | TTFT median ms "
          "| TTFT p99 ms |\n|---|---:|---:|")
    for name, n in active.items():
        print(f"| {n} ({name} max_loras) | {results[name][0] * 1e3:.0f} | {results[name][1] * 1e3:.0f} |")
    print(f"\nmedian TTFT 4x / 1x: {results['4x'][0] / results['1x'][0]:.2f}; "
          f"p99: {results['4x'][1] / results['1x'][1]:.2f}")


def scenario_cycle(args: argparse.Namespace, _zoo) -> None:
    tiny = build_demo_zoo(args.zoo.with_name(args.zoo.name + "-tiny"), num_adapters=64, seed=0)
    print("settings: EngineConfig defaults (max_loras 8, max_num_seqs 32, breakers on); the tiny demo model",
          flush=True)
    engine = build_engine(model=str(tiny.model_dir), adapter_source=str(tiny.adapters_dir))
    n = round(args.rate * args.duration)
    offsets = [i / args.rate for i in range(n)]
    closed_run(engine, [f"a{k}" for k in range(32)], 2, "warm")  # every adapter through the host tier once
    results: dict[int, tuple[float, float]] = {}
    for r in range(args.rounds):
        for active in (8, 32):
            ttft = open_run(engine, [(o, f"a{i % active}") for i, o in enumerate(offsets)], args.max_tokens,
                            f"c{active}-{r}")
            med, p99 = statistics.median(ttft), percentile(ttft, 0.99)
            print(f"round {r}: {active} adapters cycled over 8 slots at {args.rate:g}/s: TTFT median "
                  f"{med * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms ({len(ttft)} requests)", flush=True)
            if active not in results or med < results[active][0]:
                results[active] = (med, p99)
    switches = engine.counters_snapshot()["switches"]
    engine.close()
    print(f"\n| adapters cycled (8 slots, {args.rate:g} req/s) | TTFT median ms | TTFT p99 ms |\n"
          "|---:|---:|---:|")
    for active in (8, 32):
        print(f"| {active} | {results[active][0] * 1e3:.0f} | {results[active][1] * 1e3:.0f} |")
    print(f"\nmedian TTFT 32 / 8 adapters: {results[32][0] / results[8][0]:.2f}x (target <= 2x); "
          f"p99: {results[32][1] / results[8][1]:.2f}x (target <= 3x); switches in all: {switches}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=["zipf", "ttft", "cycle"], required=True)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4, help="max_loras of the ttft scenario")
    ap.add_argument("--big", type=int, default=8, help="distinct large adapter files of the ttft scenario")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second of the cycle scenario")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals of the cycle scenario")
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-bench-base")
    args = ap.parse_args()
    args.work = args.zoo.with_name(args.zoo.name + "-scale")  # symlink farms and large adapters
    zoo = build_demo_zoo(args.zoo, num_adapters=64, size="base", seed=0)
    print(f"{machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    {"zipf": scenario_zipf, "ttft": scenario_ttft, "cycle": scenario_cycle}[args.scenario](args, zoo)
    print(f"load average at the end: {load_avg()}")


if __name__ == "__main__":
    main()

"""Adapter thrash: hot adapters under a storm of one-off cold adapters whose every load is slow.

One engine with the shipped `EngineConfig` defaults (`max_loras` 8, `max_num_seqs` 32, 2 loader
workers, protection on: `breakers` true) on the tiny demo model. Traffic is open-loop Poisson at
`--rate` requests/s for `--duration` seconds: 70% go to 4 hot adapters (uniformly), 30% to one-off
cold adapters (a new adapter id per request: the storm). Every adapter load sleeps `--load-ms`
(200 ms) first: `SlowFolderLoader` is the plain folder loader (`adapter_store: folder`) whose `load`
sleeps, wired as the engine's `adapter_loader`; so a hot adapter evicted from its device slot pays
a slow load again (the tiered store's host tier would hide that, and no host tier is that large in
front of a slow store). Each request: a short prompt, `--max-tokens` greedy tokens.

Runs (the same seeded arrival times; they alternate over `--rounds`, best p99 of each kept):

  calm      the hot 70% only (no storm), defaults
  storm     hot + cold, defaults (protection on)
  storm-off hot + cold, `breakers=False`: protection off (plain LRU victims, cold loads in
            arrival order on every worker), to show what protection changes

Reported per run: hot TTFT p50 / p99, cold requests completed / sent and their TTFT p50 / p99,
switches, and the ratio storm / calm of the hot p99 (target <= 1.5x) with protection on and off.

Run: python benchmarks/bench_thrash.py [--rate 12] [--duration 30] [--rounds 2] [--load-ms 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import load_avg, machine, open_loop, percentile, symlink_farm

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.config import EngineConfig
from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.store.folder_loader import FolderAdapterLoader

PROMPTS = ["the river runs past a quiet town", "a farmer sells bread at the market", "the old bridge"]
HOT = 4
RUNS = (("calm", True, False), ("storm", True, True), ("storm-off", False, True))  # name, protection, storm


class SlowFolderLoader(FolderAdapterLoader):
    """The folder loader, every `load` of an adapter sleeping `delay_s` first (a slow store)."""

    def __init__(self, delay_s: float, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.delay_s = delay_s

    def load(self, adapter_id: str) -> LoraWeights:
        time.sleep(self.delay_s)
        return super().load(adapter_id)


def slow_loader_factory(delay_s: float):
    """The engine's loader factory: `SlowFolderLoader` over the config's adapter source."""

    def build(config: EngineConfig, shapes: ModelShapes, device: torch.device) -> SlowFolderLoader:
        uris = [config.adapter_source] if isinstance(config.adapter_source, str) else config.adapter_source
        return SlowFolderLoader(delay_s, uris, shapes, config.max_lora_rank)

    return build


def farm(root: Path, targets: list[Path], n: int) -> Path:
    """`root/c0..c{n-1}` (one-off ids) and `root/h0..h3` (hot ids), symlinks over the zoo's adapters."""
    symlink_farm(root, targets, HOT, prefix="h")
    return symlink_farm(root, targets, n, prefix="c", first=HOT)


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out, t, cold = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        if rng.random() < 0.7:
            out.append((t, f"h{rng.randrange(HOT)}"))
        else:
            out.append((t, f"c{cold}"))
            cold += 1


def run(engine: Engine, plan: list[tuple[float, str]], max_tokens: int, tag: str,
        bound_s: float) -> dict[str, list[float] | int]:
    """Requests added at their offsets while the engine steps; TTFT per kind, completions, switches."""
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    switches = engine.counters_snapshot()["switches"]
    seen = open_loop(engine, plan, params, tag=tag, prompts=PROMPTS, bound_s=bound_s)
    hot = [s for r, s in seen.ttft.items() if seen.added[r][1].startswith("h")]
    cold = [s for r, s in seen.ttft.items() if seen.added[r][1].startswith("c")]
    cold_sent = sum(1 for _, a in plan if a.startswith("c"))
    return {"hot": hot, "cold": cold, "done": seen.done, "sent": len(plan), "cold_sent": cold_sent,
            "switches": engine.counters_snapshot()["switches"] - switches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (hot + cold)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load-ms", type=float, default=200.0, help="sleep of every load from the source")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-bench-tiny")
    args = ap.parse_args()
    zoo = build_demo_zoo(args.zoo, num_adapters=64, seed=0)
    plan = arrivals(args.rate, args.duration, seed=1)
    cold_ids = sum(1 for _, a in plan if a.startswith("c"))
    print(f"{machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print("settings: EngineConfig defaults (max_loras 8, max_num_seqs 32, 2 loader workers, breakers on), "
          f"except: the adapter loader (a folder loader whose every load sleeps {args.load_ms:.0f} ms: the "
          "scenario), and breakers=False in storm-off (the comparison)",
          flush=True)
    real = sorted(p for p in zoo.adapters_dir.iterdir() if p.is_dir())
    results: dict[str, dict] = {}
    for r in range(args.rounds):
        source = farm(Path(tempfile.mkdtemp(prefix="thrash-farm-")), real, cold_ids)  # fresh: all cold
        for name, protect, storm in RUNS:
            engine = build_engine(model=str(zoo.model_dir), adapter_source=str(source),
                                  adapter_loader=slow_loader_factory(args.load_ms / 1000),
                                  **({} if protect else {"breakers": False}))
            todo = plan if storm else [(t, a) for t, a in plan if a.startswith("h")]
            warm = [(0.0, f"h{k}") for k in range(HOT)]  # the hot adapters' first loads, before timing
            run(engine, warm, 1, f"warm-{name}-{r}", 60.0)
            res = run(engine, todo, args.max_tokens, f"{name}-{r}", args.duration + 120.0)
            engine.close()
            hot_p99, cold = percentile(res["hot"], 0.99), res["cold"]
            print(f"round {r} {name}: hot TTFT p50 {statistics.median(res['hot']) * 1e3:.0f} ms p99 "
                  f"{hot_p99 * 1e3:.0f} ms; cold {len(cold)}/{res['cold_sent'] if storm else 0} first "
                  f"tokens, "
                  f"p50 {percentile(cold, 0.5) * 1e3:.0f} ms p99 {percentile(cold, 0.99) * 1e3:.0f} ms; "
                  f"completed {res['done']}/{len(todo)}; switches {res['switches']}", flush=True)
            if name not in results or hot_p99 < percentile(results[name]["hot"], 0.99):
                results[name] = res | {"todo": len(todo)}
    print("\n| run | hot TTFT p50 ms | hot TTFT p99 ms | cold first tokens | cold TTFT p50 ms "
          "| cold TTFT p99 ms | all completed | switches |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, res in results.items():
        cold = f"{len(res['cold'])}/{res['cold_sent']}" if name != "calm" else "-"
        hot = res["hot"]
        p50, p99 = (f"{percentile(res['cold'], q) * 1e3:.0f}" if res["cold"] else "-" for q in (0.5, 0.99))
        print(f"| {name} | {statistics.median(hot) * 1e3:.0f} | {percentile(hot, 0.99) * 1e3:.0f} | {cold} "
              f"| {p50} | {p99} | {res['done']}/{res['todo']} | {res['switches']} |")
    calm = percentile(results["calm"]["hot"], 0.99)
    storm = percentile(results["storm"]["hot"], 0.99)
    print(f"\nhot p99 TTFT storm / calm: protection on {storm / calm:.2f}x "
          f"(target <= 1.5x), off {percentile(results['storm-off']['hot'], 0.99) / calm:.2f}x")
    print(f"load average at the end: {load_avg()}")


if __name__ == "__main__":
    main()

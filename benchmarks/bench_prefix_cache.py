"""Prefix caching: time to first token of requests that share a long system prompt, with the engine's
prefix cache on (the default) and off, at the same open-loop load.

Workload: one system prompt shared by every request (`--system-tokens`, 1,500 by default, the
issue's size, where the model's context holds it plus the user turn and the output; otherwise the
longest that leaves room for them, and the report says so; the tiny demo model takes 512 tokens,
`--size base`, the ~88M demo, 2,048), then a 50-token user turn of random tokens unique to each
request; 16 adapters (a0..a15) taken in random order; 16 greedy output tokens (EOS ignored). One
engine per setting, built as a replica builds it (`ServeConfig` defaults, the demo zoo). Each engine
first serves the system prompt once per adapter, one at a time: that places the adapters and, with
the cache, leaves each adapter's system-prompt blocks cached (its KV differs per adapter: nothing is
shared across them).

Load: Poisson arrivals at `--load` (default 0.5) times the cache-off engine's serial rate (one over
its median TTFT for a request alone), the same arrival times for both engines, so the figures compare
the two at the same offered load, one that the engine without the cache sustains. The runs alternate
off, on, off, on (`--reps`) and keep each setting's best run (lowest p50), as this shared machine is
noisy. Reported: TTFT mean, p50 and p90 per setting, their ratios (off / on), and the share of prompt
tokens served from the cache.

Run: python benchmarks/bench_prefix_cache.py [--size tiny|base] [--system-tokens 1500] [--requests 48]
                                             [--reps 2] [--alone 16] [--threads 1] [--max-loras 16]
                                             [--out report.md]
The issue's size (1,500 + 50 tokens) on the CPU, about 6 minutes:
     python benchmarks/bench_prefix_cache.py --size base --requests 16 --reps 1 --alone 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import changed_settings, emit, header, open_loop, percentile

from lora_cluster.config import ServeConfig
from lora_cluster.engine import Engine, SamplingParams, build_engine
from lora_cluster.serve.replica.model import resolve_model
from lora_cluster.store import build_adapter_loader

SYSTEM_TOKENS, USER_TOKENS, OUTPUT_TOKENS, ADAPTERS = 1500, 50, 16, 16
REASONS = {
    "demo_size": "the issue's 1,500-token system prompt with 50-token turns and the output needs more "
                 "than the tiny demo's 512 positions: the base demo (~88M parameters) has 2,048",
    "demo_num_adapters": "the workload uses 16 adapters; a smaller zoo builds faster",
    "demo_dir": "a scratch folder for the demo zoo, not the user's cache",
    "max_loras": "every one of the 16 adapters keeps a device slot, so that TTFT measures the prefill and "
                 "not the wait of a request whose adapter has no slot until one frees, which the prefix "
                 "cache cannot shorten",
}


def build(config: ServeConfig, cache: bool) -> Engine:
    return build_engine(config=config.engine.model_copy(update={"enable_prefix_caching": cache}),
                        adapter_loader=build_adapter_loader)


def ttfts(run) -> list[float]:
    return sorted(run.ttft.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "base"), default="tiny",
                        help="the demo zoo's model (default: the shipped demo_size, tiny)")
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS,
                        help="tokens of the shared system prompt (cut to what the model's context holds)")
    parser.add_argument("--alone", type=int, default=16,
                        help="requests timed alone per setting (the serial rate: those without the cache)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--load", type=float, default=0.5, help="arrival rate / the cache-off serial rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-s", type=float, default=240.0, help="longest one run may take")
    parser.add_argument("--demo-dir", default=str(Path(tempfile.gettempdir()) / "lora-cluster-bench-zoo"))
    parser.add_argument("--max-loras", type=int, help="device adapter slots (default: the shipped default)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    notes = []
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        notes.append(f"torch runs {args.threads} thread(s): on a 2-core machine that other jobs load, a "
                     "parallel matmul waits for whichever of its threads is descheduled, and step times "
                     "swing by 2-5x (docs/bench_decode.md)")
    settings = {"demo_num_adapters": ADAPTERS, "demo_dir": args.demo_dir, "demo_size": args.size}
    if args.max_loras is not None:
        settings["max_loras"] = args.max_loras
    config = resolve_model(ServeConfig(**settings))
    engines = {cache: build(config, cache) for cache in (False, True)}
    rng = random.Random(args.seed)
    vocab, max_len = engines[True].model.dims.vocab_size, engines[True].max_model_len
    system = args.system_tokens
    if system + USER_TOKENS + OUTPUT_TOKENS > max_len:
        system = max_len - USER_TOKENS - OUTPUT_TOKENS
        notes.append(f"the demo zoo's model takes at most {max_len} tokens (prompt + output): the system "
                     f"prompt is {system} tokens, not {args.system_tokens}, so that its {USER_TOKENS}-token "
                     f"user turn and {OUTPUT_TOKENS} output tokens fit")
    print(*notes, sep="\n", file=sys.stderr)
    head = [rng.randrange(10, vocab) for _ in range(system)]
    adapters = [f"a{i}" for i in range(ADAPTERS)]
    params = SamplingParams(max_new_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)

    def turn() -> list[int]:
        return head + [rng.randrange(10, vocab) for _ in range(USER_TOKENS)]

    for engine in engines.values():  # one request per adapter, one at a time
        for adapter in adapters:
            engine.generate([turn()], [adapter], params)
    alone: dict[bool, list[float]] = {False: [], True: []}  # each alone, its adapter placed, interleaved
    for i in range(args.alone):
        adapter = adapters[i % 8]
        for cache in (False, True):
            alone[cache].append(engines[cache].generate([turn()], [adapter], params)[0].time_to_first_token)
    serial_rate = 1.0 / statistics.median(alone[False])
    rate = args.load * serial_rate
    offsets, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(rate)
        offsets.append(t)
    plan = [(offset, rng.choice(adapters)) for offset in offsets]
    prompts = [turn() for _ in plan]
    best: dict[bool, list[float]] = {}
    cached_share: dict[bool, float] = {}
    runs: list[str] = []
    for rep in range(args.reps):
        for cache in (False, True):
            engine = engines[cache]
            before = engine.counters_snapshot()
            started = time.perf_counter()
            run = open_loop(engine, plan, params, tag=f"{int(cache)}-{rep}", prompts=prompts,
                            bound_s=args.bound_s)
            took = time.perf_counter() - started
            after = engine.counters_snapshot()
            values = ttfts(run)
            if len(values) < len(plan):
                raise SystemExit(f"cache {'on' if cache else 'off'}: {len(values)} of {len(plan)} requests "
                                 f"had a first token within {args.bound_s:.0f} s")
            queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
            hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            runs.append(f"| {rep + 1} | {'on' if cache else 'off'} | {took:.1f} | "
                        f"{percentile(values, 0.5) * 1000:.1f} |")
            if cache not in best or percentile(values, 0.5) < percentile(best[cache], 0.5):
                best[cache] = values
                cached_share[cache] = hit / queried if queried else 0.0
            print(runs[-1], file=sys.stderr)

    def row(cache: bool) -> str:
        v = best[cache]
        return (f"| {'on (default)' if cache else 'off'} | {statistics.mean(v) * 1000:.1f} | "
                f"{percentile(v, 0.5) * 1000:.1f} | {percentile(v, 0.9) * 1000:.1f} | "
                f"{cached_share[cache]:.1%} |")

    def ratio(q: float | None) -> float:
        pick = statistics.mean if q is None else (lambda v: percentile(v, q))
        return pick(best[False]) / pick(best[True])

    command = "python benchmarks/bench_prefix_cache.py " + " ".join(sys.argv[1:])
    lines = header("Prefix caching: TTFT with a shared system prompt", command.strip(), level=2,
                   changed=changed_settings(settings, REASONS))
    lines += [f"- note: {n}" for n in notes]
    lines += [
        f"- workload: {len(plan)} requests, Poisson arrivals at {rate:.2f} req/s ({args.load:g} x the "
        f"cache-off engine's serial rate of {serial_rate:.2f} req/s), prompts of {system} shared + "
        f"{USER_TOKENS} own tokens, {ADAPTERS} adapters, {OUTPUT_TOKENS} output tokens; best of "
        f"{args.reps} alternating runs per setting",
        "",
        "| prefix cache | TTFT mean ms | TTFT p50 ms | TTFT p90 ms | prompt tokens from the cache |",
        "|---|---|---|---|---|",
        row(False),
        row(True),
        "",
        f"TTFT without / with the cache: mean {ratio(None):.1f}x, p50 {ratio(0.5):.1f}x, "
        f"p90 {ratio(0.9):.1f}x. A request alone (no other load, its adapter placed; median of "
        f"{args.alone}): "
        f"{statistics.median(alone[False]) * 1000:.1f} ms without the cache, "
        f"{statistics.median(alone[True]) * 1000:.1f} ms with it "
        f"({statistics.median(alone[False]) / statistics.median(alone[True]):.1f}x).",
        "",
        "Every run (wall seconds, TTFT p50 ms):",
        "",
        "| run | prefix cache | wall s | TTFT p50 ms |",
        "|---|---|---|---|",
        *runs,
    ]
    emit("\n".join(lines), None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()

"""`python -m lora_cluster.sim.experiments chats`: prefix-aware against adapter-only routing on the
chat workload (`sim.chats`), the table of docs/prefix_caching.md ("The simulator at 32 nodes").

    python -m lora_cluster.sim.experiments chats --nodes 32 --adapters 64 --chats 1600 --turns 8 \
        --think 5 --duration 120 [--profile gpu|cpu|PATH] [--set prefix_routing_share=0.25] [--save runs.json]

Each run is `simulation.run` of the `lora-cluster` policy with `RouterConfig.prefix_aware_routing`
on, then off (the same chats: one seed), every other setting the shipped default unless `--set`
changes it. A row: turns answered and refused, the cached-token share (prompt tokens of measured
answered turns found in their replica's prefix cache), requests answered per replica (min / mean /
max, and max over mean), TTFT p50 / p99 over every class, the interactive class's SLO attainment,
the adapter hit rate and the prefix cache's evictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from lora_cluster.sim.chats import ChatSettings
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.simulation import SimConfig, run


def chat_runs(args: argparse.Namespace, serve: ServeSections) -> list[dict[str, Any]]:
    """Prefix-aware, then adapter-only routing; each run as {config, result, details}."""
    chats = ChatSettings(sessions=args.chats, turns=args.turns, think_s=args.think,
                         system_tokens=args.system_tokens)
    runs = []
    for aware in (True, False):
        config = SimConfig(nodes=args.nodes, adapters=args.adapters, zipf=args.zipf, duration=args.duration,
                           warmup=args.warmup, seed=args.seed, max_loras=args.max_loras, profile=args.profile,
                           preload=args.preload or 0, chats=chats,
                           serve=serve.with_fields(prefix_aware_routing=aware))
        result = run(config)
        print(f"# prefix-aware {aware}: wall {result.wall_s:.1f} s", file=sys.stderr, flush=True)
        runs.append({"config": {k: v for k, v in dataclasses.asdict(config).items() if k != "serve"},
                     "serve": config.serve.to_json(), "result": result.to_json(),
                     "details": result.details})
    return runs


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(runs: list[dict[str, Any]]) -> str:
    """The header line (what ran) and one row per run."""
    if not runs:
        return ""
    c, chats = runs[0]["config"], runs[0]["result"]["chats"]
    head = (f"profile {runs[0]['details']['profile']}; {c['nodes']} nodes x {c['adapters']} adapters "
            f"(Zipf {c['zipf']:g}), max_loras {c['max_loras']}; {chats['sessions']} users chatting at once, "
            f"up to {chats['turns']} turns of a chat, think time {chats['think_s']:g} s (mean), "
            f"system prompt {chats['system_tokens']} tokens per adapter; "
            f"prefix_routing_share {chats['prefix_routing_share']:g}; "
            f"{c['duration']:g} s measured after {c['warmup']:g} s")
    lines = [head, "",
             "| routing | turns answered | refused | cached-token share "
             "| requests per replica min / mean / max | max / mean | TTFT p50 / p99 s | interactive SLO "
             "| adapter hit rate | cache evictions | wall s |",
             "|" + "---|" * 11]
    for r in runs:
        res, ch = r["result"], r["result"]["chats"]
        load = ch["replica_load"]
        ratio = "-" if load["max_over_mean"] is None else f"{load['max_over_mean']:.2f}"
        lines.append(
            f"| {'prefix-aware' if ch['prefix_aware_routing'] else 'adapter-only'} | {res['completed']} "
            f"| {res['rejected']} | {_pct(ch['cached_token_share'])} "
            f"| {load['min']} / {load['mean']:.0f} / {load['max']} | {ratio} "
            f"| {_s(ch['ttft_p50_s'])} / {_s(ch['ttft_p99_s'])} "
            f"| {_pct(res['classes']['interactive']['slo_attainment'])} | {_pct(res['hit_rate'])} "
            f"| {r['details']['chats']['prefix_cache_evictions']} | {res['wall_s']:.0f} |")
    return "\n".join(lines)

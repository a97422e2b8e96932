"""Prefix-aware routing on a cluster: multi-turn chats over 64 adapters on 4 replicas, routed with
prefix-aware routing (the default) and with adapter-only routing (`prefix_aware_routing` off).

The app is the shipped one (`serve.app.build_app`, the demo zoo's tiny model, its 64 adapters)
served in process by Ray Serve on 127.0.0.1, with 4 LoRA replicas. Each setting runs in a child
process of its own (a fresh Ray; `LORA_CLUSTER_PREFIX_AWARE_ROUTING=true|false` in its
environment, read by `build_app` as any `LORA_CLUSTER_<FIELD>`), the settings alternating
(`--reps`), the best run of each kept (highest cached-token share).

Workload: chats through the OpenAI chat endpoint (`/v1/chat/completions`), as a chat client sends
them: a system prompt shared by the chats of one adapter (about `--system-tokens` tokens), then
turns: each turn's messages are the previous turn's plus the assistant's answer and a new user
message (about `--user-tokens` tokens), so each prompt extends the previous prompt and its answer.
`--chats-per-adapter` chats per adapter (with `--zipf s`: as many chats, each of an adapter drawn
with weight 1 / rank^s, a few hot adapters and a long tail), `--turns` turns each,
`--answer-tokens` greedy tokens per answer (EOS ignored); a chat ends early when its next turn
would not fit the model's context. The chats run in rounds (the first chat of every adapter, then
the second of every adapter, ...; with `--zipf`, in the order drawn), taken
by `--concurrency` clients, each running one chat at a time, turn after turn (closed loop).

Reported per setting: the cached-token share (sum of `usage.prompt_tokens_details.cached_tokens`
over the sum of `usage.prompt_tokens`), the share a perfect router with an unbounded cache would
reach (the ceiling: for each prompt, its longest block-aligned prefix shared with an earlier prompt,
or an earlier prompt and its answer, of the same adapter, client-side tokenization), the requests
per replica (from the `x-lora-replica` response header: max / mean), TTFT-free latency (p50 and p90
of the request time, non-streaming) and each replica's prefix cache as `GET /v1/cluster` shows it.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_prefix_cluster.py [--reps 1] [--chats-per-adapter 3]
     [--turns 5] [--concurrency 16] [--zipf 0] [--bound-s 300] [--out report.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import changed_settings, header, load_avg, percentile, start_serve

REPLICAS = 4
WORKLOAD = ("adapters", "chats_per_adapter", "turns", "system_tokens", "user_tokens", "answer_tokens",
            "concurrency", "seed", "bound_s", "demo_dir", "zipf")  # options a child run takes from its parent
BLOCK = 16  # the shipped kv_block_size
REASONS = {
    "num_replicas": "the cluster benchmark of the issue runs 4 replicas",
    "demo_dir": "a scratch folder for the demo zoo, not the user's cache",
}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"num_replicas": REPLICAS, "demo_dir": args.demo_dir}


# ----- the workload -----------------------------------------------------------------------------------


def text_of(tokenizer: Any, sentences: list[str], rng: random.Random, tokens: int) -> str:
    """Sentences of the demo corpus, picked at random, until the text has about `tokens` tokens."""
    out: list[str] = []
    while len(tokenizer.encode(" ".join(out), add_special_tokens=False)) < tokens:
        out.append(rng.choice(sentences))
    return " ".join(out)


class Chat:
    """One chat: its adapter, its messages so far and the user turns still to come."""

    def __init__(self, adapter: str, system: str, users: list[str]):
        self.adapter, self.users = adapter, users
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]


def plan(args: argparse.Namespace, tokenizer: Any) -> list[Chat]:
    from lora_cluster.demo import corpus

    rng = random.Random(args.seed)
    sentences = corpus(400)
    adapters = [f"a{i}" for i in range(args.adapters)]
    systems = {a: text_of(tokenizer, sentences, rng, args.system_tokens) for a in adapters}
    if args.zipf > 0:  # as many chats, each of an adapter drawn with weight 1 / rank^zipf
        weights = [1 / (i + 1) ** args.zipf for i in range(len(adapters))]
        picks = [rng.choices(adapters, weights)[0] for _ in range(args.chats_per_adapter * len(adapters))]
    else:
        picks = [a for _ in range(args.chats_per_adapter) for a in adapters]
    return [Chat(a, systems[a], [text_of(tokenizer, sentences, rng, args.user_tokens)
                                 for _ in range(args.turns)]) for a in picks]


# ----- one setting (a child process) ------------------------------------------------------------------


async def run_chats(base: str, chats: list[Chat], args: argparse.Namespace, tokenizer: Any,
                    max_len: int) -> dict[str, Any]:
    import httpx

    records: list[dict[str, Any]] = []
    seen: dict[str, list[list[int]]] = {}  # adapter -> earlier prompts and prompts + answers (token ids)
    queue: asyncio.Queue[Chat] = asyncio.Queue()
    for chat in chats:
        queue.put_nowait(chat)
    deadline = time.monotonic() + args.bound_s
    errors: list[str] = []

    def ids(messages: list[dict[str, str]], generation: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True,
                                                  return_dict=False))

    def ceiling(adapter: str, prompt: list[int]) -> int:
        best = 0
        for earlier in seen.get(adapter, ()):
            n = 0
            for a, b in zip(prompt, earlier, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            chat = queue.get_nowait()
            for user in chat.users:
                chat.messages.append({"role": "user", "content": user})
                prompt = ids(chat.messages, True)
                if len(prompt) + args.answer_tokens > max_len or time.monotonic() >= deadline:
                    break
                body = {"model": chat.adapter, "messages": chat.messages, "max_tokens": args.answer_tokens,
                        "temperature": 0, "ignore_eos": True}
                sent = time.monotonic()
                r = await http.post("/v1/chat/completions", json=body)
                took = time.monotonic() - sent
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    break
                usage = r.json()["usage"]
                answer = r.json()["choices"][0]["message"]["content"] or ""
                records.append({"adapter": chat.adapter, "replica": r.headers.get("x-lora-replica"),
                                "prompt": usage["prompt_tokens"],
                                "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                "client_prompt": len(prompt), "ceiling": ceiling(chat.adapter, prompt),
                                "seconds": took})
                chat.messages.append({"role": "assistant", "content": answer})
                seen.setdefault(chat.adapter, []).extend([prompt, ids(chat.messages, False)])

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=args.bound_s) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
        view = (await http.get("/v1/cluster")).json()
    return {"records": records, "errors": errors, "wall_s": time.monotonic() - started,
            "cluster": {rid: r.get("prefix_cache") for node in view.get("nodes", {}).values()
                        for rid, r in node.get("replicas", {}).items()}}


async def warm_up(base: str, adapters: list[str], bound_s: float) -> None:
    """One short request per adapter (sequential) so that every replica is up and has reported."""
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=bound_s) as http:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            try:
                if (await http.get("/v1/models")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
        for adapter in adapters:
            body = {"model": adapter, "prompt": "hello", "max_tokens": 1}
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"warm-up of {adapter} failed: {r.status_code} {r.text[:200]}")


def child(args: argparse.Namespace) -> None:
    from ray import serve
    from transformers import AutoTokenizer

    from lora_cluster.config import ServeConfig
    from lora_cluster.serve.app import build_app
    from lora_cluster.serve.replica.model import resolve_model

    config = resolve_model(ServeConfig(**settings(args)))
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    positions = json.loads((Path(config.model) / "config.json").read_text())["max_position_embeddings"]
    max_len = min(config.engine.max_model_len, positions)
    chats = plan(args, tokenizer)
    base = start_serve(2 * REPLICAS + 2, address="local")
    try:
        serve.run(build_app(settings(args)), name="prefix-cluster", route_prefix="/")
        asyncio.run(warm_up(base, [f"a{i}" for i in range(args.adapters)], args.bound_s))
        result = asyncio.run(run_chats(base, chats, args, tokenizer, max_len))
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    result["prefix_aware_routing"] = ServeConfig().router.prefix_aware_routing
    result["load"] = load_avg()
    args.json.write_text(json.dumps(result))


# ----- the parent: alternate the settings, report ------------------------------------------------------


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    records = result["records"]
    prompt = sum(r["prompt"] for r in records)
    per_replica = Counter(r["replica"] for r in records)
    mean = statistics.fmean(per_replica.values()) if per_replica else 0.0
    seconds = [r["seconds"] for r in records]
    return {"requests": len(records), "errors": len(result["errors"]),
            "share": sum(r["cached"] for r in records) / prompt if prompt else 0.0,
            "ceiling": sum(r["ceiling"] for r in records) / prompt if prompt else 0.0,
            "prompt_mean": prompt / len(records) if records else 0.0,
            "per_replica": dict(sorted(per_replica.items())),
            "imbalance": max(per_replica.values()) / mean if mean else 0.0,
            "p50": percentile(seconds, 0.5), "p90": percentile(seconds, 0.9),
            "rps": len(records) / result["wall_s"], "wall_s": result["wall_s"], "load": result["load"],
            "cluster": result["cluster"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--chats-per-adapter", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=12)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=0.0,
                        help="adapter popularity: 0 (default) every adapter has chats-per-adapter chats; "
                        "s > 0: as many chats, adapters drawn with weight 1 / rank^s")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-s", type=float, default=300.0, help="longest the chats of one run may take")
    parser.add_argument("--demo-dir", default=str(Path(tempfile.gettempdir()) / "lora-cluster-bench-zoo"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.child:
        child(args)
        return
    runs: list[tuple[int, bool, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for aware in (True, False):
                out = Path(tmp) / f"{rep}-{aware}.json"
                env = {**os.environ, "LORA_CLUSTER_PREFIX_AWARE_ROUTING": "true" if aware else "false"}
                cmd = [sys.executable, __file__, "--child", "--json", str(out)]
                for name in WORKLOAD:
                    cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
                subprocess.run(cmd, env=env, check=True, timeout=args.bound_s + 600)
                result = json.loads(out.read_text())
                if result["prefix_aware_routing"] is not aware:
                    raise SystemExit(f"the child ran prefix_aware_routing {result['prefix_aware_routing']}, "
                                     f"not {aware}: LORA_CLUSTER_PREFIX_AWARE_ROUTING was not applied")
                summary = summarize(result)
                runs.append((rep, aware, summary))
                print(f"run {rep + 1} prefix-aware {aware}: share {summary['share']:.1%} ceiling "
                      f"{summary['ceiling']:.1%} imbalance {summary['imbalance']:.2f} "
                      f"{summary['per_replica']} errors {summary['errors']}", file=sys.stderr)
    best = {aware: max((s for _, a, s in runs if a == aware), key=lambda s: s["share"])
            for aware in (True, False)}

    def row(aware: bool) -> str:
        s = best[aware]
        counts = ", ".join(str(n) for n in s["per_replica"].values())
        return (f"| {'prefix-aware (default)' if aware else 'adapter-only'} | **{s['share']:.1%}** | "
                f"{s['ceiling']:.1%} | {s['requests']} ({s['errors']} errors) | {counts} | "
                f"{s['imbalance']:.2f} | {s['p50'] * 1000:.0f} / {s['p90'] * 1000:.0f} | {s['rps']:.1f} |")

    command = "RAY_AUTH_MODE=disabled python benchmarks/bench_prefix_cluster.py " + " ".join(sys.argv[1:])
    lines = header("Prefix-aware routing: multi-turn chats over 64 adapters on 4 replicas", command.strip(),
                   level=2, changed=changed_settings(settings(args), REASONS))
    lines += [
        "- load average (1 / 5 / 15 min) at the end of each run: "
        + "; ".join(f"{'aware' if a else 'adapter-only'} {s['load']}" for _, a, s in runs),
        f"- workload: {args.adapters} adapters x {args.chats_per_adapter} chats"
        f"{f' (adapters drawn Zipf {args.zipf:g})' if args.zipf > 0 else ''} x up to {args.turns} turns "
        f"(chat endpoint), a system prompt of ~{args.system_tokens} tokens per adapter, user turns of "
        f"~{args.user_tokens} tokens, answers of {args.answer_tokens} tokens (greedy, EOS ignored), "
        f"{args.concurrency} concurrent chat clients, chats in rounds over the adapters; a turn that would "
        "not fit the model's 512 positions ends its chat; best of "
        f"{args.reps} alternating run(s) per setting (highest share)",
        "",
        "| routing | cached-token share | ceiling | requests | per replica | max / mean | "
        "request p50 / p90 ms | requests/s |",
        "|---|---|---|---|---|---|---|---|",
        row(True),
        row(False),
        "",
        "Cached-token share: sum of usage.prompt_tokens_details.cached_tokens / sum of usage.prompt_tokens. "
        "Ceiling: the share a perfect router with an unbounded cache would reach on the same prompts. "
        "Per replica: requests each replica served (x-lora-replica).",
        "",
        "Each replica's prefix cache at the end of the best runs (GET /v1/cluster):",
        "",
        "| routing | replica | queried tokens | hit tokens | hit rate | cached blocks | evictions |",
        "|---|---|---|---|---|---|---|",
    ]
    for aware in (True, False):
        for rid, pc in sorted(best[aware]["cluster"].items()):
            if pc:
                lines.append(f"| {'prefix-aware' if aware else 'adapter-only'} | {rid[-8:]} | "
                             f"{pc['queried_tokens']} | {pc['hit_tokens']} | {pc['hit_rate']} | "
                             f"{pc['cached_blocks']} | {pc['evictions']} |")
    lines += ["", "Every run:", "", "| run | routing | share | ceiling | max / mean | wall s |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {rep + 1} | {'prefix-aware' if a else 'adapter-only'} | {s['share']:.1%} | "
              f"{s['ceiling']:.1%} | {s['imbalance']:.2f} | {s['wall_s']:.0f} |" for rep, a, s in runs]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

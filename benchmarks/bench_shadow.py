"""What a release's shadow traffic costs live requests: live TTFT p99 with and without shadow copies.

One engine with the shipped `EngineConfig` defaults on the tiny demo model. Live traffic is
open-loop Poisson at `--rate` requests/s for `--duration` s on the stable version (adapter a3), at
the `interactive` class's priority, `--max-tokens` greedy tokens each. With shadow on, as the
ingress does it (`serve.http.release_shadow`): when a live request finishes, with probability
`--shadow` percent (default 10, as in the issue's acceptance) a copy of it starts on the candidate
(adapter a4) at the least urgent class's priority (`batch`), and it is never part of the live
figures. Off and on alternate over `--rounds` on the same seeded arrivals; each keeps its best p99
(the machine is shared: the best round is the least disturbed one).

The rated load: `--rate` is chosen below the engine's capacity on this machine (a live TTFT p99 in
tens of ms with shadow off); the report prints the figures and the ratio on/off of the p99
(target <= 1.05: at most 5% added). The engine-side cost only: the ingress's copy is one task per
copied request after the live answer (no work on the live request's path).

Run: python benchmarks/bench_shadow.py [--rate 8] [--duration 20] [--rounds 2] [--shadow 10]
    [--out docs/bench_shadow.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import emit, header, load_avg, percentile

from lora_cluster.config import ServeConfig
from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import SamplingParams, build_engine

PROMPTS = ["the river runs past a quiet town", "a farmer sells bread at the market", "the old bridge"]
STABLE, CANDIDATE = "a3", "a4"


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def run(engine, plan: list[float], params: SamplingParams, shadow: float, tag: str,
        bound_s: float) -> dict:
    """Live requests at `plan`'s offsets; a finished live one copied with probability shadow %."""
    classes = {c.name: c.priority for c in ServeConfig(model="demo").sla_classes}
    live, copies = classes["interactive"], classes["batch"]
    rng = random.Random(7)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    copied = done_copies = 0
    start, i = time.perf_counter(), 0
    while (i < len(plan) or engine.has_unfinished()) and time.perf_counter() - start < bound_s:
        now = time.perf_counter() - start
        while i < len(plan) and plan[i] <= now:
            rid = f"{tag}-{i}"
            engine.add_request(rid, PROMPTS[i % len(PROMPTS)], STABLE, params, live)
            added[rid] = time.perf_counter()
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.005, max(0.0, plan[i] - now)) if i < len(plan) else 0.0)
            continue
        for out in engine.step():
            rid = out.request_id
            if rid in added and rid not in ttft and out.token_ids:
                ttft[rid] = time.perf_counter() - added[rid]
            if out.finished and rid in added and rng.random() * 100 < shadow:
                engine.add_request(f"shadow-{rid}", PROMPTS[int(rid.rsplit("-", 1)[1]) % len(PROMPTS)],
                                   CANDIDATE, params, copies)
                copied += 1
            if out.finished and rid.startswith("shadow-"):
                done_copies += 1
    return {"ttft": [ttft[r] for r in added if r in ttft], "sent": len(plan), "copied": copied,
            "copies_done": done_copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=8.0, help="live requests per second")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shadow", type=float, default=10.0, help="percent of live requests copied")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-bench-tiny")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    zoo = build_demo_zoo(args.zoo, num_adapters=64, seed=0)
    plan = arrivals(args.rate, args.duration, seed=1)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for name, shadow in (("off", 0.0), ("on", args.shadow)):
            engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir))
            run(engine, [0.0, 0.0], params, 0.0, f"warm-{name}-{r}", 60.0)  # both adapters loaded first
            engine.add_request(f"warm-c-{name}-{r}", PROMPTS[0], CANDIDATE, params, 2)
            while engine.has_unfinished():
                engine.step()
            res = run(engine, plan, params, shadow, f"{name}-{r}", args.duration + 60.0)
            engine.close()
            p99 = percentile(res["ttft"], 0.99)
            print(f"round {r} shadow {name}: live TTFT p50 {statistics.median(res['ttft']) * 1e3:.1f} ms "
                  f"p99 {p99 * 1e3:.1f} ms; {len(res['ttft'])}/{res['sent']} live first tokens; "
                  f"copies {res['copies_done']}/{res['copied']}", flush=True)
            if name not in best or p99 < percentile(best[name]["ttft"], 0.99):
                best[name] = res
    off, on = (percentile(best[k]["ttft"], 0.99) for k in ("off", "on"))
    command = (f"python benchmarks/bench_shadow.py --rate {args.rate:g} --duration {args.duration:g} "
               f"--rounds {args.rounds} --shadow {args.shadow:g}")
    lines = header("Shadow traffic's cost on live TTFT", command, changed={})
    lines += ["", "| shadow | live TTFT p50 ms | live TTFT p99 ms | live requests | copies run |",
              "|---|---:|---:|---:|---:|"]
    for name in ("off", "on"):
        res = best[name]
        lines.append(f"| {name} | {statistics.median(res['ttft']) * 1e3:.1f} | "
                     f"{percentile(res['ttft'], 0.99) * 1e3:.1f} | {len(res['ttft'])}/{res['sent']} | "
                     f"{res['copies_done']}/{res['copied']} |")
    lines += ["", f"live TTFT p99 on / off: {on / off:.3f} (target <= 1.05); load average at the end: "
              f"{load_avg()}"]
    emit("\n".join(lines), args.out, title=None)


if __name__ == "__main__":
    main()

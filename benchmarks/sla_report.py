"""bench_sla's statistics and markdown report: per class sent, completed, refused, cut off, failed,
p50/p99 TTFT (a cut-off request without its first token counts its wait so far, a lower bound,
marked >=) and SLO attainment; the controller's counters; the slow and fast path tables; and the
`--dump` of every request."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from common import header, load_avg, percentile, rank_index
from sla_client import Outcome
from sla_phases import RunResult
from sla_setup import MAX_NUM_SEQS, MODE_CONFIG, NUM_REPLICAS, SERVE_MODE_NOTE, SLOTS
from sla_workload import ADAPTERS, CLASS_MIX, OUTPUT_TOKENS, PROMPT_WORDS, ZIPF_S


def censored_pct(samples: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """Nearest-rank percentile of (value, is_lower_bound) samples; True when it is only a lower bound."""
    if not samples:
        return math.nan, False
    s = sorted(samples)
    i = rank_index(len(s), q)
    return s[i][0], any(c for _, c in s[: i + 1])


def fmt_s(value: float, lower_bound: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return f"{'>=' if lower_bound else ''}{value:.2f}"


def class_stats(outcomes: list[Outcome], cls: str, target: float | None) -> dict[str, Any]:
    mine = [o for o in outcomes if o.req.cls == cls]
    samples = [t for o in mine if (t := o.ttft()) is not None]
    attained = sum(1 for o in mine if o.first is not None and o.error is None
                   and target is not None and o.first - o.sent <= target)
    return {
        "sent": len(mine), "completed": sum(o.completed for o in mine),
        "refused": sum(o.refused for o in mine),
        "refused_no_retry_after": sum(o.refused and not o.retry_after for o in mine),
        "cut_off": sum(o.cut_off is not None and not o.completed and not o.refused for o in mine),
        "failed": sum(o.failed for o in mine),
        "p50": censored_pct(samples, 0.5), "p99": censored_pct(samples, 0.99),
        "attainment": None if target is None or not mine else attained / len(mine),
    }


def report(args: argparse.Namespace, meta: dict[str, Any], runs: list[RunResult],
           targets: dict[str, float | None], slow: dict[str, list[dict[str, float]]] | None,
           fast: dict[str, Any] | None) -> str:
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    cmd = "RAY_AUTH_MODE=disabled python benchmarks/bench_sla.py " + " ".join(sys.argv[1:])
    lines = [
        *header("Cluster controller: SLA classes under overload", cmd.strip(), date=meta["date"],
                code=meta["code"],
                machine_note=f"; load average at the start {meta['load_start']}, at the end {load_avg()}",
                command_note=f" ({meta['wall_min']:.1f} min)"),
        f"- served: demo zoo `{args.size}` model, {NUM_REPLICAS} LoRA replicas x 1 CPU, max_num_seqs "
        f"{MAX_NUM_SEQS} ({SLOTS} batch slots), max_loras 8, less_urgent_prefill_chunk 32; Ray Serve "
        f"{args.serve_mode} mode ({SERVE_MODE_NOTE[args.serve_mode]}); modes: "
        + "; ".join(f"`{m}` {json.dumps(MODE_CONFIG[m])}" for m in args.modes),
        f"- workload: prompts of {PROMPT_WORDS[0]}-{PROMPT_WORDS[1]} words, {OUTPUT_TOKENS[0]}-"
        f"{OUTPUT_TOKENS[1]} output tokens (greedy, EOS ignored), adapters Zipf({ZIPF_S}) over "
        f"{ADAPTERS[0]}..{ADAPTERS[-1]}, classes " + ", ".join(f"{int(100 * p)}% {c}" for c, p in CLASS_MIX)
        + f"; streamed; Poisson arrivals for {args.duration:g} s per run, then {args.drain:g} s to drain, "
        "then cut off",
        "- TTFT targets (the servers' `sla_classes`, the same for every mode): "
        + ", ".join(f"{c} {'none' if t is None else f'{t:g} s'}" for c, t in targets.items()),
    ]
    if any(meta["warmup_refused"].values()):
        lines.append("- warm-up requests refused with 429 (sent again): " + ", ".join(
            f"{m} {n}" for m, n in meta["warmup_refused"].items()))
    if meta.get("uncontended"):
        lines.append("- uncontended TTFT (one streamed request at a time, the same 20 to each mode, p50): "
                     + ", ".join(f"{m} {ms(v)} ms" for m, v in meta["uncontended"].items())
                     + (f"; on - off, median of the paired differences {ms(meta['uncontended_diff'])} ms"
                        if "uncontended_diff" in meta else ""))
    if meta.get("rated_detail"):
        d = meta["rated_detail"]
        lines.append(f"- rated load: {meta['rated']:.2f} requests/s ({d['tokens_per_s']:.0f} output "
                     f"tokens/s), closed loop at {SLOTS} clients for {args.rated_seconds:g} s on `off` "
                     f"(p50 TTFT {ms(d['ttft_p50'])} ms, p50 request {d['service_p50']:.2f} s, "
                     f"{d['not_completed']} not completed)")
    elif meta.get("rated"):
        lines.append(f"- rated load: {meta['rated']:.2f} requests/s (given with --rated)")
    if runs:
        lines += ["", "TTFT in seconds; attainment = first token within the class target / requests sent "
                  "(refused, failed and cut-off requests count as missed).", "",
                  "| load | mode | class | sent | completed | refused | cut off | errors | p50 TTFT | "
                  "p99 TTFT | attainment |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for run in runs:
            for cls, target in targets.items():
                s = class_stats(run.outcomes, cls, target)
                att = "-" if s["attainment"] is None else f"{100 * s['attainment']:.1f}%"
                refused = f"{s['refused']}" + (f" ({s['refused_no_retry_after']} no Retry-After)"
                                               if s["refused_no_retry_after"] else "")
                lines.append(f"| {run.load:g}x ({run.rate:.2f}/s) | {run.mode} | {cls} | {s['sent']} | "
                             f"{s['completed']} | {refused} | {s['cut_off']} | {s['failed']} | "
                             f"{fmt_s(*s['p50'])} | {fmt_s(*s['p99'])} | {att} |")
        lines += ["", "| load | mode | wall s | completed/s in the run | machine load avg | controller "
                  "counters (delta) | ingress admission (delta) | max cluster queue | after the run |",
                  "|---|---|---:|---:|---:|---|---|---|---|"]
        for run in runs:
            done = sum(o.completed for o in run.outcomes)
            counters = run.counters.get("controller", {})
            ctrl = ", ".join(f"{k} {v}" for k, v in counters.items() if k != "reports")
            ing = ", ".join(f"{k} {v}" for k, v in run.counters.get("ingress", {}).items())
            depth = (f"{run.max_depth['depth']} {json.dumps(run.max_depth['by_class'])}, oldest wait "
                     f"{run.max_depth['oldest_wait_s']:.1f} s" if run.max_depth else "-")
            if run.max_depth.get("poll_error"):
                depth += f" (poll error: {run.max_depth['poll_error']})"
            after = json.dumps(run.after) if run.after else "-"
            lines.append(f"| {run.load:g}x | {run.mode} | {run.wall_s:.0f} | {done / run.wall_s:.2f} | "
                         f"{run.load_avg:.1f} | {ctrl or '-'} | {ing or '-'} | {depth} | {after} |")
        errors = sorted({o.error for run in runs for o in run.outcomes if o.error})
        statuses = sorted({o.status for run in runs for o in run.outcomes if o.failed and o.status})
        if errors or statuses:
            lines += ["", f"Errors seen: statuses {statuses}; " + "; ".join(errors[:5])]
    if slow:
        lines += ["", f"Slow path: {SLOTS} `standard` blockers ({args.blocker_tokens} tokens) fill every "
                  "slot, then one 1-token `standard` request is sent; its first token after the first "
                  "blocker's end (client side); rounds alternate between the modes; a round counts only "
                  "if every blocker was running when the probe was sent and (on) the probe was parked.", "",
                  "| mode | rounds (invalid) | p50 ms after a slot frees | min ms | max ms | p50 TTFT ms |",
                  "|---|---|---:|---:|---:|---:|"]
        for mode, res in slow.items():
            rows = res["rows"]
            if not rows:
                lines.append(f"| {mode} | 0 ({res['invalid']}) | - | - | - | - |")
                continue
            after = sorted(r["after_free"] for r in rows)
            ttft = sorted(r["ttft"] for r in rows)
            lines.append(f"| {mode} | {len(rows)} ({res['invalid']}) | {ms(percentile(after, 0.5))} | "
                         f"{ms(after[0])} | {ms(after[-1])} | {ms(percentile(ttft, 0.5))} |")
    if fast:
        lat, cpu, micro, counts = fast["lat"], fast["cpu"], fast["micro"], fast["counts"]
        n = len(next(iter(lat.values())))
        lines += ["", f"Fast path: tiny demo model, {NUM_REPLICAS} replicas per app, one 1-token "
                  f"non-streaming request at a time, {n} rounds (after {args.fast_warmup} warm-up "
                  "rounds), on and off alternating in each round.", "",
                  "| mode | p50 ms | p90 ms | p99 ms | mean ms | "
                  f"app CPU s over the {fast['phase_s']:.0f} s phase |",
                  "|---|---:|---:|---:|---:|---|"]
        for mode, samples in lat.items():
            s = sorted(samples)
            c = cpu.get(mode, {})
            p50, p90, p99 = (ms(percentile(s, q)) for q in (0.5, 0.9, 0.99))
            lines.append(f"| {mode} | {p50} | {p90} | {p99} | "
                         f"{ms(statistics.fmean(s))} | {sum(c.values()):.1f} ("
                         + ", ".join(f"{k} {v:.1f}" for k, v in sorted(c.items())) + ") |")
        if {"on", "off"} <= set(lat):
            diffs = sorted(a - b for a, b in zip(lat["on"], lat["off"], strict=True))
            lo, hi = bootstrap_median_ci(diffs)
            on, off = sorted(lat["on"]), sorted(lat["off"])
            lines += ["", f"- on - off: median of paired differences {ms(percentile(diffs, 0.5))} ms (95% "
                      f"bootstrap interval {ms(lo)} to {ms(hi)} ms); p50 "
                      f"{ms(percentile(on, 0.5) - percentile(off, 0.5))} ms; p99 "
                      f"{ms(percentile(on, 0.99) - percentile(off, 0.99))} ms",
                      f"- the `on` ingress's admission counters over the phase: {json.dumps(counts)}",
                      f"- in process, `ClusterAdmission` admit + started + finished per request: on "
                      f"{1e6 * micro['on']:.2f} µs, off {1e6 * micro['off']:.2f} µs"]
    return "\n".join(lines) + "\n"


def dump_outcomes(path: Path, runs: list[RunResult]) -> None:
    """One JSON line per SLA-run request: mode, load, class, adapter, max_tokens, HTTP status, the
    completion id, the serving replica and hit headers, and its times in seconds on the machine's
    monotonic clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux, as the servers' `time.monotonic`,
    so they line up with server-side timestamps): sent, first token, done, cut off (null: none)."""
    with path.open("w") as f:
        for run in runs:
            for o in run.outcomes:
                f.write(json.dumps({
                    "mode": run.mode, "load": run.load, "cls": o.req.cls, "adapter": o.req.adapter,
                    "max_tokens": o.req.max_tokens, "status": o.status, "id": o.response_id,
                    "replica": o.replica, "hit": o.hit, "sent": o.sent, "first": o.first, "done": o.done,
                    "cut_off": o.cut_off, "error": o.error}) + "\n")


def bootstrap_median_ci(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps)]

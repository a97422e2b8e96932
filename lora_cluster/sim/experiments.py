"""The runs behind docs/scale.md: a table of policies x loads, and a load sweep plotted to PNG.

    python -m lora_cluster.sim.experiments capacity [--sizes 32x1000 --zipfs 1.0 --seeds 0 --workers 2] \
        [--save capacity.json]
    python -m lora_cluster.sim.experiments grid [--duration 60 --warmup 20 --workers 2] \
        [--save runs.json]
    python -m lora_cluster.sim.experiments table --nodes 32 --adapters 1000 --max-loras 16 \
        --loads 1,2 --duration 300 [--profile gpu|cpu|PATH] [--bases K | --base-nodes 18,14] \
        [--save runs.json]
    python -m lora_cluster.sim.experiments sweep --nodes 32 --adapters 1000 --max-loras 16 \
        --loads 0.5,1,1.5,2,2.5,3 --duration 120 --profile cpu --plot docs/scale_sweep_cpu.png
    python -m lora_cluster.sim.experiments render --save runs.json [--plot FILE]
    python -m lora_cluster.sim.experiments router-cost
    python -m lora_cluster.sim.experiments chats --nodes 32 --adapters 64 --chats 1600 --turns 8 --think 5

Every subcommand runs the `gpu` profile (docs/profile_gpu_papers.json) unless `--profile` names
another (`cpu`: measured on this 2-core machine), and every table starts with the profile it ran.

`capacity` finds each policy's capacity at SLO (`sim.capacity`: the largest load, by bisection to
0.05x, at which interactive >= 99%, standard >= 95%, batch completes >= 99% with p99 wait <= 60 s)
per cell of 2 sizes x Zipf {0.8, 1.0, 1.2} x seeds {0, 1} for ours, the `oracle` reference and both
baselines, then compares hit rates at 0.9x of our capacity (`sim.capacity_grid`); `--sizes`,
`--zipfs`, `--seeds`, `--policies` run a part of it; it exits 1 when a cell fails.

`grid` runs the acceptance grid (`sim.grid`): Zipf {0.8, 1.0, 1.2} x load {1, 1.5, 2} x seeds {0, 1}
at 32 nodes x 1,000 adapters and 24 nodes x 1,500, each cell with `lora-cluster` and both baselines,
every adapter preloaded unless `--preload` says otherwise, in `--workers` processes; it prints one
row per cell with pass/fail against the targets, and exits 1 when a cell fails. `--sizes`,
`--zipfs`, `--loads`, `--seeds` run a part of it.

`router-cost` times a routing decision at 32 to 1024 replicas (CPU time, p50 and p99): the full rank
(`PlacementTracker.view` for every replica, then `rank_replicas`, the live router's work before
the index) and `cluster.routing_index.RoutingIndex` (what `LoraAffinityRouter.choose_replicas` and
the simulator run); `benchmarks/bench_router_index.py` times the live router itself.

`chats` runs multi-turn chats (`--chats` users at once, `sim.chats`) with prefix-aware routing and
with adapter-only routing, and prints their cached-token share, requests per replica and TTFT
(`sim.chat_table`).

`table` prints a markdown table (one row per policy and load), then where the adapter slots went
(`census.SlotCensus`) and which requests each class completed by the popularity rank of their
adapter; `sweep` runs the same grid and plots
SLO attainment (interactive, standard) and hit rate against load (needs matplotlib, which the
project does not depend on: `pip install matplotlib`); `--save` keeps every run's result as JSON so
that `render` can redraw without running again. `--bases K` (or `--base-nodes 18,14`) splits the
nodes into K replica groups, one base model each (`sim.bases`), and adds a table of per-base
figures. Each run is `simulation.run`, one after another.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lora_cluster.cluster.routing_index import RoutingIndex
from lora_cluster.cluster.routing_score import PlacementTracker, rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.sim import capacity_grid, capacity_table, chat_table
from lora_cluster.sim import grid as acceptance
from lora_cluster.sim.capacity import SloTargets
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.simulation import POLICIES, SimConfig, run

ORDER = ("lora-cluster", "serve-multiplex", "round-robin")


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every policy at every load; each run as {config, result, details}."""
    runs = []
    for load in (float(x) for x in (args.loads or "1,2").split(",")):
        for policy in args.policies.split(","):
            config = SimConfig(nodes=args.nodes, adapters=args.adapters, zipf=args.zipf, load=load,
                               duration=args.duration, warmup=args.warmup, seed=args.seed,
                               max_loras=args.max_loras, policy=policy, profile=args.profile,
                               preload=args.preload or 0, serve=serve_settings(args.set),
                               bases=args.bases, base_nodes=base_nodes(args.base_nodes))
            result = run(config)
            print(f"# {policy} load {load:g}: wall {result.wall_s:.1f} s", file=sys.stderr, flush=True)
            runs.append({"config": {k: v for k, v in asdict(config).items() if k != "serve"},
                         "result": result.to_json(), "details": result.details})
    return runs


def base_nodes(spec: str) -> tuple[int, ...]:
    """`--base-nodes 20,12`: each base's nodes (empty: equal shares)."""
    try:
        return tuple(int(n) for n in spec.split(",")) if spec else ()
    except ValueError:
        raise SystemExit(f"--base-nodes: comma-separated node counts, got {spec!r}") from None


def serve_settings(pairs: list[str]) -> ServeSections:
    """The control plane's sections with `name=value` overrides by flat name (e.g.
    cluster_queue_aging_s=60); the sections validate each value."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        values[name] = raw
    try:
        return ServeSections().with_fields(**values)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(runs: list[dict[str, Any]]) -> str:
    """One row per run: completed, rejected, hit rate (and its ceiling), loads per tier, per class
    TTFT p50/p99 and SLO attainment, the controller's CPU per simulated second and queue depth."""
    head = ("| policy | load | completed | rejected | hit rate (ceiling) | loads host / disk / s3 "
            "| interactive p50 / p99 s, SLO | standard p50 / p99 s, SLO | batch p50 / p99 s, SLO "
            "| controller CPU s per s, queue mean / max | wall s |")
    lines = [profile_line(runs), "", head, "|" + "---|" * 11]
    ranked = sorted(runs, key=lambda r: (r["config"]["load"], ORDER.index(r["config"]["policy"])))
    for r in ranked:
        res, d = r["result"], r["details"]
        classes = [f"{_f(c['ttft_p50_s'])} / {_f(c['ttft_p99_s'])}, {_pct(c['slo_attainment'])}"
                   for c in res["classes"].values()]
        loads = res["adapter_loads"]
        controller = "-"
        if "controller_cpu_s" in d:
            controller = (f"{d['controller_cpu_s'] / d['simulated_s']:.2f}, "
                          f"{d['queue_depth_mean']:.0f} / {d['queue_depth_max']}")
        lines.append(
            f"| {r['config']['policy']} | {r['config']['load']:g}x | {res['completed']} | {res['rejected']} "
            f"| {_pct(res['hit_rate'])} ({_pct(d['hit_rate_ceiling'])}) "
            f"| {loads['host']} / {loads['disk']} / {loads['s3']} | {' | '.join(classes)} "
            f"| {controller} | {res['wall_s']:.0f} |")
    return "\n".join(lines)


def bases_markdown(runs: list[dict[str, Any]]) -> str:
    """With several base models (`sim.bases`): one row per run and base, its replicas, share of
    the traffic, completed and rejected requests, hit rate (and its ceiling), per-class SLO."""
    with_bases = [r for r in runs if r["result"].get("bases")]
    if not with_bases:
        return ""
    names = list(with_bases[0]["result"]["classes"])
    lines = ["| policy | load | base | replicas | traffic share | completed | rejected "
             "| hit rate (ceiling) | " + " | ".join(f"{n} SLO" for n in names) + " |",
             "|" + "---|" * (8 + len(names))]
    ranked = sorted(with_bases, key=lambda r: (r["config"]["load"], ORDER.index(r["config"]["policy"])))
    for r in ranked:
        for base, b in r["result"]["bases"].items():
            slo = " | ".join(_pct(b["slo_attainment"][n]) for n in names)
            lines.append(f"| {r['config']['policy']} | {r['config']['load']:g}x | {base} "
                         f"| {len(b['replicas'])} | {_pct(b['traffic_share'])} | {b['completed']} "
                         f"| {b['rejected']} "
                         f"| {_pct(b['hit_rate'])} ({_pct(b['hit_rate_ceiling'])}) | {slo} |")
    return "\n".join(lines)


def profile_line(runs: list[dict[str, Any]]) -> str:
    """The profile (and start state) the runs used, as the table's first line."""
    profiles = sorted({str(r["details"].get("profile")) for r in runs})
    c = runs[0]["config"] if runs else {}
    start = f"{c['preload']} adapters preloaded" if c.get("preload") else "every adapter in S3 at start"
    return f"profile {', '.join(profiles)}; {start}"


def census_markdown(runs: list[dict[str, Any]]) -> str:
    """Each run's slot census (`census.SlotCensus`): mean slots by the popularity rank of their
    adapter, running (pinned by requests) / cached (evictable)."""
    with_census = [r for r in runs if r["details"].get("slot_census")]
    if not with_census:
        return ""
    labels = list(with_census[0]["details"]["slot_census"]["by_rank"])
    cols = " | ".join(f"ranks {label} running / cached" for label in labels)
    lines = [f"| policy | load | hit rate + joined a load under way | slots | {cols} |",
             "|" + "---|" * (4 + len(labels))]
    for r in sorted(with_census, key=lambda r: (r["config"]["load"], ORDER.index(r["config"]["policy"]))):
        census = r["details"]["slot_census"]
        cells = [f"{c['running']:.0f} / {c['cached']:.0f}" for c in census["by_rank"].values()]
        hits = f"{_pct(r['result']['hit_rate'])} + {_pct(r['details'].get('joined_load_rate'))}"
        lines.append(f"| {r['config']['policy']} | {r['config']['load']:g}x | {hits} | {census['slots']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def served_markdown(runs: list[dict[str, Any]]) -> str:
    """Per run and class, the share of the requests completed by the popularity rank of their
    adapter (`details["completed_by_rank"]`): whom a policy serves under overload, and whom it refuses."""
    with_ranks = [r for r in runs if r["details"].get("completed_by_rank")]
    if not with_ranks:
        return ""
    labels = list(next(iter(with_ranks[0]["details"]["completed_by_rank"].values())))
    cols = " | ".join(f"ranks {label}" for label in labels)
    lines = [f"| policy | load | class | {cols} |", "|" + "---|" * (3 + len(labels))]
    for r in sorted(with_ranks, key=lambda r: (r["config"]["load"], ORDER.index(r["config"]["policy"]))):
        for name, cells in r["details"]["completed_by_rank"].items():
            shares = [f"{_pct(c['completed'] / c['offered'] if c['offered'] else None)} of {c['offered']}"
                      for c in cells.values()]
            lines.append(f"| {r['config']['policy']} | {r['config']['load']:g}x | {name} | "
                         + " | ".join(shares) + " |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    def attainment(name: str) -> Any:
        return lambda r: r["result"]["classes"][name]["slo_attainment"]

    panels = [("interactive SLO attainment", attainment("interactive")),
              ("standard SLO attainment", attainment("standard")),
              ("hit rate", lambda r: r["result"]["hit_rate"])]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for policy in ORDER:
            mine = sorted((r for r in runs if r["config"]["policy"] == policy),
                          key=lambda r: r["config"]["load"])
            if mine:
                ax.plot([r["config"]["load"] for r in mine], [100 * (value(r) or 0) for r in mine],
                        marker="o", label=policy)
        if title == "hit rate" and runs:
            ax.axhline(100 * runs[0]["details"]["hit_rate_ceiling"], color="grey", linestyle=":",
                       label="ceiling (slots / Zipf)")
        ax.set_title(title)
        ax.set_xlabel("offered load (x rated capacity)")
        ax.set_ylabel("%")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower left", fontsize=8)
    axes[2].legend(loc="lower left", fontsize=8)
    c = runs[0]["config"]
    start = f"{c['preload']} adapters preloaded" if c.get("preload") else "every adapter in S3 at start"
    fig.suptitle(f"{c['nodes']} nodes x {c['adapters']} adapters, Zipf {c['zipf']:g}, "
                 f"max_loras {c['max_loras']}, profile {runs[0]['details']['profile']}, {start} (simulated)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def router_cost(sizes: tuple[int, ...] = (32, 256, 1024), adapters: int = 10_000, decisions: int = 2000,
                full_decisions: int = 100) -> str:
    """Markdown: CPU microseconds per routing decision (p50, p99) by replica count, the full rank
    (a view of every replica, then `rank_replicas`: the live router's work before the index)
    against `RoutingIndex` (what the live router and this simulator run). Between two decisions a
    request is sent to the chosen replica and one finishes on a random replica (both signalled)."""
    lines = ["| replicas | full rank p50 / p99 µs | index p50 / p99 µs | index decisions/s (one core) |",
             "|---|---:|---:|---:|"]
    weights = [1.0 / (k + 1) for k in range(adapters)]
    for n in sizes:
        rng = random.Random(0)
        stats = {f"r{i}": RoutingStats(resident=tuple(f"a{rng.randrange(adapters)}" for _ in range(16)),
                                       empty_adapter_slots=0, free_adapter_slots=4, max_loras=16,
                                       num_running=32, num_waiting=0, max_num_seqs=32) for i in range(n)}
        ongoing = {rid: rng.randrange(40) for rid in stats}
        wanted = [f"a{k}" for k in rng.choices(range(adapters), weights=weights,
                                               k=decisions + full_decisions)]
        index = RoutingIndex(miss_cost=4.0, placement_ttl_s=5.0, clock=lambda: 1.0,
                             ongoing=ongoing.__getitem__)
        index.replace(stats)
        tracker = PlacementTracker(ttl_s=5.0)
        costs: dict[str, list[float]] = {"full": [], "index": []}
        for k, aid in enumerate(wanted):
            t0 = time.thread_time()
            if k < full_decisions:
                views = [tracker.view(rid, s, ongoing[rid], 1.0) for rid, s in stats.items()]
                choice = rank_replicas(aid, views, 4.0)[0]
                tracker.record(choice, aid, 1.0)
            else:
                choice = index.ranked(aid)[0]
                index.record(choice, aid)
            costs["full" if k < full_decisions else "index"].append(time.thread_time() - t0)
            done = f"r{rng.randrange(n)}"
            ongoing[choice] += 1
            ongoing[done] = max(0, ongoing[done] - 1)
            index.touch(choice)
            index.touch(done)
        p = {name: (statistics.median(xs) * 1e6, sorted(xs)[int(0.99 * len(xs))] * 1e6)
             for name, xs in costs.items()}
        (f50, f99), (i50, i99) = p["full"], p["index"]
        lines.append(f"| {n} | {f50:.0f} / {f99:.0f} | {i50:.0f} / {i99:.0f} "
                     f"| {1 / statistics.fmean(costs['index']):.0f} |")
    return "\n".join(lines)


def grid_common(args: argparse.Namespace) -> acceptance.Common:
    """What every run of `grid` and `capacity` shares (60 s measured after 20 s unless given)."""
    return acceptance.Common(duration=60.0 if args.duration is None else args.duration,
                             warmup=20.0 if args.warmup is None else args.warmup, profile=args.profile,
                             preload=args.preload, max_loras=args.max_loras, serve=serve_settings(args.set))


def run_acceptance(args: argparse.Namespace) -> int:
    """`grid`: the acceptance grid (`sim.grid`), its table, and 1 when a cell fails."""
    try:
        sizes = tuple(tuple(int(x) for x in s.split("x")) for s in args.sizes.split(","))
        chosen = acceptance.cells(sizes=sizes,  # type: ignore[arg-type]
                                  zipfs=tuple(float(z) for z in args.zipfs.split(",")),
                                  loads=tuple(float(x) for x in (args.loads or "1,1.5,2").split(",")),
                                  seeds=tuple(int(s) for s in args.seeds.split(",")))
    except ValueError as e:
        raise SystemExit(f"grid: --sizes NODESxADAPTERS, --zipfs, --loads, --seeds: comma-separated numbers "
                         f"({e})") from None
    common = grid_common(args)
    runs = acceptance.run_grid(chosen, common, policies=tuple(args.policies.split(",")), workers=args.workers)
    if args.save:
        Path(args.save).write_text(json.dumps(runs, indent=1, default=str) + "\n")
    print(acceptance.header(common, runs) + "\n")
    print(acceptance.markdown(runs))
    return 0 if all(acceptance.verdict(rs)["passed"] for rs in _by_cell(runs).values()) else 1


def run_capacity(args: argparse.Namespace) -> int:
    """`capacity`: each policy's capacity at SLO per cell (`sim.capacity_grid`), its table, and 1 when
    a cell fails."""
    try:
        sizes = tuple(tuple(int(x) for x in s.split("x")) for s in args.sizes.split(","))
        chosen = capacity_grid.cells(sizes=sizes,  # type: ignore[arg-type]
                                     zipfs=tuple(float(z) for z in args.zipfs.split(",")),
                                     seeds=tuple(int(s) for s in args.seeds.split(",")))
    except ValueError as e:
        raise SystemExit(f"capacity: --sizes NODESxADAPTERS, --zipfs, --seeds: comma-separated numbers "
                         f"({e})") from None
    common = grid_common(args)
    policies = tuple(args.policies.split(",")) if args.policies else capacity_grid.POLICIES
    targets = SloTargets()
    runs = capacity_grid.run_grid(chosen, common, policies=policies, targets=targets, workers=args.workers)
    if args.save:
        Path(args.save).write_text(json.dumps(runs, indent=1, default=str) + "\n")
    print(capacity_table.header(common, targets, policies))
    if args.set:
        print(f"settings changed from their defaults (--set): {', '.join(args.set)}")
    print("\n" + capacity_table.markdown(runs))
    return 0 if all(v["passed"] for v in capacity_grid.verdicts(runs).values()) else 1


def _by_cell(runs: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    grouped: dict[Any, list[dict[str, Any]]] = {}
    for r in runs:
        grouped.setdefault(tuple(sorted(r["cell"].items())), []).append(r)
    return grouped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_cluster.sim.experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("grid", "capacity", "table", "sweep", "render", "router-cost", "chats"))
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--loads", help="loads, comma-separated (default: 1,2; grid: 1,1.5,2)")
    ap.add_argument("--zipfs", default=",".join(f"{z:g}" for z in acceptance.ZIPFS),
                    help="grid: Zipf exponents")
    ap.add_argument("--seeds", default=",".join(map(str, acceptance.SEEDS)), help="grid: seeds")
    ap.add_argument("--sizes", default=",".join(f"{n}x{a}" for n, a in acceptance.SIZES),
                    help="grid: NODESxADAPTERS, comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="grid: runs at a time, each in its own process")
    ap.add_argument("--policies", help=f"comma-separated (default: {','.join(ORDER)}; capacity: "
                    f"{','.join(capacity_grid.POLICIES)})")
    ap.add_argument("--duration", type=float, help="measured simulated seconds (default 120; grid: 60)")
    ap.add_argument("--warmup", type=float, help="unmeasured simulated seconds first (default 30; grid: 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="gpu",
                    help="replica profile: gpu (from papers), cpu (measured on this 2-core machine) "
                    "or a JSON path")
    ap.add_argument("--preload", type=int,
                    help="the N most popular adapters are in every node's store at start (`preload`; "
                    "default 0, every adapter only in S3; grid: every adapter)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a ServeConfig setting the policies read (repeatable), e.g. admission_capacity=64")
    ap.add_argument("--chats", type=int, default=1600, help="chats: users chatting at once")
    ap.add_argument("--turns", type=int, default=8, help="chats: turns per chat at most")
    ap.add_argument("--think", type=float, default=5.0,
                    help="chats: mean seconds between an answer and the next turn")
    ap.add_argument("--system-tokens", type=int, default=1000,
                    help="chats: tokens of each adapter's system prompt")
    ap.add_argument("--bases", type=int, default=1,
                    help="table/sweep: base models, the nodes split into this many replica groups "
                    "(sim.bases)")
    ap.add_argument("--base-nodes", default="",
                    help="table/sweep: each base's nodes, comma-separated (default: equal shares)")
    ap.add_argument("--save", help="JSON file of the runs (written by table/sweep/chats, read by render)")
    ap.add_argument("--plot", help="PNG to draw (sweep, render)")
    args = ap.parse_args(argv)
    if args.policies and any(p not in POLICIES for p in args.policies.split(",")):
        ap.error(f"--policies: one or more of {', '.join(POLICIES)}")
    if args.what == "capacity":
        return run_capacity(args)
    args.policies = args.policies or ",".join(ORDER)
    if args.what == "router-cost":
        print(router_cost())
        return 0
    if args.what == "grid":
        return run_acceptance(args)
    args.duration = 120.0 if args.duration is None else args.duration
    args.warmup = 30.0 if args.warmup is None else args.warmup
    if args.what == "chats":
        runs = chat_table.chat_runs(args, serve_settings(args.set))
        if args.save:
            Path(args.save).write_text(json.dumps(runs, indent=1, default=str) + "\n")
        print(chat_table.markdown(runs))
        return 0
    if args.what == "render":
        runs = json.loads(Path(args.save).read_text())
    else:
        runs = grid(args)
        if args.save:
            Path(args.save).write_text(json.dumps(runs, indent=1, default=str) + "\n")
    print(markdown(runs))
    if per_base := bases_markdown(runs):
        print("\nPer base model (replica groups, one base each; adapter i under base i % K)\n")
        print(per_base)
    if census := census_markdown(runs):
        print("\nAdapter slots by the popularity rank of their adapter, mean over the run (running: "
              "pinned by running requests; cached: evictable)\n")
        print(census)
    if served := served_markdown(runs):
        print("\nShare of each class's requests completed, by the popularity rank of their adapter\n")
        print(served)
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The capacity grid as markdown (`sim.capacity_grid`): one row per cell, capacities first, then the
hit rates at 0.9x of our capacity beside their bounds, then the verdict."""

from __future__ import annotations

from typing import Any

from lora_cluster.sim import capacity_grid as cg
from lora_cluster.sim.capacity import SloTargets
from lora_cluster.sim.grid import Common, start_state


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if value == float("inf") else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def header(common: Common, targets: SloTargets, policies: tuple[str, ...]) -> str:
    """What the grid ran: profile, start state, run length, targets, and what a cell must show."""
    return (f"profile {common.profile}; {start_state(common.preload)}; max_loras {common.max_loras}; "
            f"every other setting at its default; {common.duration:g} s measured after "
            f"{common.warmup:g} s of warm-up; policies {', '.join(policies)}.\nCapacity at SLO: the "
            f"largest load (x rated, bisection to 0.05x) with {targets.describe()}.\nA cell passes with "
            f"ours >= {cg.ORACLE_SHARE_TARGET:g}x the oracle's capacity and >= "
            f"{cg.BASELINE_MULTIPLE_TARGET:g}x the better baseline's, and at {cg.REFERENCE_LOAD:g}x of our "
            f"capacity a hit rate over offered requests >= {cg.PSB_SHARE_TARGET:g} x PSB and within "
            f"{100 * cg.ORACLE_GAP_TARGET:g} point of the oracle's.")


def _binding(search: dict[str, Any] | None) -> str:
    """The targets missed at the lowest failing load above the capacity: what limits the policy."""
    if not search:
        return "-"
    failed = sorted((p for p in search["probes"] if p["misses"] and p["load"] > search["capacity"]),
                    key=lambda p: p["load"])
    return "; ".join(failed[0]["misses"]) + f" at {failed[0]['load']:.2f}x" if failed else "-"


def markdown(runs: dict[str, list[dict[str, Any]]]) -> str:
    """One row per cell (see the module docstring), and how many cells pass."""
    verdicts = cg.verdicts(runs)
    searches = {(cg.CapacityCell(**s["cell"]), s["policy"]): s for s in runs["searches"]}
    ran = {s["policy"] for s in runs["searches"]}
    policies = [*cg.POLICIES, *sorted(ran.difference(cg.POLICIES))]  # a yardstick asked for: a column more
    pinned = cg.PINNED in ran
    lines = [f"| nodes x adapters | zipf | seed | capacity at SLO: {' / '.join(policies)} | ours / oracle "
             "| ours / better baseline | at 0.9x ours: hit rate completed / offered, PSB, static ceiling, "
             "old ceiling | oracle hit rate offered | "
             + (f"{cg.PINNED} hit rate offered | " if pinned else "")
             + "ours limited by | pass |",
             "|" + "---|" * (11 if pinned else 10)]
    passed = 0
    for cell in sorted(verdicts, key=lambda c: (-c.nodes, c.zipf, c.seed)):
        v = verdicts[cell]
        at = v["reference"].get(cg.OURS)
        oracle_at = v["reference"].get(cg.ORACLE)
        pinned_at = v["reference"].get(cg.PINNED)
        hits = "-" if at is None else (f"{_pct(at['hit_rate'])} / {_pct(at['hit_rate_offered'])}, "
                                       f"{_pct(at['psb'])}, {_pct(at['static_ceiling'])}, "
                                       f"{_pct(at['hit_rate_ceiling'])}")
        failed = [k for k, ok in v["checks"].items() if not ok]
        passed += v["passed"]
        lines.append(
            f"| {cell.nodes} x {cell.adapters} | {cell.zipf:g} | {cell.seed} "
            f"| {' / '.join(_x(v['capacity'].get(p)) for p in policies)} | {_ratio(v['oracle_share'])} "
            f"| {_ratio(v['baseline_multiple'])} | {hits} "
            f"| {_pct(oracle_at['hit_rate_offered']) if oracle_at else '-'} "
            + (f"| {_pct(pinned_at['hit_rate_offered']) if pinned_at else '-'} " if pinned else "")
            + f"| {_binding(searches.get((cell, cg.OURS)))} "
            f"| {'pass' if not failed else 'FAIL: ' + ', '.join(failed)} |")
    lines.append(f"\n{passed} of {len(verdicts)} cells pass.")
    return "\n".join(lines)

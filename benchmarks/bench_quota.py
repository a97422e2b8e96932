"""Cost of a quota check at the ingress: a `RemoteQuotas` lease on the cluster's `QuotaLedger` (a Ray
Serve deployment), against a ledger call for every request (exact, no lease) and the `QuotaBook`
in process (`LocalQuotas`, one ingress).

Each of `--calls` admissions of one tenant (600 requests/min, so a lease holds 10 requests) is
awaited one at a time from an asyncio caller (an ingress's view); finishes are not awaited, as in
the ingress. Runs alternate `--reps` times and each side keeps its best mean (this 2-core machine is
shared). Reported: mean, p50 and p99 per admission, and ledger calls per admission. The result goes
to `--out` (Markdown) with the machine, command and date.

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_quota.py [--calls 300] [--reps 3]
     [--out docs/bench_quota.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from typing import Any

from common import machine, percentile

from lora_cluster.serve.routing.quotas import LocalQuotas, QuotaLedger, RemoteQuotas
from lora_cluster.tenancy.quota import Account, Amounts, QuotaBook, QuotaLimits

LIMITS = QuotaLimits(requests_per_minute=600, tokens_per_minute=10**9, max_concurrent=10**6)


class PerRequest:
    """A ledger call for every admission (the exact design without leases)."""

    def __init__(self, handle: Any):
        self.handle, self.ledger_calls = handle, 0
        self.accounts: dict[str, Account] = {}  # tenant -> the ledger's account, as last heard
        self.paid: dict[str, int] = {}  # tenant -> completion tokens paid so far

    async def admit(self, tenant: str, limits: QuotaLimits, prompt_tokens: int) -> Any:
        self.ledger_calls += 1
        need = Amounts(1, prompt_tokens, 1)
        grant = await self.handle.grant.remote("bench", tenant, limits, need, Amounts())
        self.accounts[tenant] = grant.account
        return grant

    def finish(self, tenant: str, ticket: Any, completion_tokens: int) -> None:
        account = self.accounts[tenant]
        self.paid[tenant] = self.paid.get(tenant, 0) + completion_tokens
        totals = Account(account.id, account.granted, Amounts(slots=account.granted.slots), self.paid[tenant])
        self.handle.give_back.remote("bench", tenant, LIMITS, totals)


async def timed(quotas: Any, calls: int, tenant: str) -> tuple[list[float], int]:
    """Seconds of each awaited admission, and the ledger calls they made."""
    out, before = [], getattr(quotas, "ledger_calls", 0)
    for _ in range(calls):
        t0 = time.perf_counter()
        admission = await quotas.admit(tenant, LIMITS, 100)
        out.append(time.perf_counter() - t0)
        quotas.finish(tenant, getattr(admission, "ticket", None), 20)
    await asyncio.sleep(0.2)
    return out, getattr(quotas, "ledger_calls", 0) - before


async def alternate(handle: Any, calls: int, reps: int) -> dict[str, tuple[float, float, float, float]]:
    """Best (mean, p50, p99 in ms, ledger calls per admission) of each side over alternating runs."""
    sides = {"lease (RemoteQuotas)": RemoteQuotas(handle, lease_s=1.0),
             "ledger call per request": PerRequest(handle),
             "in process (LocalQuotas)": LocalQuotas(QuotaBook(time.monotonic))}
    best: dict[str, tuple[float, float, float, float]] = {}
    for rep in range(reps):
        for name, quotas in sides.items():
            samples, ledger_calls = await timed(quotas, calls, f"tenant-{rep}-{name}")
            row = (statistics.fmean(samples) * 1e3, statistics.median(samples) * 1e3,
                   percentile(samples, 0.99, "lower") * 1e3, ledger_calls / calls)
            if name not in best or row[0] < best[name][0]:
                best[name] = row
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        handle = serve.run(QuotaLedger.bind(900.0), name="bench-quota", route_prefix=None)
        best = asyncio.run(alternate(handle, args.calls, args.reps))
    finally:
        serve.shutdown()
        ray.shutdown()
    load = os.getloadavg()[0]
    command = " ".join(["python", *sys.argv])
    lines = ["# Quota check cost", "",
             f"{datetime.date.today()} on {machine()} (load average "
             f"{load:.1f} at the end), `{command}`; best mean of {args.reps} alternating runs of "
             f"{args.calls} awaited admissions of one tenant at 600 requests/min (a 1 s lease holds "
             "10 requests).", "",
             "| quotas | mean ms | p50 ms | p99 ms | ledger calls per admission |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {mean:.3f} | {p50:.3f} | {p99:.3f} | {per:.2f} |"
              for name, (mean, p50, p99, per) in best.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""What importing each process's entry module costs: the ingress, the request router, the controller.

Every ingress process, every request-router replica and every app deploy imports these modules; before
the request vocabulary left the engine (`lora_cluster.request`), each of them imported torch. Each
figure is the wall time of `import <module>` in a fresh interpreter (`python -c`, after the
interpreter's own start, measured inside it), the best of `--rounds` runs alternated across the
modules (this machine is noisy: the best is the least disturbed), and whether torch was loaded.

    python benchmarks/bench_imports.py --rounds 7 --out docs/bench_imports.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import common

MODULES = {
    "lora_cluster.serve.http.ingress": "the HTTP ingress (FastAPI app, routes, schemas)",
    "lora_cluster.serve.http.context": "what the routes share (tokenizers off the loop, limits)",
    "lora_cluster.serve.routing.request_router": "Ray's request router with the affinity score",
    "lora_cluster.serve.protocol": "what the ingress and the replicas exchange",
    "lora_cluster.serve.controller_actor": "the cluster controller's deployment",
    "lora_cluster.request": "the request vocabulary alone",
    "lora_cluster.engine": "the engine (a replica; imports torch by design)",
}
PROBE = ("import json, sys, time; t = time.perf_counter(); import {module}; "
         "print(json.dumps([time.perf_counter() - t, 'torch' in sys.modules]))")


def measure(module: str) -> tuple[float, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True, cwd=common.REPO, timeout=300).stdout
    seconds, torch = json.loads(out.strip().splitlines()[-1])
    return seconds, torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    best: dict[str, float] = {}
    torch_loaded: dict[str, bool] = {}
    for _ in range(args.rounds):
        for module in MODULES:
            seconds, torch = measure(module)
            best[module] = min(best.get(module, seconds), seconds)
            torch_loaded[module] = torch
    command = f"python benchmarks/bench_imports.py --rounds {args.rounds}"
    lines = [*common.header("Import cost of each process's entry module", command, level=2,
                            changed={}), f"- load average: {common.load_avg()}", "",
             "| module | what | import s (best) | torch loaded |", "|---|---|---:|---|"]
    lines += [f"| `{m}` | {what} | {best[m]:.2f} | {'yes' if torch_loaded[m] else 'no'} |"
              for m, what in MODULES.items()]
    common.emit("\n".join(lines), args.out, title="Import cost (benchmarks/bench_imports.py)",
                doc=__doc__.split("\n\n", 1)[1].split("\n\n    python", 1)[0] + "\n")


if __name__ == "__main__":
    main()

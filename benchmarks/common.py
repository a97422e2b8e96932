"""What the benchmarks share: the machine and commit they ran on, free ports, percentiles, the report
header and starting Ray Serve for a benchmark app.

Policy (the team's rule, carried by `header`): a benchmark runs the shipped defaults (`ServeConfig`,
`serve_config.yaml`); every setting it changes is printed in its report with the reason
(`changed_settings` refuses a change without one). Scripts import this module as `common` (the
scripts' folder is on `sys.path` when they run as `python benchmarks/<script>.py`).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# ----- where and what was measured ------------------------------------------------------------------


def machine() -> str:
    """CPU model, cores, RAM and the GPU (or "no GPU"), e.g. `AMD EPYC 7B13, 2 cores, 24 GiB RAM, no GPU`."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = f", {int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem = ""
    return f"{cpu}, {os.cpu_count()} cores{mem}, {gpu()}"


def gpu() -> str:
    """The first CUDA device's name, or "no GPU" (also when torch is not installed)."""
    try:
        import torch
    except ImportError:
        return "no GPU"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def software() -> str:
    """Python, torch and Ray versions (those installed)."""
    parts = [f"Python {sys.version.split()[0]}"]
    for name, label in (("torch", "torch"), ("ray", "Ray")):
        with contextlib.suppress(ImportError):
            parts.append(f"{label} {__import__(name).__version__}")
    return ", ".join(parts)


def code_version() -> str:
    """The commit the library was measured at, and whether lora_cluster/ differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lora_cluster"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"commit {head or 'unknown'}" + (" with uncommitted changes in lora_cluster/" if dirty else "")


def freeze_recording() -> None:
    """Move what the process holds now (a recording of calls to replay) out of the collector's reach
    (`gc.freeze`, after a full collection): a controller replayed from it is then collected as in the
    controller actor's process, which holds no recording, and a full collection does not walk the
    recording's millions of objects and charge the call it interrupts (`gc.unfreeze` to undo)."""
    gc.collect()
    gc.freeze()


def load_avg() -> str:
    """The 1, 5 and 15-minute load averages, `1.2 / 0.9 / 0.7` (the machine is shared)."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def now() -> str:
    """Local time with its offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def changed_settings(settings: Mapping[str, Any], reasons: Mapping[str, str]) -> dict[str, str]:
    """`setting value` -> reason for every entry of `settings` that differs from `ServeConfig`'s
    default. A changed setting without a reason in `reasons` is a ValueError naming it: the report
    must say why a benchmark does not run what users get."""
    from lora_cluster.config import ServeConfig
    from lora_cluster.config.serve import FLAT

    out: dict[str, str] = {}
    for name, value in settings.items():  # a flat name: one of a section's fields, or a top-level one
        top_level = name in ServeConfig.model_fields and name not in FLAT.sections
        if name not in FLAT.where and not top_level:
            raise ValueError(f"{name} is not a ServeConfig setting")
        info = FLAT.field(name) if name in FLAT.where else ServeConfig.model_fields[name]
        if value == info.get_default(call_default_factory=True):
            continue
        if name not in reasons:
            raise ValueError(f"the benchmark changes {name} to {value!r} without saying why")
        out[f"{name} {value}"] = reasons[name]
    return out


def header(title: str, command: str, *, level: int = 1, date: str | None = None,
           code: str | None = None, machine_note: str = "", command_note: str = "",
           changed: Mapping[str, str] | None = None) -> list[str]:
    """The first lines of a markdown report: title (a heading of `level`), date, machine, software and
    commit, command, and (when `changed` is given) the settings changed from the shipped defaults with
    their reasons."""
    lines = [f"{'#' * level} {title}", "", f"- date: {date or now()}",
             f"- machine: {machine()}{machine_note}",
             f"- software: {software()}; lora-cluster at {code or code_version()}",
             f"- command: `{command}`{command_note}"]
    if changed is not None:
        lines.append("- settings: " + ("the shipped defaults" if not changed else
                                       "the shipped defaults except " + "; ".join(
                                           f"{k} ({why})" for k, why in changed.items())))
    return lines


def emit(text: str, out: Path | None, *, title: str | None = None, doc: str | None = None) -> None:
    """Print a report and write it to `out` when given, under `# title` and `doc` (the script's
    docstring) when a title is given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text((f"# {title}\n\n{doc}\n" if title else "") + text + "\n")


def symlink_farm(root: Path, targets: Sequence[Path], n: int, *, prefix: str = "x", first: int = 0) -> Path:
    """`root/<prefix>0 .. <prefix>{n-1}`: many adapter ids for a few adapter folders, link `k` to
    `targets[(first + k) % len(targets)]`; links already there are kept (made once per folder)."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        link = root / f"{prefix}{k}"
        if not link.exists():
            os.symlink(targets[(first + k) % len(targets)], link)
    return root


# ----- statistics -------------------------------------------------------------------------------------


def rank_index(n: int, q: float) -> int:
    """The index of quantile `q` in `n` sorted samples by the rank rule `min(n - 1, int(q * n))`."""
    return min(n - 1, int(q * n))


def percentile(values: Sequence[float], q: float, method: str = "rank") -> float:
    """Quantile `q` (0..1) of `values`; NaN when there are none. Methods (each keeps the figures of
    the reports that use it): `rank` (the default: the sorted sample at `rank_index`), `lower` (at
    `int(q * (n - 1))`), `nearest` (at `round(q * (n - 1))`) and `linear` (interpolated between the
    two neighbours, as `statistics.quantiles(method="inclusive")`)."""
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    if method == "rank":
        return s[rank_index(n, q)]
    if method == "lower":
        return s[int(q * (n - 1))]
    if method == "nearest":
        return s[min(n - 1, round(q * (n - 1)))]
    if method == "linear":
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(n - 1, lo + 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    raise ValueError(f"percentile method {method!r}: one of rank, lower, nearest, linear")


def summary(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90 and p99 (rank rule) of `values` (not empty)."""
    return {"mean": statistics.fmean(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99)}


# ----- an in-process engine under open-loop arrivals ----------------------------------------------------


@dataclass
class OpenLoopRun:
    """What `open_loop` saw: per request id, when it was added and its adapter; its TTFT in seconds
    (those that produced a token); and how many finished without an error."""

    added: dict[str, tuple[float, str]] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)
    done: int = 0


def open_loop(engine: Any, plan: Sequence[tuple[float, str]], params: Any, *, tag: str,
              prompts: Sequence[str], bound_s: float = math.inf) -> OpenLoopRun:
    """Requests `(offset s, adapter)` added to `engine` (an `Engine`) at their offsets while it steps,
    prompts cycling over `prompts`, ids `<tag>-<i>`; until every request ended or `bound_s` passed."""
    run = OpenLoopRun()
    start, i = time.perf_counter(), 0
    while (i < len(plan) or engine.has_unfinished()) and time.perf_counter() - start < bound_s:
        now = time.perf_counter() - start
        while i < len(plan) and plan[i][0] <= now:
            rid = f"{tag}-{i}"
            engine.add_request(rid, prompts[i % len(prompts)], plan[i][1], params)
            run.added[rid] = (time.perf_counter(), plan[i][1])
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.005, max(0.0, plan[i][0] - now)))
            continue
        for out in engine.step():
            if out.request_id not in run.ttft and out.token_ids:
                run.ttft[out.request_id] = time.perf_counter() - run.added[out.request_id][0]
            if out.finished and out.error is None:
                run.done += 1
    return run


# ----- ports and Ray Serve ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_mode(mode: str) -> contextlib.AbstractContextManager[Any]:
    """The environment of Ray Serve's `mode`: `default` changes nothing; `throughput` is the
    throughput-optimized mode (HAProxy, direct ingress) with its files and ports private to the run.
    Enter it before Ray starts: its controller and replicas read it."""
    if mode == "default":
        return contextlib.nullcontext()
    if mode == "throughput":
        from lora_cluster.serve.ops.serve_mode import private_throughput_mode

        return private_throughput_mode()
    raise ValueError(f"serve mode {mode!r}: default or throughput")


def start_serve(num_cpus: int, **ray_init: Any) -> str:
    """Start a local Ray with `num_cpus` CPUs (no dashboard, workers' logs not forwarded) and Serve's
    HTTP proxy on a free port of 127.0.0.1; returns `http://127.0.0.1:<port>`. The caller deploys its
    apps with `serve.run` and ends with `serve.shutdown()` and `ray.shutdown()`."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             **ray_init)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"

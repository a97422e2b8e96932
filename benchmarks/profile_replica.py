"""Measure the replica model of the cluster simulator (`lora_cluster.sim`) on this machine.

    .venv/bin/python benchmarks/profile_replica.py [--out docs/profile_cpu.json] [--size base] [--reps 3]

What it measures, with the real engine (`lora_cluster.engine.Engine`) on the demo zoo:

* step time against batch composition: decode-only steps of n running sequences with d distinct
  adapters (n in 1..32, d in 1..16), and prefill steps of one prompt of p tokens; fitted by least
  squares to `step_s = base_s + per_prefill_token_s * prefill_tokens + per_decode_token_s *
  decode_tokens + per_adapter_s * distinct_adapters` (the residual is written next to the fit);
* adapter load time per tier by adapter size: disk -> host (the tiered store's load from the zoo
  folder: read, sha256, parse, validate) and host -> device (`AdapterPool.allocate`; on this CPU-only
  machine the device is host memory); each fitted to `fixed_s + per_mb_s * MB`;
* S3 -> disk is not measured here: it is fitted from the two rows of docs/bench_store.md (moto's
  single-threaded server on 127.0.0.1), as that file says;
* the demo adapters' sizes (the simulator draws adapter sizes from them).

Each point is the fastest of `--reps` repetitions (a decode point: the median of its steps): the
machine is shared with other jobs, whose interference only adds time. The fit's residual is part
of the output. The run takes one to two minutes with `--size base`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import machine

from lora_cluster.demo import build_demo_zoo
from lora_cluster.engine import Engine, SamplingParams, build_engine

MB = 1 << 20
DECODE_POINTS = ((1, 1), (8, 1), (8, 8), (16, 1), (16, 16), (32, 1), (32, 8), (32, 16))
PREFILL_POINTS = (64, 256, 512, 1024)
# docs/bench_store.md, S3 -> disk (download into the disk cache): 34.8 ms median per adapter for the
# 16-adapter set (92.7 MB, i.e. 5.8 MB per adapter) and 211.8 ms for the 52.1 MB adapter.
S3_ROWS = ((92.7 / 16, 0.0348), (52.1, 0.2118))


def fit_line(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares `y = fixed_s + per_mb_s * x` over (x MB, y seconds)."""
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    (slope, intercept) = np.polyfit(x, y, 1)
    return {"fixed_s": max(0.0, float(intercept)), "per_mb_s": max(0.0, float(slope))}


def prompt_ids(engine: Engine, n: int, salt: int) -> list[int]:
    vocab = engine.model.dims.vocab_size
    return [(salt * 7919 + 31 * k) % (vocab - 16) + 8 for k in range(n)]


def decode_point(engine: Engine, n: int, d: int, adapters: list[str], salt: int) -> float:
    """Median seconds of a decode-only step of `n` sequences over `d` distinct adapters."""
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    ids = [f"dec-{salt}-{k}" for k in range(n)]
    for k, rid in enumerate(ids):
        engine.add_request(rid, prompt_ids(engine, 16, salt + k), adapter_id=adapters[k % d],
                           sampling=sampling)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times[1:])


def prefill_point(engine: Engine, p: int, adapter: str, salt: int) -> float:
    """Seconds of the step that prefills one prompt of `p` tokens (nothing else running)."""
    rid = f"pre-{salt}"
    engine.add_request(rid, prompt_ids(engine, p, salt), adapter_id=adapter,
                       sampling=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    engine.abort(rid)
    return dt


def measure_steps(engine: Engine, adapters: list[str], reps: int) -> list[dict[str, float]]:
    for aid in adapters:  # every adapter on the device first: step times without loads
        engine.load_adapter(aid)
    prefill_point(engine, 32, adapters[0], 0)  # warm-up
    decode_point(engine, 8, 8, adapters, 1)
    rows = []
    for n, d in DECODE_POINTS:
        s = min(decode_point(engine, n, d, adapters, 1000 * r + n) for r in range(reps))
        rows.append({"prefill_tokens": 0, "decode_tokens": n, "adapters": d, "step_s": s})
    for p in PREFILL_POINTS:
        s = min(prefill_point(engine, p, adapters[0], 5000 + 10 * r + p) for r in range(reps))
        rows.append({"prefill_tokens": p, "decode_tokens": 0, "adapters": 1, "step_s": s})
    return rows


def fit_steps(rows: list[dict[str, float]]) -> dict[str, float]:
    x = np.array([[1.0, r["prefill_tokens"], r["decode_tokens"], r["adapters"]] for r in rows])
    y = np.array([r["step_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    residual = y - x @ coef
    return {"base_s": float(coef[0]), "per_prefill_token_s": float(coef[1]),
            "per_decode_token_s": float(coef[2]), "per_adapter_s": float(coef[3]),
            "rms_residual_s": float(np.sqrt(np.mean(residual ** 2)))}


def measure_tiers(engine: Engine, zoo_adapters: Path, adapters: list[str], reps: int) -> dict[str, object]:
    store = engine.loader
    disk_points, device_points, sizes = [], [], []
    for aid in adapters:
        nbytes = sum(f.stat().st_size for f in (zoo_adapters / aid).iterdir())
        sizes.append(nbytes)
        disk, device = [], []
        for _ in range(reps):
            engine.unload_adapter(aid)
            store.host.remove(aid)
            t0 = time.perf_counter()
            weights = store.load(aid)
            disk.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.pool.allocate(weights)
            device.append(time.perf_counter() - t0)
            engine.pool.evict(aid)
        disk_points.append((nbytes / MB, min(disk)))
        device_points.append((nbytes / MB, min(device)))
    return {
        "host": {**fit_line(device_points), "what": "host -> device slot (AdapterPool.allocate), measured",
                 "points_mb_s": device_points},
        "disk": {**fit_line(disk_points), "what": "disk -> host (store.load from the folder: read, sha256, "
                 "parse, validate), measured", "points_mb_s": disk_points},
        "s3": {**fit_line(list(S3_ROWS)), "what": "S3 -> disk, fitted from docs/bench_store.md (moto on "
               "127.0.0.1), not measured by this script", "points_mb_s": list(S3_ROWS)},
        "sizes": sizes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/profile_cpu.json")
    ap.add_argument("--size", choices=("tiny", "base"), default="base")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--work", default=None, help="folder for the demo zoo (default: a temporary one)")
    args = ap.parse_args()
    started = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="profile-replica-"))
    zoo = build_demo_zoo(work / f"zoo-{args.size}", num_adapters=args.adapters, size=args.size, seed=0)
    max_num_seqs, budget = 32, 2048
    engine = build_engine(model=str(zoo.model_dir), adapter_source=str(zoo.adapters_dir),
                          max_loras=args.adapters, max_lora_rank=32, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, host_cache_bytes="2GiB", prefetch_min_requests=0)
    rows = measure_steps(engine, zoo.adapter_ids, args.reps)
    tiers = measure_tiers(engine, zoo.adapters_dir, zoo.adapter_ids, args.reps)
    engine.close()
    sizes = tiers.pop("sizes")
    profile = {
        "name": "cpu-measured",
        "label": f"measured on this machine: demo zoo '{args.size}' model, engine on CPU "
                 f"({os.cpu_count()} cores), torch {torch.__version__}",
        "measured": True,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": f"{machine()}, 1-minute load average at the end {os.getloadavg()[0]:.1f}",
        "engine": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget},
        "step": {**fit_steps(rows), "points": rows},
        "tiers": {"device_hit_s": 0.0, **tiers},
        "adapter_sizes_bytes": sizes,
        "node": {"host_cache_bytes": 4 << 30, "disk_cache_bytes": 20 << 30,
                 "what": "the EngineConfig defaults (host_cache_bytes, disk_cache_bytes)"},
        "profile_seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({k: profile[k] for k in ("step", "profile_seconds")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Listing and admission with thousands of adapters on S3 (a moto server on 127.0.0.1).

Uploads `--adapters` copies of the tiny demo zoo's smallest adapter under `s3://bench/zoo/x<i>/`
(config + safetensors each; ids differ), then, through the tiered adapter store exactly as the
engine builds it:

  list cold      `list_adapters()` on a fresh store (what `/v1/models` asks: ids from the paginated
                 key listing)
  list warm      `list_adapters()` again
  describe cold  `describe_adapters()` on that store (rank, modules, sizes for `adapters list`: the
                 key listing plus every adapter's config, read concurrently)
  describe warm  `describe_adapters()` again (configs cached by ETag: the key listing only)
  admit cold     `load(id)` of an adapter never seen: locate (one prefix listing), download into the
                 disk tier, admission checks, host copy
  admit warm     `load(id)` again (host hit)

Run: RAY_AUTH_MODE=disabled python benchmarks/bench_s3_list.py [--adapters 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--zoo", type=Path, default=Path(tempfile.gettempdir()) / "lora-cluster-scale-zoo")
    args = ap.parse_args()

    import boto3
    import torch
    from moto.server import ThreadedMotoServer

    from lora_cluster.config import EngineConfig
    from lora_cluster.demo import build_demo_zoo
    from lora_cluster.engine.model.model_loader import load_base_model
    from lora_cluster.store import TieredAdapterStore

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=endpoint)
    zoo = build_demo_zoo(args.zoo, num_adapters=16, size="tiny", seed=0)
    smallest = min((p for p in zoo.adapters_dir.iterdir() if p.is_dir()),
                   key=lambda p: sum(f.stat().st_size for f in p.iterdir()))
    files = {f.name: f.read_bytes() for f in smallest.iterdir() if f.is_file()}
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket="bench", Key=kv[0], Body=kv[1]),
                      ((f"zoo/x{i}/{name}", body) for i in range(args.adapters)
                       for name, body in files.items())))
    print(f"uploaded {args.adapters} adapters ({len(files)} objects each, {sum(map(len, files.values()))} B) "
          f"in {time.perf_counter() - start:.1f} s")

    model = load_base_model(str(zoo.model_dir), dtype=torch.float32, device=torch.device("cpu"))
    shapes = model.dims.shapes()
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        t = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
        return result

    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            config = EngineConfig(model=str(zoo.model_dir), adapter_source=["s3://bench/zoo"],
                                  disk_cache_dir=cache)
            store = TieredAdapterStore.from_config(config, shapes, torch.device("cpu"))
            ids = timed("list cold", store.list_adapters)
            assert len(ids) == args.adapters, (len(ids), args.adapters)
            timed("list warm", store.list_adapters)
            timed("describe cold", store.describe_adapters)
            timed("describe warm", store.describe_adapters)
            aid = f"x{(r * 997) % args.adapters}"
            timed("admit cold", lambda: store.load(aid))  # noqa: B023
            timed("admit warm", lambda: store.load(aid))  # noqa: B023
            store.close()
    server.stop()
    print(f"\n| operation ({args.adapters} adapters on S3) | best ms | median ms |\n|---|---:|---:|")
    for name, samples in times.items():
        print(f"| {name} | {min(samples):.1f} | {statistics.median(samples):.1f} |")


if __name__ == "__main__":
    main()

"""The cluster tier on a real 3-node Ray cluster (`ray.cluster_utils.Cluster`), adapters in a moto S3
server behind a proxy capped at a measured bandwidth (a slow source on purpose).

An adapter node 1 fetched from S3 reaches node 2 through the cluster tier in about the time of an
object-store transfer of the same size measured beside it, not the S3 time; a copy whose checksum
does not match is refused (the source serves); and when node 1 goes while node 2 copies from it, node 2
still gets the adapter, and a later miss falls back to the source.
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from remote_sources import S3, TcpProxy

from lora_cluster.engine.model.model_loader import load_base_model

pytestmark = pytest.mark.e2e
RATE = 128 << 10  # bytes per second through the S3 proxy
BIG = "a2"  # ~262 KB of weights: about 2 s from the capped S3


class NodeStore:
    """One node's tiered store with the cluster tier wired (a Ray actor pinned to its node)."""

    def __init__(self, bucket: str, shapes: Any, disk_dir: str):
        import ray

        from lora_cluster.serve.replica.cluster_tier import ACTOR_NAME, RayClusterTier
        from lora_cluster.store import TieredAdapterStore
        from lora_cluster.store.admission import AdmissionPolicy

        node_id = ray.get_runtime_context().get_node_id()
        tier = RayClusterTier(lambda: ray.get_actor(ACTOR_NAME), node_id, timeout_s=10.0)
        self.store = TieredAdapterStore([f"s3://{bucket}/zoo"], AdmissionPolicy(shapes, 64),
                                        disk_cache_dir=disk_dir, fetch_backoff_s=0.01, cluster_tier=tier)

    def load(self, adapter_id: str) -> dict[str, Any]:
        """Load `adapter_id`: a digest of its weights and the store's cluster and source load counts."""
        start = time.monotonic()
        weights = self.store.load(adapter_id)
        seconds = time.monotonic() - start
        digest = hashlib.sha256()
        for name in sorted(weights.a):
            digest.update(weights.a[name].numpy().tobytes() + weights.b[name].numpy().tobytes())
        return {"seconds": seconds, "weights": digest.hexdigest(), **self.loads()}

    def loads(self) -> dict[str, tuple[int, float]]:
        """The store's loads so far from the cluster tier and from the source: (count, seconds)."""
        stats = self.store.stats.snapshot()
        return {t: (stats[t]["loads"], stats[t]["load_seconds_total"]) for t in ("cluster", "source")}

    def put_blob(self, nbytes: int) -> list[Any]:
        import ray

        return [ray.put({"weights": bytes(nbytes)})]

    def get_blob(self, boxed: list[Any]) -> float:
        import ray

        start = time.monotonic()
        ray.get(boxed[0])
        return time.monotonic() - start


def wait_published(tier: Any, adapter_id: str, timeout_s: float = 30.0) -> list[str]:
    """The holders of `adapter_id` once the tier lists it (publication runs off the load, just after)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        holders = ray.get(tier.published.remote()).get(adapter_id)
        if holders:
            return holders
        time.sleep(0.05)
    return []


@pytest.fixture(scope="module")
def cluster(moto_endpoint: str, demo_adapters_dir: Path, demo_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory):
    """Head + 3 nodes (resources node1..node3), the tier actor on the head, a store actor per node;
    the module's tests share it (the last one removes node 1)."""
    import boto3
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lora_cluster.serve.replica.cluster_tier import cluster_tier_actor

    host, port = moto_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)), rate_bytes_per_s=RATE)
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():
            env.setenv(name, value)
        env.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        client = boto3.session.Session().client("s3", endpoint_url=moto_endpoint)
        client.create_bucket(Bucket=bucket)
        S3(moto_endpoint, bucket, client, env).upload(demo_adapters_dir, "zoo")
        env.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # before the nodes start: their workers inherit it
        base = load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu"))
        shapes, root = base.dims.shapes(), tmp_path_factory.mktemp("cluster_tier")
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
        nodes = {f"node{i}": c.add_node(num_cpus=1, resources={f"node{i}": 1}, object_store_memory=80 << 20)
                 for i in (1, 2, 3)}
        ray.init(address=c.address)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
        try:
            head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            tier = cluster_tier_actor(1 << 30, scheduling_strategy=head)
            remote = ray.remote(num_cpus=0)(NodeStore)
            stores = {name: remote.options(resources={name: 0.01}).remote(bucket, shapes, str(root / name))
                      for name in nodes}
            yield c, nodes, tier, stores
        finally:
            ray.shutdown()
            c.shutdown()
            proxy.kill()


def test_an_adapter_fetched_on_one_node_reaches_another_through_the_object_store(
        cluster, demo_adapters_dir: Path) -> None:
    import ray

    _, nodes, tier, stores = cluster
    first = ray.get(stores["node1"].load.remote(BIG))
    assert first["source"][0] == 1 and first["cluster"][0] == 0, "node 1 fetched it from S3"
    assert wait_published(tier, BIG) == [nodes["node1"].node_id], "node 1 published it"
    s3_s = first["source"][1]
    nbytes = sum(p.stat().st_size for p in (demo_adapters_dir / BIG).iterdir() if p.is_file())
    transfer_s = ray.get(stores["node2"].get_blob.remote(ray.get(stores["node1"].put_blob.remote(nbytes))))
    second = ray.get(stores["node2"].load.remote(BIG))
    cluster_s = second["cluster"][1]
    print(f"\nS3 (capped at {RATE >> 10} KiB/s): {s3_s:.3f} s; object-store transfer of {nbytes} bytes "
          f"node 1 -> node 2: {transfer_s:.4f} s; cluster-tier copy: {cluster_s:.4f} s")
    assert second["cluster"][0] == 1 and second["source"][0] == 0, "node 2 copied it from node 1, not from S3"
    assert second["weights"] == first["weights"], "the same weights on both nodes"
    assert cluster_s < s3_s / 4, f"the copy ({cluster_s:.3f} s) is far from the S3 time ({s3_s:.3f} s)"
    assert cluster_s - transfer_s < 0.5, (
        f"the copy ({cluster_s:.3f} s) is close to the object-store transfer ({transfer_s:.3f} s): one more "
        "round trip to the tier actor, the checksums and the disk cache's commit")


def test_a_copy_that_fails_its_checksum_is_refused_and_the_source_serves(
        cluster, demo_adapters_dir: Path) -> None:
    import ray

    _, _, tier, stores = cluster
    folder = demo_adapters_dir / "a3"
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    tampered = {n: b[:-1] + bytes([b[-1] ^ 1]) if n.endswith(".safetensors") else b for n, b in files.items()}
    nbytes = sum(map(len, files.values()))
    assert ray.get(tier.claim.remote("a3", nbytes)), "a3 is not published yet"
    ray.get(tier.publish.remote("a3", "elsewhere", [ray.put(tampered)], nbytes, digests))
    got = ray.get(stores["node3"].load.remote("a3"))
    assert got["cluster"][0] == 0, "the tampered copy was not taken"
    assert got["source"][0] == 1, "the source served it"


def test_losing_the_publishing_node_mid_transfer_loses_no_adapter(cluster) -> None:
    import ray

    c, nodes, tier, stores = cluster
    reference = ray.get(stores["node1"].load.remote("a4"))
    assert wait_published(tier, "a4"), "node 1 published a4"
    copying = stores["node2"].load.remote("a4")  # node 2's copy from node 1 starts ...
    c.remove_node(nodes["node1"])  # ... while node 1 goes
    got = ray.get(copying, timeout=60)
    path = "the cluster tier" if got["cluster"][0] else "the source"
    print(f"\nnode 2 got a4 from {path} while node 1 went")
    assert got["weights"] == reference["weights"], "node 2 still got a4, with the same weights"
    before = ray.get(stores["node3"].loads.remote())
    later = ray.get(stores["node3"].load.remote("a4"), timeout=60)
    assert later["weights"] == reference["weights"], "a later miss on node 3 gets a4 too"
    fetched = sum(later[t][0] - before[t][0] for t in ("cluster", "source"))
    assert fetched == 1, "from the source, or from node 2's own publication"

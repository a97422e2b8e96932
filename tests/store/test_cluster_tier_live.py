"""The cluster tier on a real 3-node Ray cluster (`ray.cluster_utils.Cluster`), adapters in a moto S3
server behind a proxy capped at a measured bandwidth (a slow source on purpose).

An adapter node 1 fetched from S3 reaches node 2 through the cluster tier in about the time of an
object-store transfer of the same size measured beside it, not the S3 time; a copy whose checksum
does not match is refused (the source serves); a replica whose demand prefetch polls the cluster
controller's hot list holds a hot adapter before its first request; and when node 1 goes while node 2
copies from it, node 2 still gets the adapter, and a later miss falls back to the source.
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
SERVE = "serve"  # the namespace of Serve's replicas, where a replica's tier actors live
APP = "tier-app"


class NodeStore:
    """One node's tiered store with the cluster tier wired (a Ray actor pinned to its node)."""

    def __init__(self, bucket: str, shapes: Any, disk_dir: str, app: str | None = None,
                 host_int8: bool = False):
        """`app`: the tier of that Serve application (its detached actors, in Serve's namespace, as a
        replica wires them); None: the fixture's tier actor and this node's plain holder."""
        import ray

        from lora_cluster.serve.replica.cluster_tier import ACTOR_NAME, RayClusterTier
        from lora_cluster.serve.replica.tier_actors import cluster_tier_actor, node_holder
        from lora_cluster.store import TieredAdapterStore
        from lora_cluster.store.admission import AdmissionPolicy

        node_id = ray.get_runtime_context().get_node_id()
        if app is None:
            tier = RayClusterTier(lambda: ray.get_actor(ACTOR_NAME), lambda: node_holder(node_id), node_id,
                                  timeout_s=10.0)
        else:
            tier = RayClusterTier(lambda: cluster_tier_actor(1 << 30, app, namespace=SERVE),
                                  lambda: node_holder(node_id, app, namespace=SERVE), node_id, timeout_s=10.0)
        self.tier = tier
        self.store = TieredAdapterStore([f"s3://{bucket}/zoo"], AdmissionPolicy(shapes, 64),
                                        disk_cache_dir=disk_dir, fetch_backoff_s=0.01, cluster_tier=tier,
                                        host_int8=host_int8)
        self.bucket, self.shapes = bucket, shapes  # what another store of this cluster is built with

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

    def host_weights(self, adapter_id: str) -> str:
        """A digest of the weights its host tier gives for `adapter_id` (dequantized when int8)."""
        weights = self.store.host.get(adapter_id)
        assert weights is not None, f"{adapter_id} is in the host tier"
        digest = hashlib.sha256()
        for name in sorted(weights.a):
            digest.update(weights.a[name].numpy().tobytes() + weights.b[name].numpy().tobytes())
        return digest.hexdigest()

    def tier_local(self) -> tuple[str, ...]:
        """What this node's tier edge says it holds (its replica's report field `cluster_held`)."""
        return self.tier.local_adapters()

    def tier_counters(self) -> dict[str, int]:
        """Its cluster tier's counters (what the replica reports for /metrics)."""
        return self.tier.counters()

    def settings(self) -> tuple[str, Any]:
        """(bucket, model shapes): what another store of this cluster is built with."""
        return self.bucket, self.shapes

    def put_blob(self, nbytes: int) -> list[Any]:
        import ray

        return [ray.put({"weights": bytes(nbytes)})]

    def get_blob(self, boxed: list[Any]) -> float:
        import ray

        start = time.monotonic()
        ray.get(boxed[0])
        return time.monotonic() - start


class PrefetchingNode(NodeStore):
    """A node store with a replica's demand prefetch (`serve.replica.demand_prefetch`) over the real
    controller's hot list; its loads go through an engine's fetch queue at a request's priority (the
    prefetch yields to them). An async actor: the prefetch loop runs on its event loop."""

    def __init__(self, bucket: str, shapes: Any, disk_dir: str, controller: Any):
        from lora_cluster.engine.adapters.fetch_queue import FetchQueue
        from lora_cluster.serve.replica.demand_prefetch import ControllerHotList, DemandPrefetch

        super().__init__(bucket, shapes, disk_dir)
        self.queue = FetchQueue(1, max_prefetches=4)
        self.prefetch = DemandPrefetch(ControllerHotList(controller), self.store, self, bytes_per_s=100 << 20,
                                       max_bytes=2 << 30, period_s=0.2)

    def live_fetches(self) -> int:
        return self.queue.live()

    async def start(self) -> None:
        self.prefetch.start()

    async def holds(self, adapter_id: str) -> bool:
        return adapter_id in self.store.host

    async def request(self, adapter_id: str) -> dict[str, Any]:
        """A request's load (priority 0, as the engine's residency queues it), off the event loop."""
        import asyncio

        return await asyncio.wrap_future(self.queue.submit(self.load, adapter_id, 0))

    async def counts(self) -> dict[str, tuple[int, float]]:
        return self.loads()


class TierReplica(NodeStore):
    """A Serve replica whose store reaches its application's cluster tier as `LoraReplica` wires it."""

    def __init__(self, bucket: str, shapes: Any, disk_dir: str):
        from ray import serve

        super().__init__(bucket, shapes, disk_dir, serve.get_replica_context().app_name)


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


def poll_value(read: Any, want: Any, timeout_s: float = 10.0) -> Any:
    """`read()` until it gives `want` or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


@pytest.fixture(scope="module")
def cluster(moto_endpoint: str, demo_adapters_dir: Path, demo_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory):
    """Head + 3 nodes (resources node1..node3), the tier actor on the head, a store actor per node;
    the module's tests share it (the last one removes node 1)."""
    import boto3
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lora_cluster.serve.replica.tier_actors import cluster_tier_actor

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
    # node 1's publishing thread counts its publication once the holder's put returns, which may be
    # after the index already answered node 2
    counters = stores["node1"].tier_counters
    published = poll_value(lambda: ray.get(counters.remote())["cluster_tier_publications"], 1)
    assert published == 1, "node 1 counts its publication"
    copied = ray.get(stores["node2"].tier_counters.remote())["cluster_tier_fetches"]
    assert copied == 1, "node 2 counts its copy"
    assert BIG in ray.get(stores["node1"].tier_local.remote()), "node 1 reports the copy it published"
    assert BIG in ray.get(stores["node2"].tier_local.remote()), "node 2 reports the copy it made"
    assert BIG not in ray.get(stores["node3"].tier_local.remote()), "node 3 has no copy to report"
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


def test_int8_nodes_copy_the_int8_form_node_to_node(cluster, tmp_path: Path) -> None:
    import ray

    from lora_cluster.store.int8_form import INT8_FILE

    _, _, tier, stores = cluster
    bucket, shapes = ray.get(stores["node2"].settings.remote())
    int8_node = ray.remote(num_cpus=0)(NodeStore)
    two, three = (int8_node.options(resources={n: 0.01}).remote(bucket, shapes, str(tmp_path / n), None, True)
                  for n in ("node2", "node3"))
    first = ray.get(two.load.remote("a8"))
    assert first["source"][0] == 1, "node 2 fetched a8 from S3"
    assert wait_published(tier, "a8"), "node 2 published a8's int8 form"
    got = ray.get(three.load.remote("a8"))
    assert got["cluster"][0] == 1 and got["source"][0] == 0, "node 3 copied the int8 form from node 2"
    assert got["weights"] == ray.get(two.host_weights.remote("a8")), (
        "node 3 serves node 2's int8 copy as it is (nothing quantized again)")
    kept = sorted(p.name for p in (tmp_path / "node3").rglob("*.safetensors*"))
    assert kept == [INT8_FILE], "node 3's disk tier keeps the int8 form"


def test_a_replica_prefetches_a_hot_adapter_before_its_first_request(
        cluster, tmp_path: Path) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lora_cluster.cluster.reports import ReplicaReport
    from lora_cluster.config import ServeConfig
    from lora_cluster.serve.controller_actor import ClusterController

    _, nodes, tier, stores = cluster
    head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = ray.remote(num_cpus=0)(ClusterController.func_or_class).options(
        scheduling_strategy=head).remote(ServeConfig().model_dump())
    first = ray.get(stores["node1"].load.remote("a5"))  # node 1 serves a5: S3, then published
    assert first["source"][0] >= 1, "node 1 fetched a5 from S3"
    assert wait_published(tier, "a5"), "node 1 published a5"
    report = ReplicaReport("node1-replica", nodes["node1"].node_id, capacity=2, max_num_seqs=2, max_loras=4,
                           running=0, waiting=0, free_adapter_slots=4, adapter_requests={"a5": 40})
    ray.get(controller.report.remote(report.to_dict()))  # node 1's replica: demand for a5
    assert ray.get(controller.hot_adapters.remote(32))[0][0] == "a5", "a5 tops the controller's hot list"
    bucket, shapes = ray.get(stores["node3"].settings.remote())
    node = ray.remote(num_cpus=0)(PrefetchingNode).options(resources={"node3": 0.01}).remote(
        bucket, shapes, str(tmp_path / "prefetching"), controller)
    ray.get(node.start.remote())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ray.get(node.holds.remote("a5")):
        time.sleep(0.05)
    before = ray.get(node.counts.remote())
    assert ray.get(node.holds.remote("a5")), "the replica's host tier holds a5 before any request for it"
    assert before["cluster"][0] == 1 and before["source"][0] == 0, (
        "the prefetch copied a5 from node 1 through the cluster tier, not from S3")
    got = ray.get(node.request.remote("a5"))
    assert got["weights"] == first["weights"], "the first request gets a5's weights"
    assert got["source"] == before["source"] and got["cluster"] == before["cluster"], (
        "the first request fetched nothing: neither the source nor the cluster tier")


def test_a_replaced_replica_keeps_its_nodes_copies_and_the_apps_teardown_ends_the_tier(
        cluster, tmp_path: Path) -> None:
    import ray
    from ray import serve

    from lora_cluster.serve.replica.tier_actors import holder_name, index_name

    _, nodes, _, stores = cluster
    node1, node2 = nodes["node1"].node_id, nodes["node2"].node_id
    bucket, shapes = ray.get(stores["node1"].settings.remote())
    serve.start(proxy_location="Disabled")
    replica = serve.deployment(TierReplica).options(
        name="TierReplica", ray_actor_options={"num_cpus": 0, "resources": {"node1": 0.01}})
    handle = serve.run(replica.bind(bucket, shapes, str(tmp_path / "replica")), name=APP, route_prefix=None)
    try:
        first = handle.load.remote("a7").result(timeout_s=60)
        index = ray.get_actor(index_name(APP), namespace=SERVE)
        assert first["source"][0] == 1, "the replica on node 1 fetched a7 from S3"
        assert wait_published(index, "a7") == [node1], "node 1 published a7 into the application's tier"
        (old,) = serve_replicas()
        ray.kill(ray.get_actor(old.name, namespace=SERVE), no_restart=True)  # Serve replaces it
        reader = ray.remote(num_cpus=0)(NodeStore).options(resources={"node2": 0.01}).remote(
            bucket, shapes, str(tmp_path / "reader"), APP)
        got = ray.get(reader.load.remote("a7"), timeout=60)
        gone = old.actor_id not in {a.actor_id for a in serve_replicas()}
        assert gone, "the replica that published a7 is gone"
        assert got["cluster"][0] == 1 and got["source"][0] == 0, (
            "node 2 copied a7 from node 1's holder after the replica that published it was killed")
        assert got["weights"] == first["weights"], "the same weights"
    finally:
        serve.delete(APP)
    names = [index_name(APP), holder_name(APP, node1), holder_name(APP, node2)]
    deadline, left = time.monotonic() + 40, names
    while left and time.monotonic() < deadline:
        left = [n for n in names if actor_exists(n, SERVE)]
        time.sleep(0.5)
    serve.shutdown()
    assert left == [], f"the application's tier actors ended with the application (left: {left})"


def serve_replicas() -> list[Any]:
    """The live replicas of the test application's `TierReplica` (Ray's state API)."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", f"ServeReplica:{APP}:TierReplica"), ("state", "=", "ALIVE")]
    return list_actors(filters=filters)


def actor_exists(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def test_losing_the_publishing_node_mid_transfer_loses_no_adapter(cluster) -> None:
    import os
    import signal

    import ray

    c, nodes, tier, stores = cluster
    node1 = nodes["node1"].node_id
    reference = ray.get(stores["node1"].load.remote("a4"))
    assert wait_published(tier, "a4") == [node1], "node 1 published a4"
    owner = holder_pid(f"lora_cluster_tier:{node1}")
    earlier = ray.get(stores["node2"].loads.remote())
    os.kill(owner, signal.SIGSTOP)  # node 1's holder, which owns the object, freezes: no copy can end
    try:
        copying = stores["node2"].load.remote("a4")  # node 2's copy from node 1 starts ...
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ray.get(tier.transfers.remote()).get(node1, 0) < 1:
            time.sleep(0.02)
        in_progress = ray.get(tier.transfers.remote()).get(node1, 0)
        ready, _ = ray.wait([copying], timeout=0)
        assert in_progress == 1 and not ready, "node 2's copy from node 1 has begun and not ended"
        c.remove_node(nodes["node1"])  # ... and node 1 goes while it is in progress
    finally:
        if _alive(owner):  # the kill failed: let it run again rather than leave it frozen
            os.kill(owner, signal.SIGCONT)
    got = ray.get(copying, timeout=60)
    from_source, copied = (got[t][0] - earlier[t][0] for t in ("source", "cluster"))
    assert from_source == 1 and copied == 0, (
        "the copy from node 1 failed with node 1, and node 2 fetched a4 from the source")
    assert got["weights"] == reference["weights"], "node 2 still got a4, with the same weights"
    assert node1 not in ray.get(tier.transfers.remote()), "the tier no longer counts a copy from node 1"
    before = ray.get(stores["node3"].loads.remote())
    later = ray.get(stores["node3"].load.remote("a4"), timeout=60)
    assert later["weights"] == reference["weights"], "a later miss on node 3 gets a4 too"
    fetched = sum(later[t][0] - before[t][0] for t in ("cluster", "source"))
    assert fetched == 1, "from the source, or from node 2's own publication"


def holder_pid(name: str, namespace: str | None = None) -> int:
    """The process of the live actor named `name` (a node's holder owns the objects it published)."""
    from ray.util.state import list_actors

    filters = [("name", "=", name), ("state", "=", "ALIVE")]
    (actor,) = [a for a in list_actors(filters=filters) if namespace is None or a.ray_namespace == namespace]
    return int(actor.pid)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

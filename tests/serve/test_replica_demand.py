"""A replica counts a request as demand for its adapter (`adapter_requests` of its controller report:
the controller's hot list, demand prefetches and placement read it) only when some source has that
adapter. A name no source has is answered 404 by the replica, and its count is taken back: before,
a client sending such names drew prefetches and placement to them, and took places under the count's
bound from real adapters. A real `LoraReplica` outside Ray Serve on the tiny demo zoo."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from lora_cluster.engine import SamplingParams
from lora_cluster.serve.protocol import GenerateJob


@pytest.fixture
def replica(demo_zoo, monkeypatch):
    from lora_cluster.serve.replica import deployment as replica_module

    monkeypatch.setattr(replica_module.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=str))
    monkeypatch.setattr(replica_module, "configure_logging", lambda *args, **kwargs: None)
    monkeypatch.setattr(replica_module.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    made = replica_module.LoraReplica.func_or_class({
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)], "max_loras": 2,
        "max_num_seqs": 4, "lora_cpu_native": False})
    yield made
    made.aengine.shutdown()


def _job(i: int, adapter_id: str) -> GenerateJob:
    return GenerateJob(request_id=f"q{i}", prompt=[40, 41, 42], adapter_id=adapter_id,
                       sampling=SamplingParams(max_new_tokens=2), stream=False)


@pytest.mark.engine
def test_only_adapters_a_source_has_are_counted_as_demand(replica):
    real = "a0"  # of the demo zoo (a0..a15)

    async def run() -> list[dict]:
        names = [real, "no-such-adapter", real, "no-such-adapter", "another-missing-one"]
        return [await replica.complete(_job(i, name)) for i, name in enumerate(names)]

    replies = asyncio.run(run())
    missing = [r for r in replies if "error" in r]
    assert len(missing) == 3, f"each missing adapter is an error reply: {replies}"
    assert all(r["error"]["code"] == "adapter_not_found" for r in missing), missing
    assert replica.demand.take() == {real: 2}, "the missing names are not demand; the real adapter's two are"

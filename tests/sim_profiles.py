"""A small synthetic replica profile for the simulator's tests: cheap steps, fixed tier costs."""

from __future__ import annotations

from lora_cluster.sim.profile import ReplicaProfile, TierCost

SYNTHETIC = ReplicaProfile(
    name="test", label="synthetic", measured=False, base_s=0.01, per_prefill_token_s=0.001,
    per_decode_token_s=0.0005, per_adapter_s=0.002, host_to_device=TierCost(0.001, 0.0),
    disk_to_host=TierCost(0.02, 0.0), s3_to_disk=TierCost(0.1, 0.0), adapter_sizes=(1 << 20,),
    host_cache_bytes=64 << 20, disk_cache_bytes=256 << 20, max_num_seqs=4, max_num_batched_tokens=256)

"""The replica model's constants: a profile, measured on the real engine or taken from papers.

A profile (JSON, see `benchmarks/profile_replica.py` for the measured one and
`docs/profile_gpu_papers.json` for the one from papers) gives:

* the step time of one engine step, linear in its composition:
  `base_s + per_prefill_token_s * prefill tokens + per_decode_token_s * decode tokens +
  per_adapter_s * distinct adapters in the batch`;
* the time to move an adapter of a given size between tiers, each `fixed_s + per_mb_s * MB`:
  `host` (host memory -> device slot, done inside an engine step), `disk` (local disk -> host,
  off the step loop) and `s3` (S3 -> local disk); a device hit costs nothing; optionally `peer`
  (one node's copy of an adapter to another node, over the network: the cluster tier,
  `sim.cluster_store`; without it the cluster tier is not modelled);
* the adapter sizes to draw from (bytes), the node's memory budgets (host cache, disk cache) and
  the engine's batch shape (`max_num_seqs`, `max_num_batched_tokens`);
* optionally the engine's KV pool in tokens (`engine.kv_cache_tokens`), which bounds the replica's
  prefix cache (`sim.prefix_cache`); without it, `max_num_seqs` sequences of `max_num_batched_tokens`
  tokens (the engine's CPU default: `max_num_seqs` full-length sequences).

`profile_path("cpu")` / `profile_path("gpu")` name the committed profiles in `docs/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs"
NAMED = {"cpu": "profile_cpu.json", "gpu": "profile_gpu_papers.json"}


@dataclass(frozen=True)
class TierCost:
    fixed_s: float
    per_mb_s: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + self.per_mb_s * nbytes / MB


@dataclass(frozen=True)
class ReplicaProfile:
    name: str
    label: str
    measured: bool
    base_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_adapter_s: float
    host_to_device: TierCost
    disk_to_host: TierCost
    s3_to_disk: TierCost
    adapter_sizes: tuple[int, ...]
    host_cache_bytes: int
    disk_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_tokens: int | None = None  # the engine's KV pool (None: see `kv_tokens`)
    node_to_node: TierCost | None = None  # a copy between nodes (None: no cluster tier modelled)

    @property
    def kv_tokens(self) -> int:
        """Tokens the engine's KV pool holds (running sequences and cached prefixes together)."""
        return self.kv_cache_tokens or self.max_num_seqs * self.max_num_batched_tokens

    def step_s(self, prefill_tokens: int, decode_tokens: int, adapters: int) -> float:
        """Seconds of one engine step with this composition."""
        return (self.base_s + self.per_prefill_token_s * prefill_tokens
                + self.per_decode_token_s * decode_tokens + self.per_adapter_s * adapters)

    def fetch_s(self, tier: str, nbytes: int) -> float:
        """Seconds to bring an adapter from `tier` ("host", "disk", "s3") into host memory."""
        if tier == "host":
            return 0.0
        seconds = self.disk_to_host.seconds(nbytes)
        return seconds + self.s3_to_disk.seconds(nbytes) if tier == "s3" else seconds

    def peer_fetch_s(self, nbytes: int) -> float:
        """Seconds to bring an adapter from another node into host memory: the copy over the network,
        then the same checksum and parse as a read from local disk."""
        if self.node_to_node is None:
            raise ValueError(f"profile {self.name} has no node-to-node cost (tiers.peer)")
        return self.node_to_node.seconds(nbytes) + self.disk_to_host.seconds(nbytes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaProfile:
        step, tiers, node, engine = d["step"], d["tiers"], d["node"], d["engine"]

        def tier(name: str) -> TierCost:
            return TierCost(float(tiers[name]["fixed_s"]), float(tiers[name]["per_mb_s"]))

        return cls(
            name=d["name"], label=d["label"], measured=bool(d["measured"]),
            base_s=float(step["base_s"]), per_prefill_token_s=float(step["per_prefill_token_s"]),
            per_decode_token_s=float(step["per_decode_token_s"]), per_adapter_s=float(step["per_adapter_s"]),
            host_to_device=tier("host"), disk_to_host=tier("disk"), s3_to_disk=tier("s3"),
            adapter_sizes=tuple(int(s) for s in d["adapter_sizes_bytes"]),
            host_cache_bytes=int(node["host_cache_bytes"]), disk_cache_bytes=int(node["disk_cache_bytes"]),
            max_num_seqs=int(engine["max_num_seqs"]),
            max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
            kv_cache_tokens=int(engine["kv_cache_tokens"]) if "kv_cache_tokens" in engine else None,
            node_to_node=tier("peer") if "peer" in tiers else None,
        )


def profile_path(name_or_path: str) -> Path:
    """`cpu`, `gpu` (the committed profiles in docs/) or a path to a profile JSON."""
    return DOCS / NAMED[name_or_path] if name_or_path in NAMED else Path(name_or_path)


def load_profile(name_or_path: str) -> ReplicaProfile:
    path = profile_path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"no replica profile at {path} (benchmarks/profile_replica.py measures one)")
    return ReplicaProfile.from_dict(json.loads(path.read_text()))

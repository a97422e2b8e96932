"""bench_sla's served setup: two CPU LoRA replicas of `max_num_seqs` 4 (8 batch slots), and the
modes compared, each a Serve application deployed from `app_config`.

Every mode sets `less_urgent_prefill_chunk` 32 (a step an interactive request waits for stays
short) and the benchmark's SLA classes; the modes differ only in `MODE_CONFIG`.
"""

from __future__ import annotations

from typing import Any

MAX_NUM_SEQS = 4
NUM_REPLICAS = 2
SLOTS = MAX_NUM_SEQS * NUM_REPLICAS
SERVE_MODE_NOTE = {"default": "its HTTP proxy", "throughput": "direct ingress behind HAProxy"}

MODE_CONFIG: dict[str, dict[str, Any]] = {
    "on": {"controller": True},
    "off": {"controller": False, "max_ongoing_requests": MAX_NUM_SEQS},
    "engine": {"controller": False},
    # diagnostic: the controller with urgent tickets preempting after 10% of their target instead of 50%
    "on-eager": {"controller": True, "preempt_after_fraction": 0.1},
}


def uses_controller(mode: str) -> bool:
    return bool(MODE_CONFIG[mode].get("controller", True))


def app_config(zoo: Any, mode: str, classes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": str(zoo.model_dir), "adapter_source": [str(zoo.adapters_dir)],
            "num_replicas": NUM_REPLICAS, "num_cpus": 1, "max_loras": 8, "max_lora_rank": 32,
            "max_num_seqs": MAX_NUM_SEQS, "sla_classes": classes, "less_urgent_prefill_chunk": 32,
            **MODE_CONFIG[mode]}

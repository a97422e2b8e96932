"""The multi-LoRA inference engine (pure torch, no Ray).

`build_engine(...)` (`engine.factory`) builds an `Engine` wired to the adapter store of its config;
`AsyncEngine` runs one on a loop thread. Importing this package imports no torch: the names below
load their module on first use, so pure policies (`engine.prefill_plan`, `engine.adapters.urgency`)
are importable without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_cluster.engine.async_engine import AsyncEngine
    from lora_cluster.engine.factory import build_engine
    from lora_cluster.engine.llm_engine import Engine, EngineStats
    from lora_cluster.request.output import FinishReason, RequestOutput
    from lora_cluster.request.sampling_params import SamplingParams

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "AsyncEngine": "lora_cluster.engine.async_engine",
    "build_engine": "lora_cluster.engine.factory",
    "Engine": "lora_cluster.engine.llm_engine",
    "EngineStats": "lora_cluster.engine.llm_engine",
    "SamplingParams": "lora_cluster.request.sampling_params",  # the request vocabulary (torch-free)
    "FinishReason": "lora_cluster.request.output",
    "RequestOutput": "lora_cluster.request.output",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AsyncEngine", "Engine", "EngineStats", "FinishReason", "RequestOutput", "SamplingParams",
           "build_engine"]

"""The multi-LoRA inference engine (pure torch, no Ray).

`build_engine(...)` (`engine.factory`) builds an `Engine` wired to the adapter store of its config;
`AsyncEngine` runs one on a loop thread. `SamplingParams`, `RequestOutput` and `FinishReason` are the
request vocabulary (`lora_cluster.request`, torch-free), re-exported here for the engine's callers.
Importing this package imports torch; the pure policies the engine runs are in `replica_policy`.

Rooms, bottom to top (each imports only rooms below it; `tests/project/test_layering.py` checks it):
`sample/` (logits to tokens, stopping), `schedule/` (sequences, the scheduler, the KV cache's blocks),
`adapters/` (the adapter slot pool and its policies), `model/` (the base model, the step batch, the
forward pass and sampling). The modules here import the rooms: `llm_engine` (`Engine`: the step),
`factory` (the composition root) and `async_engine` (the loop thread).
"""

from __future__ import annotations

from lora_cluster.engine.async_engine import AsyncEngine
from lora_cluster.engine.factory import build_engine
from lora_cluster.engine.llm_engine import Engine, EngineStats
from lora_cluster.request import FinishReason, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineStats", "FinishReason", "RequestOutput", "SamplingParams",
           "build_engine"]

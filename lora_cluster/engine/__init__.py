"""The multi-LoRA inference engine (pure torch, no Ray)."""

from lora_cluster.engine.async_engine import AsyncEngine
from lora_cluster.engine.factory import build_engine
from lora_cluster.engine.llm_engine import Engine, EngineStats
from lora_cluster.engine.sampling import SamplingParams
from lora_cluster.engine.sequence import FinishReason, RequestOutput

__all__ = ["AsyncEngine", "Engine", "EngineStats", "FinishReason", "RequestOutput", "SamplingParams",
           "build_engine"]

"""The one typed configuration of lora-cluster.

Every field documents itself, is validated when the config is built, and can be overridden by an
environment variable `LORA_CLUSTER_<FIELD>` (for example `LORA_CLUSTER_MAX_LORAS=16`). Explicit
arguments (Python keyword arguments, serve_config.yaml application args) win over the environment,
which wins over the defaults. List fields accept a comma-separated string in the environment.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from lora_cluster.errors import ConfigError


def _split_list(value: object) -> object:
    """Accept `"a,b"` as well as `["a", "b"]` for list fields."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


StrList = Annotated[list[str], NoDecode]


class EngineConfig(BaseSettings):
    """Configuration of one engine (one replica): model, adapter slots, batching and cache tiers."""

    model_config = SettingsConfigDict(env_prefix="LORA_CLUSTER_", extra="forbid", validate_default=True)

    model: str = Field(description="Base model: a local folder or a Hugging Face hub id.")
    adapter_source: StrList = Field(
        default_factory=list,
        description="Where adapters come from, first match wins: folders, file://, s3://bucket/prefix, "
        "hf://org/name[@rev]. An adapter id names a sub-folder (or key prefix) of a source.",
    )
    max_loras: int = Field(8, ge=1, le=4096, description="Adapter slots on the device, allocated at start.")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest adapter rank the slots can hold.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    device: str = Field("auto", description="torch device; auto = cuda when available, else cpu.")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Sequences decoded together (KV cache slots).")
    max_model_len: int = Field(
        2048, ge=16, description="Longest sequence (prompt + output) in tokens; capped by the model's own."
    )
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one engine step (prefill chunks plus decodes)."
    )
    max_waiting: int = Field(
        4096, ge=1, description="Requests that may wait for a slot; more are refused as overloaded."
    )
    kernel: Literal["auto", "reference", "cpu", "triton"] = Field(
        "auto", description="LoRA kernel implementation; auto = triton on CUDA, cpu otherwise."
    )
    adapter_load_workers: int = Field(2, ge=1, le=64, description="Threads that load adapters off the step loop.")

    @field_validator("adapter_source", mode="before")
    @classmethod
    def _sources(cls, value: object) -> object:
        return _split_list(value)

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes one token per step)"
            )
        return self


def build_config(cls: type[BaseSettings], **kwargs: object) -> BaseSettings:
    """Build a config, turning pydantic's validation error into a `ConfigError` naming the fields."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"invalid {cls.__name__}: {e}") from e

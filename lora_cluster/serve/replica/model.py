"""The served model: `model: demo` resolution and the ingress-side tokenizer.

`model: demo` (the default) means the built-in demo zoo: every process that needs it (the app
builder, each replica, the ingress) calls `resolve_model`, which builds the zoo into `demo_dir` if
it is missing and is a cheap no-op otherwise (the build is atomic and safe to race).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lora_cluster.config import ServeConfig
from lora_cluster.errors import ConfigError

log = logging.getLogger(__name__)

DEMO = "demo"


def served_name(config: ServeConfig) -> str:
    """The base model's name in the API."""
    return config.served_model_name or config.model


def resolve_model(config: ServeConfig) -> ServeConfig:
    """`config` with `model: demo` replaced by the demo zoo's folders (built on first use)."""
    if config.model != DEMO:
        return config
    from lora_cluster.demo import build_demo_zoo

    folder = Path(config.demo_dir).expanduser() / f"{config.demo_size}-{config.demo_num_adapters}"
    zoo = build_demo_zoo(folder, num_adapters=config.demo_num_adapters, size=config.demo_size, seed=0)
    log.info("demo zoo at %s (%d adapters)", zoo.model_dir.parent, len(zoo.adapter_ids))
    engine: dict[str, Any] = {"model": str(zoo.model_dir)}
    if not config.engine.adapter_source:
        engine["adapter_source"] = [str(zoo.adapters_dir)]
    name = config.served_model_name or DEMO
    return config.model_copy(update={"model": str(zoo.model_dir), "served_model_name": name,
                                     "engine": config.engine.model_copy(update=engine)})


def load_tokenizers(configs: dict[str, ServeConfig]) -> dict[str, Any]:
    """Each base model's tokenizer by its API name (`served_name`), from replica groups' `configs`
    (by group name, their `model: demo` resolved): loaded once per distinct base, so at most one per
    group. Raises ConfigError naming the first group whose base's tokenizer cannot be loaded (the
    error's type, never a server path)."""
    tokenizers: dict[str, Any] = {}
    by_model: dict[str, Any] = {}
    for name, config in configs.items():
        base = served_name(config)
        if base in tokenizers:
            continue
        if config.model not in by_model:
            try:
                by_model[config.model] = load_tokenizer(config)
            except Exception as exc:  # a missing, partial or unreadable tokenizer: the start stops here
                raise ConfigError(f"replica group {name!r}: the tokenizer of its base model {base!r} cannot "
                                  f"be loaded ({type(exc).__name__})") from None
        tokenizers[base] = by_model[config.model]
    return tokenizers


def load_tokenizer(config: ServeConfig) -> Any:
    """The base model's tokenizer, loaded the way the engine loads it (same ids, same chat template)."""
    from transformers import AutoTokenizer

    from lora_cluster.engine.model.model_loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(resolve_model(config).model))

"""Where the engine gets adapters from: the loader protocol and the plain folder loader.

The engine calls `load(adapter_id)` from its loader threads, never from the step loop, and places
the returned host weights into a device slot itself. A loader is thread-safe, validates what it
returns (`adapter_format.load_peft_adapter`) and raises an `AdapterError` naming the adapter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from lora_cluster.adapter_format import LoraWeights, ModelShapes, load_peft_adapter
from lora_cluster.errors import AdapterNotFoundError

_ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)*")


def check_adapter_id(adapter_id: str) -> str:
    """Adapter ids name sub-folders or key prefixes: no traversal, no absolute paths, no odd bytes."""
    if not isinstance(adapter_id, str) or len(adapter_id) > 256 or not _ADAPTER_ID.fullmatch(adapter_id) or (
        ".." in adapter_id.split("/")
    ):
        raise AdapterNotFoundError(str(adapter_id)[:256], "invalid adapter id (letters, digits, '._-/' only)")
    return adapter_id


class AdapterLoader(Protocol):
    def load(self, adapter_id: str) -> LoraWeights:
        """Fetch, validate and return the adapter's host weights (blocking, thread-safe)."""
        ...

    def list_adapters(self) -> list[str]:
        """Ids of the adapters the sources offer."""
        ...


class FolderAdapterLoader:
    """Adapters are sub-folders of local source folders; the first folder holding the id wins."""

    def __init__(self, sources: list[str], shapes: ModelShapes, max_rank: int):
        self.folders = [Path(s.removeprefix("file://")).expanduser() for s in sources]
        self.shapes, self.max_rank = shapes, max_rank

    def load(self, adapter_id: str) -> LoraWeights:
        check_adapter_id(adapter_id)
        for folder in self.folders:
            if (folder / adapter_id).is_dir():
                return load_peft_adapter(adapter_id, folder / adapter_id, self.shapes, self.max_rank)
        where = ", ".join(str(f) for f in self.folders) or "no adapter_source configured"
        raise AdapterNotFoundError(adapter_id, f"not found in {where}")

    def list_adapters(self) -> list[str]:
        seen: dict[str, None] = {}
        for folder in self.folders:
            if folder.is_dir():
                for cfg in sorted(folder.glob("**/adapter_config.json")):
                    seen.setdefault(cfg.parent.relative_to(folder).as_posix(), None)
        return list(seen)

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
    if (
        not isinstance(adapter_id, str)
        or len(adapter_id) > 256
        or not _ADAPTER_ID.fullmatch(adapter_id)
        or (".." in adapter_id.split("/"))
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

    def register(self, adapter_id: str, location: str) -> None:
        """Serve `adapter_id` from `location` (vLLM's load_lora_adapter); validates before returning."""
        ...

    def unregister(self, adapter_id: str) -> bool:
        """Forget a registered adapter id; False when it was not registered."""
        ...


class FolderAdapterLoader:
    """Adapters are sub-folders of local source folders; the first folder holding the id wins."""

    def __init__(self, sources: list[str], shapes: ModelShapes, max_rank: int):
        self.folders = [Path(s.removeprefix("file://")).expanduser() for s in sources]
        self.shapes, self.max_rank = shapes, max_rank
        self._registered: dict[str, Path] = {}

    def load(self, adapter_id: str) -> LoraWeights:
        check_adapter_id(adapter_id)
        if adapter_id in self._registered:
            return load_peft_adapter(adapter_id, self._registered[adapter_id], self.shapes, self.max_rank)
        for folder in self.folders:
            if (folder / adapter_id).is_dir():
                return load_peft_adapter(adapter_id, folder / adapter_id, self.shapes, self.max_rank)
        where = ", ".join(str(f) for f in self.folders) or "no adapter_source configured"
        raise AdapterNotFoundError(adapter_id, f"not found in {where}")

    def register(self, adapter_id: str, location: str) -> None:
        check_adapter_id(adapter_id)
        folder = Path(location.removeprefix("file://")).expanduser()
        load_peft_adapter(adapter_id, folder, self.shapes, self.max_rank)  # refuse what would fail later
        self._registered[adapter_id] = folder

    def unregister(self, adapter_id: str) -> bool:
        return self._registered.pop(adapter_id, None) is not None

    def list_adapters(self) -> list[str]:
        seen: dict[str, None] = dict.fromkeys(self._registered)
        for folder in self.folders:
            if folder.is_dir():
                for cfg in sorted(folder.glob("**/adapter_config.json")):
                    seen.setdefault(cfg.parent.relative_to(folder).as_posix(), None)
        return list(seen)
